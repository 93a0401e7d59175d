// whale's version: CMake's project() reads it from here, and the ranks of a job
// compare it (with the numerics of the build: runtime/agree.hpp's build_id).
#pragma once

#define WHALE_VERSION_MAJOR 0
#define WHALE_VERSION_MINOR 1
#define WHALE_VERSION_PATCH 0

namespace whale {
/// "major.minor.patch".
inline constexpr const char* version = "0.1.0";
static_assert(WHALE_VERSION_MAJOR == 0 && WHALE_VERSION_MINOR == 1 && WHALE_VERSION_PATCH == 0,
              "whale::version must spell WHALE_VERSION_MAJOR.MINOR.PATCH");
}  // namespace whale

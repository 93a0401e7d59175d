// Output files: a path checked before any work (its directory exists and can
// be written; it is not a directory), and a whole file written atomically (to
// a temporary name beside it, flushed, then renamed over it, so a crash or a
// full disk never leaves a truncated file). Every error names the file and
// the system's reason (strerror).
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace whale::detail {

inline std::string system_reason(int err) { return std::strerror(err); }

/// Why `path` cannot be written as an output file, or "" if it can: its
/// directory must exist and accept a new file, and `path` must not be a directory.
inline std::string output_path_problem(const std::string& path) {
  if (path.empty()) return "the path is empty";
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return "it is a directory";
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string probe = dir + "/.whale-write-check-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return "cannot create a file in '" + dir + "': " + system_reason(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return {};
}

/// Flush directory `dir`'s entries to disk (what a rename or a new file in it
/// changed), so they survive a power loss. Throws naming `what` and the directory.
inline void sync_directory(const std::string& dir, const std::string& what) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(what + ": cannot open the directory '" + dir + "' to sync it: " + system_reason(errno));
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL)  // EINVAL: a file system that does not sync directories
    throw std::runtime_error(what + ": cannot sync the directory '" + dir + "': " + system_reason(err));
}

/// Write `data` to `path` atomically: `path.tmp.<pid>`, flushed to disk, then
/// renamed over `path`, and the directory synced.
/// Throws std::runtime_error naming `what`, the file and the system's reason; the temporary is removed.
inline void write_file_atomically(const std::string& path, std::string_view data, const std::string& what) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto fail = [&](const std::string& step, int err) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(what + ": cannot " + step + " '" + path + "': " + system_reason(err));
  };
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("create a temporary file for", errno);
  if (!data.empty() && std::fwrite(data.data(), 1, data.size(), f) != data.size()) {
    const int err = errno;
    std::fclose(f);
    fail("write", err);
  }
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) {
    const int err = errno;
    std::fclose(f);
    fail("write", err);
  }
  if (std::fclose(f) != 0) fail("write", errno);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("rename the finished temporary file to", errno);
  const auto slash = path.find_last_of('/');
  sync_directory(slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash)), what);
}

}  // namespace whale::detail

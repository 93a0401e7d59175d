// Strict parsing of flag and environment values: the whole string must be a
// number in range (no "2x", "nan", "abc" or "-5" taken for something else),
// booleans only as true/false/1/0/yes/no/on/off. Every error names the flag
// or variable, the value and what is allowed. No flag tables here.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>

namespace whale::detail {

/// A value that is not allowed: the message names the origin, the value and the rule.
struct parse_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

inline std::string quoted(std::string_view v) {
  std::string s;
  s.reserve(v.size() + 2);
  s += '\'';
  s.append(v);
  s += '\'';
  return s;
}

/// An integer in [lo, hi]: `origin` is the flag or variable ("--steps", "WHALE_BUCKET_MIB").
inline long long parse_int(std::string_view text, std::string_view origin, long long lo = 0,
                           long long hi = std::numeric_limits<long long>::max()) {
  const std::string s(text);
  errno = 0;
  char* end = nullptr;
  const long long v = s.empty() ? 0 : std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || std::isspace(static_cast<unsigned char>(s[0])))
    throw parse_error(std::string(origin) + " " + quoted(text) + ": expected a whole number from " + std::to_string(lo) +
                      " to " + std::to_string(hi));
  if (v < lo || v > hi)
    throw parse_error(std::string(origin) + " " + quoted(text) + ": out of range; allowed " + std::to_string(lo) +
                      " to " + std::to_string(hi));
  return v;
}

/// A finite number in [lo, hi] (`open_lo`: strictly above lo).
inline double parse_double(std::string_view text, std::string_view origin, double lo, double hi, bool open_lo = false) {
  const std::string s(text);
  errno = 0;
  char* end = nullptr;
  const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
  auto range = [&] {
    return (open_lo ? "above " : "from ") + std::to_string(lo) + (open_lo ? " up to " : " to ") + std::to_string(hi);
  };
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v) ||
      std::isspace(static_cast<unsigned char>(s[0])) || s.find_first_of("xX") != std::string::npos)  // no hex floats
    throw parse_error(std::string(origin) + " " + quoted(text) + ": expected a finite number " + range());
  if (v < lo || v > hi || (open_lo && v == lo))
    throw parse_error(std::string(origin) + " " + quoted(text) + ": out of range; allowed " + range());
  return v;
}

/// true/false, 1/0, yes/no, on/off (lower case).
inline bool parse_bool(std::string_view text, std::string_view origin) {
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off") return false;
  throw parse_error(std::string(origin) + " " + quoted(text) + ": expected true/false, 1/0, yes/no or on/off");
}

}  // namespace whale::detail

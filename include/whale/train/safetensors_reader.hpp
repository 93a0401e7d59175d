// Reading a safetensors file: its JSON header parsed strictly (each tensor's
// dtype, shape and byte range checked against the file), and `st_reader`,
// which reads a tensor's floats (F32, F16 and BF16 widened) or integers by
// name. Part of train/safetensors.hpp.
#pragma once

#include <sys/types.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/train/checkpoint.hpp"

namespace whale::ckpt {

/// One tensor entry of a safetensors header.
struct st_entry {
  std::string dtype;
  std::vector<std::int64_t> shape, offsets;
};

/// The tensors of a safetensors header; its "__metadata__" strings go to
/// `meta` where given. Throws naming the problem, prefixed by `who`.
inline std::map<std::string, st_entry> parse_st_header(const std::string& h, const std::string& path,
                                                      std::map<std::string, std::string>* meta = nullptr,
                                                      const char* who = "whale::import_safetensors") {
  std::size_t i = 0;
  auto bad = [&](const std::string& why) -> void {
    throw std::runtime_error(std::string(who) + ": '" + path + "': the header is not valid (" + why + " at byte " + std::to_string(i) + ")");
  };
  auto ws = [&] { while (i < h.size() && (h[i] == ' ' || h[i] == '\n' || h[i] == '\t' || h[i] == '\r')) ++i; };
  auto expect = [&](char c) {
    ws();
    if (i >= h.size() || h[i] != c) bad(std::string("expected '") + c + "'");
    ++i;
  };
  auto str = [&] {
    expect('"');
    std::string s;
    while (i < h.size() && h[i] != '"') {
      if (h[i] == '\\' && i + 1 < h.size()) ++i;
      s += h[i++];
    }
    if (i >= h.size()) bad("an unterminated string");
    ++i;
    return s;
  };
  auto integer = [&] {
    ws();
    std::size_t j = i;
    while (j < h.size() && h[j] >= '0' && h[j] <= '9') ++j;
    if (j == i || j - i > 18) bad("expected a non-negative integer");
    const auto v = std::stoll(h.substr(i, j - i));
    i = j;
    return static_cast<std::int64_t>(v);
  };
  auto ints = [&] {
    std::vector<std::int64_t> v;
    expect('[');
    ws();
    if (i < h.size() && h[i] == ']') return ++i, v;
    for (;;) {
      v.push_back(integer());
      ws();
      if (i < h.size() && h[i] == ',') { ++i; continue; }
      expect(']');
      return v;
    }
  };
  std::map<std::string, st_entry> out;
  expect('{');
  ws();
  if (i < h.size() && h[i] == '}') return out;
  for (;;) {
    const std::string key = str();
    expect(':');
    expect('{');
    st_entry e;
    ws();
    if (!(i < h.size() && h[i] == '}'))
      for (;;) {
        const std::string k = str();
        expect(':');
        ws();
        if (k == "dtype") e.dtype = str();
        else if (k == "shape") e.shape = ints();
        else if (k == "data_offsets") e.offsets = ints();
        else if (key == "__metadata__") {
          auto v = str();
          if (meta) (*meta)[k] = std::move(v);
        }
        else bad("an unknown field '" + k + "'");
        ws();
        if (i < h.size() && h[i] == ',') { ++i; continue; }
        break;
      }
    expect('}');
    if (key != "__metadata__") out[key] = e;
    ws();
    if (i < h.size() && h[i] == ',') { ++i; continue; }
    expect('}');
    return out;
  }
}

/// A safetensors file open for reading: its header parsed (tensors and
/// metadata), its data read by byte ranges. Every error names `who` and the path.
class st_reader {
 public:
  st_reader(const std::string& path, const char* who) : path_(path), who_(who), f_(std::fopen(path.c_str(), "rb"), &close_file) {
    if (!f_) throw std::runtime_error(who_ + ": '" + path + "' cannot be opened: " + detail::system_reason(errno));
    unsigned char lb[8];
    std::error_code ec;
    size_ = static_cast<std::int64_t>(std::filesystem::file_size(path, ec));
    if (ec || std::fread(lb, 1, 8, f_.get()) != 8) throw std::runtime_error(who_ + ": '" + path + "' is too short for a safetensors file");
    std::uint64_t len = 0;
    for (int b = 0; b < 8; ++b) len |= static_cast<std::uint64_t>(lb[b]) << (8 * b);
    if (len > static_cast<std::uint64_t>(size_ - 8) || len > (100u << 20))
      throw std::runtime_error(who_ + ": '" + path + "': a header of " + std::to_string(len) + " bytes in a file of " +
                               std::to_string(size_) + ": not a safetensors file, or truncated");
    std::string h(len, '\0');
    if (std::fread(h.data(), 1, len, f_.get()) != len) throw std::runtime_error(who_ + ": '" + path + "' ends in its header");
    entries_ = parse_st_header(h, path, &meta_, who);
    data0_ = 8 + static_cast<std::int64_t>(len);
  }
  st_reader(const st_reader&) = delete;
  st_reader& operator=(const st_reader&) = delete;

  const std::map<std::string, st_entry>& entries() const noexcept { return entries_; }
  const std::map<std::string, std::string>& metadata() const noexcept { return meta_; }
  const std::string& path() const noexcept { return path_; }
  /// The entry of tensor `name`, checked to lie inside the file; throws naming it where absent.
  const st_entry& entry(const std::string& name) const {
    const auto it = entries_.find(name);
    if (it == entries_.end()) throw std::runtime_error(who_ + ": '" + path_ + "': tensor " + name + " is missing");
    const auto& e = it->second;
    if (e.offsets.size() != 2 || e.offsets[1] < e.offsets[0] || data0_ + e.offsets[1] > size_)
      throw std::runtime_error(who_ + ": '" + path_ + "': tensor " + name + " lies past the end of the file (truncated)");
    return e;
  }
  /// `bytes` bytes from byte `at` of tensor `name`'s data.
  void read(const std::string& name, std::int64_t at, void* dst, std::size_t bytes) const {
    const auto& e = entry(name);
    if (::fseeko(f_.get(), static_cast<off_t>(data0_ + e.offsets[0] + at), SEEK_SET) != 0 || std::fread(dst, 1, bytes, f_.get()) != bytes)
      throw std::runtime_error(who_ + ": '" + path_ + "': cannot read tensor " + name);
  }
  /// Tensor `name` as floats: F32 as it is, BF16 and F16 widened. Other dtypes are refused naming it.
  std::vector<float> floats(const std::string& name) const {
    const auto& e = entry(name);
    const std::int64_t bytes = e.offsets[1] - e.offsets[0];
    const int w = e.dtype == "F32" ? 4 : (e.dtype == "BF16" || e.dtype == "F16") ? 2 : 0;
    if (w == 0) throw std::runtime_error(who_ + ": '" + path_ + "': tensor " + name + " is " + e.dtype + "; whale reads F32, BF16 and F16");
    std::vector<float> out(static_cast<std::size_t>(bytes / w));
    if (w == 4) {
      read(name, 0, out.data(), static_cast<std::size_t>(bytes));
      return out;
    }
    std::vector<std::uint16_t> half(out.size());
    read(name, 0, half.data(), static_cast<std::size_t>(bytes));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = e.dtype == "BF16" ? kernels::from_bf16_bits(half[i]) : from_f16_bits(half[i]);
    return out;
  }
  /// Integer tensor `name` (I64 or I32), e.g. token ids.
  std::vector<std::int64_t> integers(const std::string& name) const {
    const auto& e = entry(name);
    const std::int64_t bytes = e.offsets[1] - e.offsets[0];
    std::vector<std::int64_t> out;
    if (e.dtype == "I64") {
      out.resize(static_cast<std::size_t>(bytes / 8));
      read(name, 0, out.data(), static_cast<std::size_t>(bytes));
    } else if (e.dtype == "I32") {
      std::vector<std::int32_t> v(static_cast<std::size_t>(bytes / 4));
      read(name, 0, v.data(), static_cast<std::size_t>(bytes));
      out.assign(v.begin(), v.end());
    } else {
      throw std::runtime_error(who_ + ": '" + path_ + "': tensor " + name + " is " + e.dtype + ", not an integer tensor");
    }
    return out;
  }
  static int close_file(std::FILE* f) { return std::fclose(f); }
  static float from_f16_bits(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16, ex = (h >> 10) & 0x1f, man = h & 0x3ffu;
    float f;
    if (ex == 0) {  // zero or subnormal: man * 2^-24
      f = static_cast<float>(man) * 5.9604644775390625e-8f;
      if (sign) f = -f;
      return f;
    }
    const std::uint32_t u = ex == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((ex + 112) << 23) | (man << 13);
    std::memcpy(&f, &u, 4);
    return f;
  }

 private:
  std::string path_, who_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f_;  // closed on every way out, the constructor's throws included
  std::int64_t size_ = 0, data0_ = 0;
  std::map<std::string, st_entry> entries_;
  std::map<std::string, std::string> meta_;
};

}  // namespace whale::ckpt

// One consolidated file of the unsplit parameters, in the safetensors layout
// (an 8-byte little-endian header length, a JSON header, then raw
// little-endian data), that a few lines of Python read:
//   export_safetensors(path, net, step)   collective; rank 0 writes, atomically
//   import_safetensors(path, net)         collective; each rank reads its slices
// Tensor k of the model (its k-th layer with parameters, flat order) is named
// "<k, 3 digits>.<layer>" (e.g. "002.linear<32, 64>"), dtype F32, shape [n]:
// the layer's parameters in its own flat order (docs/training.md lists them).
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/train/checkpoint.hpp"

namespace whale {

namespace ckpt {

/// The tensor name of unit k.
inline std::string tensor_name(std::size_t k, const std::string& layer) {
  std::string n = std::to_string(k);
  if (n.size() < 3) n.insert(0, 3 - n.size(), '0');
  return n + "." + layer;
}
inline std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}

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

/// Runs f(dst, L) with L = net's layout and dst where this rank's resident
/// parameters can be written from the host: net's own, or on a device a host
/// copy that is copied up after f.
template <class Net, class F> void write_resident_params(Net& net, F&& f) {
  const auto L = layout_for(net);
  const auto be = backend_of(net);
  mirror m;
  if (!be.on_cpu()) {
    m.device = net.params().data();
    be.host_readable(cview<float>(net.params()), m.host);
  }
  f(be.on_cpu() ? net.params().data() : m.host.data(), L);
  if (!be.on_cpu()) {
    be.copy(m.device, m.host.data(), m.host.size() * sizeof(float));
    be.synchronize();
  }
}

}  // namespace ckpt

/// Write the whole unsplit model to `path` as one safetensors file
/// (collective: a plan gathers its parameters; rank 0 writes, atomically).
template <Checkpointable Net> void export_safetensors(const std::string& path, Net& net, std::int64_t step = 0) {
  using M = typename Net::model_type;
  std::string err = net.rank() == 0 ? detail::output_path_problem(path) : std::string();
  if (!err.empty()) err = "whale::export_safetensors: '" + path + "': " + err;
  ckpt::agree(net, err);
  tensor<float> full;
  if constexpr (requires { net.full_params(); }) full = net.full_params();
  if (net.rank() == 0) err = ckpt::catching([&] {
    std::vector<float> host;  // a network on a device: its parameters copied to the host
    // (a plan's gathered parameters; else the network's own: a default tensor has no storage, though numel() is 1)
    const float* p = full.data() ? full.data() : ckpt::backend_of(net).host_readable(cview<float>(net.params()), host).data();
    const auto units = ckpt::units_of<M>();
    std::ostringstream hs;  // (a stream, not operator+: GCC 12's -Wrestrict false positive)
    hs << "{\"__metadata__\":{\"format\":\"whale\",\"model\":" << ckpt::json_string(layer_name<M>()) << ",\"step\":\"" << step << "\"}";
    for (std::size_t k = 0; k < units.size(); ++k)
      hs << "," << ckpt::json_string(ckpt::tensor_name(k, units[k].name)) << ":{\"dtype\":\"F32\",\"shape\":[" << units[k].count
         << "],\"data_offsets\":[" << 4 * units[k].offset << "," << 4 * (units[k].offset + units[k].count) << "]}";
    hs << "}";
    std::string h = hs.str();
    h.append((8 - h.size() % 8) % 8, ' ');
    const index_t n = describe<M>().full_params;
    std::string bytes(8 + h.size() + static_cast<std::size_t>(n) * 4, '\0');
    const std::uint64_t len = h.size();
    for (int b = 0; b < 8; ++b) bytes[static_cast<std::size_t>(b)] = static_cast<char>((len >> (8 * b)) & 0xff);
    std::memcpy(bytes.data() + 8, h.data(), h.size());
    std::memcpy(bytes.data() + 8 + h.size(), p, static_cast<std::size_t>(n) * 4);
    detail::write_file_atomically(path, bytes, "whale::export_safetensors");
  });
  ckpt::agree(net, err);
}

/// Set `net`'s parameters from a safetensors file of the unsplit model
/// (export_safetensors' layout); every rank reads only its slices. The
/// optimizer state is not touched. Collective; throws on every rank naming the tensor.
template <Checkpointable Net> void import_safetensors(const std::string& path, Net& net) {
  using M = typename Net::model_type;
  const std::string err = ckpt::catching([&] {
    const ckpt::st_reader r(path, "whale::import_safetensors");
    const auto& entries = r.entries();
    const auto units = ckpt::units_of<M>();
    std::vector<std::string> names(units.size());
    for (std::size_t k = 0; k < units.size(); ++k) {
      const auto name = ckpt::tensor_name(k, units[k].name);
      const auto it = entries.find(name);
      auto where = "whale::import_safetensors: '" + path + "': tensor " + name;
      if (it == entries.end()) throw std::runtime_error(where + " is missing (another model?)");
      const auto& e = r.entry(name);
      std::int64_t elems = 1;
      for (auto d : e.shape) elems *= d;
      if (e.dtype != "F32") throw std::runtime_error(where + " is " + e.dtype + "; whale reads F32");
      if (elems != units[k].count || e.offsets[1] - e.offsets[0] != 4 * elems)
        throw std::runtime_error(where + " holds " + std::to_string(elems) + " elements; this model's has " + std::to_string(units[k].count));
      names[k] = name;
    }
    ckpt::write_resident_params(net, [&](float* dst, const ckpt::layout& L) {
      for (const auto& p : ckpt::clip(L.all, L.resident_first, L.resident_end)) {
        std::size_t k = 0;
        while (k + 1 < units.size() && units[k + 1].offset <= p.full) ++k;
        r.read(names[k], 4 * (p.full - units[k].offset), dst + (p.local - L.resident_first), static_cast<std::size_t>(p.count) * 4);
      }
    });
  });
  ckpt::agree(net, err);
}

}  // namespace whale

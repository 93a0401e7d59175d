// One consolidated file of the unsplit parameters, in the safetensors layout
// (an 8-byte little-endian header length, a JSON header, then raw
// little-endian data), that a few lines of Python read:
//   export_safetensors(path, net, step)   collective; rank 0 writes, atomically
//   import_safetensors(path, net)         collective; each rank reads its slices
// Tensor k of the model (its k-th layer with parameters, flat order) is named
// "<k, 3 digits>.<layer>" (e.g. "002.linear<32, 64>"), dtype F32, shape [n]:
// the layer's parameters in its own flat order (docs/training.md lists them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

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

/// The tensors of a safetensors header (its "__metadata__" is skipped). Throws naming the problem.
inline std::map<std::string, st_entry> parse_st_header(const std::string& h, const std::string& path) {
  std::size_t i = 0;
  auto bad = [&](const std::string& why) -> void {
    throw std::runtime_error("whale::import_safetensors: '" + path + "': the header is not valid (" + why + " at byte " + std::to_string(i) + ")");
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
        else if (key == "__metadata__") str();
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
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("whale::import_safetensors: '" + path + "' cannot be opened: " + detail::system_reason(errno));
    struct closer { std::FILE* f; ~closer() { std::fclose(f); } } c{f};
    unsigned char lb[8];
    std::error_code ec;
    const auto size = static_cast<std::int64_t>(std::filesystem::file_size(path, ec));
    if (ec || std::fread(lb, 1, 8, f) != 8) throw std::runtime_error("whale::import_safetensors: '" + path + "' is too short for a safetensors file");
    std::uint64_t len = 0;
    for (int b = 0; b < 8; ++b) len |= static_cast<std::uint64_t>(lb[b]) << (8 * b);
    if (len > static_cast<std::uint64_t>(size - 8) || len > (100u << 20))
      throw std::runtime_error("whale::import_safetensors: '" + path + "': a header of " + std::to_string(len) + " bytes in a file of " +
                               std::to_string(size) + ": not a safetensors file, or truncated");
    std::string h(len, '\0');
    if (std::fread(h.data(), 1, len, f) != len) throw std::runtime_error("whale::import_safetensors: '" + path + "' ends in its header");
    const auto entries = ckpt::parse_st_header(h, path);
    const auto units = ckpt::units_of<M>();
    const std::int64_t data0 = 8 + static_cast<std::int64_t>(len);
    std::vector<std::int64_t> at(units.size());
    for (std::size_t k = 0; k < units.size(); ++k) {
      const auto name = ckpt::tensor_name(k, units[k].name);
      const auto it = entries.find(name);
      auto where = "whale::import_safetensors: '" + path + "': tensor " + name;
      if (it == entries.end()) throw std::runtime_error(where + " is missing (another model?)");
      const auto& e = it->second;
      std::int64_t elems = 1;
      for (auto d : e.shape) elems *= d;
      if (e.dtype != "F32") throw std::runtime_error(where + " is " + e.dtype + "; whale reads F32");
      if (elems != units[k].count || e.offsets.size() != 2 || e.offsets[1] - e.offsets[0] != 4 * elems)
        throw std::runtime_error(where + " holds " + std::to_string(elems) + " elements; this model's has " + std::to_string(units[k].count));
      if (data0 + e.offsets[1] > size) throw std::runtime_error(where + " lies past the end of the file (truncated)");
      at[k] = data0 + e.offsets[0];
    }
    const auto L = ckpt::layout_for(net);
    const auto be = ckpt::backend_of(net);
    ckpt::mirror m;  // a network on a device: read into a host copy, copied up at the end
    if (!be.on_cpu()) {
      m.device = net.params().data();
      be.host_readable(cview<float>(net.params()), m.host);
    }
    float* dst = be.on_cpu() ? net.params().data() : m.host.data();
    for (const auto& p : ckpt::clip(L.all, L.resident_first, L.resident_end)) {
      std::size_t k = 0;
      while (k + 1 < units.size() && units[k + 1].offset <= p.full) ++k;
      if (std::fseek(f, static_cast<long>(at[k] + 4 * (p.full - units[k].offset)), SEEK_SET) != 0 ||
          std::fread(dst + (p.local - L.resident_first), 4, static_cast<std::size_t>(p.count), f) != static_cast<std::size_t>(p.count))
        throw std::runtime_error("whale::import_safetensors: '" + path + "': cannot read tensor " + ckpt::tensor_name(k, units[k].name));
    }
    if (!be.on_cpu()) {
      be.copy(m.device, m.host.data(), m.host.size() * sizeof(float));
      be.synchronize();
    }
  });
  ckpt::agree(net, err);
}

}  // namespace whale

// One consolidated file of the unsplit parameters, in the safetensors layout
// (an 8-byte little-endian header length, a JSON header, then raw
// little-endian data), that a few lines of Python read:
//   export_safetensors(path, net, step)   collective; rank 0 writes, atomically
//   import_safetensors(path, net)         collective; each rank reads its slices
// Tensor t of unit k (the model's k-th layer with parameters, flat order) is
// named "<k, 3 digits>.<layer>.<t>" (e.g. "002.linear<32, 64>.weight"), dtype
// F32, with the shape its layer states (param_tensor::shape: the bytes as
// stored, row-major, e.g. [64, 32] for that weight); the data is the flat
// parameters in order (docs/checkpoints.md lists every layer's tensors). The
// import also reads the files of earlier versions: one flat tensor a layer
// ("002.linear<32, 64>", shape [n]).
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

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/train/checkpoint.hpp"
#include "whale/train/safetensors_reader.hpp"

namespace whale {

namespace ckpt {

/// The name of unit k, the prefix of its tensors' names (and, in files of
/// earlier versions, the name of its one flat tensor).
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

/// One tensor of a safetensors file and where the unsplit flat parameters
/// hold it: `count` floats from `offset`, in the row-major order of `shape`.
struct tensor_map {
  std::string name;
  std::vector<std::int64_t> shape;
  index_t offset = 0, count = 0;
  /// (Hugging Face files) The file holds the transpose of whale's matrix:
  /// shape [in, out] of an (out, in) weight (GPT-2's Conv1D, y = x W + b).
  bool transposed = false;
  /// (Hugging Face files) A copy of another tensor of the file, `name` (a
  /// tied head: the token table): read from it, not written again.
  bool tied = false;
};

/// A shape as the messages write it: "[64, 32]".
inline std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string o = "[";
  for (std::size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

/// The tensors of unit k, layer `u` (with parameters) from flat index `at`,
/// in its flat order: tensor t named "<k, 3 digits>.<layer>.<t's name>", with
/// the shape the layer states. Throws naming the layer where its
/// param_tensors() are missing, state no shape, or do not cover its parameters.
inline std::vector<tensor_map> unit_tensors(const unit_desc& u, std::size_t k, index_t at, const char* who) {
  const auto layer = "layer " + std::to_string(k) + " ('" + u.unsplit + "')";
  if (!u.tensors)
    throw std::invalid_argument(std::string(who) + ": " + layer + " has " + std::to_string(u.full_params) +
                                " parameters but lists no param_tensors(); give it one, each tensor with its shape "
                                "(param_tensor::shape)");
  std::vector<tensor_map> out;
  index_t o = at;
  for (const auto& t : u.tensors()) {
    const auto where = std::string(who) + ": tensor '" + t.name + "' of " + layer;
    if (t.shape.rank() == 0)
      throw std::invalid_argument(where + " states no shape; give its param_tensor the shape it is stored in, "
                                  "row-major (e.g. {Out, In} for a linear's weight)");
    std::vector<std::int64_t> shape;
    for (int i = 0; i < t.shape.rank(); ++i) shape.push_back(t.shape[i]);
    if (t.shape.numel() != t.count)
      throw std::invalid_argument(where + " has shape " + shape_str(shape) + " of " + std::to_string(t.shape.numel()) +
                                  " elements, but a count of " + std::to_string(t.count));
    out.push_back({tensor_name(k, u.unsplit) + "." + t.name, std::move(shape), o, t.count});
    o += t.count;
  }
  if (o - at != u.full_params)
    throw std::invalid_argument(std::string(who) + ": the param_tensors() of " + layer + " cover " + std::to_string(o - at) +
                                " of its " + std::to_string(u.full_params) + " parameters");
  return out;
}

/// The tensors of whale's own file for model `d`, in flat order: every
/// unit's (unit_tensors), unit k being its k-th layer with parameters.
inline std::vector<tensor_map> file_tensors(const model_desc& d, const char* who) {
  std::vector<tensor_map> out;
  index_t at = 0;
  std::size_t k = 0;
  for (const auto& u : d.units) {
    if (u.full_params == 0) continue;
    for (auto& t : unit_tensors(u, k++, at, who)) out.push_back(std::move(t));
    at += u.full_params;
  }
  return out;
}

/// The tensors of a file of an earlier version for model `d`: one flat tensor
/// a unit, named "<k, 3 digits>.<layer>", shape [n].
inline std::vector<tensor_map> flat_file_tensors(const model_desc& d) {
  std::vector<tensor_map> out;
  const auto units = units_of(d);
  for (std::size_t k = 0; k < units.size(); ++k)
    out.push_back({tensor_name(k, units[k].name), {units[k].count}, units[k].offset, units[k].count});
  return out;
}

/// Checks that file `r` holds exactly the tensors `maps`: each by its name,
/// with its shape, F32, of its size, and no other. Throws naming the first
/// tensor that differs (and, for a shape, both shapes).
inline void check_file_tensors(const st_reader& r, const std::vector<tensor_map>& maps, const char* who) {
  std::set<std::string> known;
  for (const auto& m : maps) {
    known.insert(m.name);
    const auto where = std::string(who) + ": '" + r.path() + "': tensor " + m.name;
    if (!r.entries().count(m.name)) {
      // the file's first tensor of the same unit, if any, says what it holds there
      const auto unit = m.name.substr(0, m.name.find('.') + 1);
      for (const auto& [name, e] : r.entries())
        if (name.compare(0, unit.size(), unit) == 0)
          throw std::runtime_error(where + " is missing (another model? the file has " + name + ")");
      throw std::runtime_error(where + " is missing (another model?)");
    }
    const auto& e = r.entry(m.name);
    if (e.shape != m.shape)
      throw std::runtime_error(where + " has shape " + shape_str(e.shape) + "; this model's is " + shape_str(m.shape));
    if (e.dtype != "F32") throw std::runtime_error(where + " is " + e.dtype + "; whale reads F32");
    if (e.offsets[1] - e.offsets[0] != 4 * static_cast<std::int64_t>(m.count))
      throw std::runtime_error(where + " holds " + std::to_string(e.offsets[1] - e.offsets[0]) + " bytes for " +
                               std::to_string(m.count) + " elements of F32");
  }
  for (const auto& [name, e] : r.entries())
    if (!known.count(name))
      throw std::runtime_error(std::string(who) + ": '" + r.path() + "': tensor " + name + " is not part of this model (another model?)");
}

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

/// Write the whole unsplit model to `path` as one safetensors file, a
/// tensor for each parameter tensor of each layer, with its shape
/// (collective: a plan gathers its parameters; rank 0 writes, atomically).
/// Throws on every rank, before anything is gathered, naming a layer with
/// parameters that states no shapes for them (param_tensor::shape).
template <Checkpointable Net> void export_safetensors(const std::string& path, Net& net, std::int64_t step = 0) {
  using M = typename Net::model_type;
  constexpr const char* who = "whale::export_safetensors";
  std::vector<ckpt::tensor_map> maps;
  std::string err = ckpt::catching([&] { maps = ckpt::file_tensors(describe<M>(), who); });
  if (err.empty() && net.rank() == 0)
    if (const auto why = detail::output_path_problem(path); !why.empty()) err = std::string(who) + ": '" + path + "': " + why;
  ckpt::agree(net, err);
  tensor<float> full;
  if constexpr (requires { net.full_params(); }) full = net.full_params();
  if (net.rank() == 0) err = ckpt::catching([&] {
    std::vector<float> host;  // a network on a device: its parameters copied to the host
    // (a plan's gathered parameters; else the network's own: a default tensor has no storage, though numel() is 1)
    const float* p = full.data() ? full.data() : ckpt::backend_of(net).host_readable(cview<float>(net.params()), host).data();
    std::ostringstream hs;  // (a stream, not operator+: GCC 12's -Wrestrict false positive)
    hs << "{\"__metadata__\":{\"format\":\"whale\",\"model\":" << ckpt::json_string(layer_name<M>()) << ",\"step\":\"" << step << "\"}";
    for (const auto& m : maps) {  // in flat order: the data is the flat parameters as they are
      hs << "," << ckpt::json_string(m.name) << ":{\"dtype\":\"F32\",\"shape\":[";
      for (std::size_t i = 0; i < m.shape.size(); ++i) hs << (i ? "," : "") << m.shape[i];
      hs << "],\"data_offsets\":[" << 4 * m.offset << "," << 4 * (m.offset + m.count) << "]}";
    }
    hs << "}";
    std::string h = hs.str();
    h.append((8 - h.size() % 8) % 8, ' ');
    const index_t n = describe<M>().full_params;
    std::string bytes(8 + h.size() + static_cast<std::size_t>(n) * 4, '\0');
    const std::uint64_t len = h.size();
    for (int b = 0; b < 8; ++b) bytes[static_cast<std::size_t>(b)] = static_cast<char>((len >> (8 * b)) & 0xff);
    std::memcpy(bytes.data() + 8, h.data(), h.size());
    std::memcpy(bytes.data() + 8 + h.size(), p, static_cast<std::size_t>(n) * 4);
    detail::write_file_atomically(path, bytes, who);
  });
  ckpt::agree(net, err);
}

/// Set `net`'s parameters from a safetensors file of the unsplit model
/// (export_safetensors' tensors, or an earlier version's one flat tensor a
/// layer); every rank reads only its slices, wherever the file places each
/// tensor. A file whose tensor names, shapes or dtypes differ from the
/// model's is refused, naming the tensor (and both shapes). The optimizer
/// state is not touched. Collective; throws on every rank.
template <Checkpointable Net> void import_safetensors(const std::string& path, Net& net) {
  using M = typename Net::model_type;
  constexpr const char* who = "whale::import_safetensors";
  const std::string err = ckpt::catching([&] {
    const ckpt::st_reader r(path, who);
    const auto d = describe<M>();
    auto maps = ckpt::flat_file_tensors(d);
    // a file of an earlier version holds unit 0's flat tensor; any other is read by its shaped tensors
    if (maps.empty() || !r.entries().count(maps[0].name)) maps = ckpt::file_tensors(d, who);
    ckpt::check_file_tensors(r, maps, who);
    ckpt::write_resident_params(net, [&](float* dst, const ckpt::layout& L) {
      for (const auto& p : ckpt::clip(L.all, L.resident_first, L.resident_end)) {
        // the tensors overlapping [p.full, p.full + p.count), from the last one that starts at or before p.full
        auto it = std::upper_bound(maps.begin(), maps.end(), p.full,
                                   [](index_t v, const ckpt::tensor_map& m) { return v < m.offset; });
        for (auto t = it == maps.begin() ? it : std::prev(it); t != maps.end() && t->offset < p.full + p.count; ++t) {
          const index_t lo = std::max(p.full, t->offset), hi = std::min(p.full + p.count, t->offset + t->count);
          if (lo < hi)
            r.read(t->name, 4 * (lo - t->offset), dst + (p.local - L.resident_first) + (lo - p.full),
                   static_cast<std::size_t>(hi - lo) * 4);
        }
      }
    });
  });
  ckpt::agree(net, err);
}

}  // namespace whale

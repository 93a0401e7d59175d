// Weights in and out in Hugging Face's names and layouts, for the models
// whale builds from transformers' architectures (models::gpt2, models::llama):
//   import_hf_safetensors(path, net)   collective; each rank reads the tensors of the layers it holds
//   export_hf_safetensors(path, net)   collective; rank 0 writes, atomically
// The tensors are found from the model's layers in flat order, whatever plan
// holds them (replicate, split, pipeline, shard); a layer sequence that is
// not a known architecture is refused naming the first layer that does not fit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/train/hf_names.hpp"
#include "whale/train/safetensors.hpp"
#include "whale/train/trainer_options.hpp"

namespace whale {

namespace hf {

/// Tensor `m`'s values from the file (row-major in the file's shape) in
/// whale's order: a transposed one turned back into (out, in).
inline std::vector<float> whale_order(const tensor_map& m, std::vector<float> v) {
  if (!m.transposed) return v;
  const auto in = static_cast<std::size_t>(m.shape.at(0)), out = static_cast<std::size_t>(m.shape.at(1));
  std::vector<float> t(v.size());
  for (std::size_t i = 0; i < in; ++i)
    for (std::size_t o = 0; o < out; ++o) t[o * in + i] = v[i * out + o];
  return t;
}
/// Whale's values of tensor `m` (`p`: its first) in the file's order.
inline std::vector<float> file_order(const tensor_map& m, const float* p) {
  std::vector<float> v(p, p + m.count);
  if (!m.transposed) return v;
  const auto in = static_cast<std::size_t>(m.shape.at(0)), out = static_cast<std::size_t>(m.shape.at(1));
  for (std::size_t i = 0; i < in; ++i)
    for (std::size_t o = 0; o < out; ++o) v[i * out + o] = p[o * in + i];
  return v;
}

/// A Hugging Face checkpoint to read: one safetensors file, or the shards an
/// index names (model.safetensors.index.json: {"weight_map": {tensor: file}}),
/// as one set of tensors. `path`: a .safetensors file, an index .json, or a
/// folder holding model.safetensors or model.safetensors.index.json.
class checkpoint {
 public:
  checkpoint(const std::string& path, const char* who) : path_(path), who_(who) {
    namespace fs = std::filesystem;
    std::string file = path;
    if (fs::is_directory(path)) {
      if (fs::exists(fs::path(path) / "model.safetensors")) file = (fs::path(path) / "model.safetensors").string();
      else if (fs::exists(fs::path(path) / "model.safetensors.index.json")) file = (fs::path(path) / "model.safetensors.index.json").string();
      else throw std::runtime_error(who_ + ": '" + path + "' is a folder without model.safetensors or model.safetensors.index.json");
    }
    if (file.size() >= 5 && file.compare(file.size() - 5, 5, ".json") == 0) {
      const auto map = weight_map(file);
      std::map<std::string, std::size_t> opened;
      for (const auto& [tensor, shard] : map) {
        if (shard.find('/') != std::string::npos || shard == "..")
          throw std::runtime_error(who_ + ": '" + file + "': shard '" + shard + "' is not a file name beside the index");
        auto [it, fresh] = opened.try_emplace(shard, files_.size());
        if (fresh) files_.push_back(std::make_unique<ckpt::st_reader>((fs::path(file).parent_path() / shard).string(), who));
        const auto& r = *files_[it->second];
        if (!r.entries().count(tensor))
          throw std::runtime_error(who_ + ": '" + r.path() + "': tensor " + tensor + ", which the index '" + file +
                                   "' places in this shard, is missing");
        where_[tensor] = it->second;
        entries_[tensor] = r.entries().at(tensor);
      }
    } else {
      files_.push_back(std::make_unique<ckpt::st_reader>(file, who));
      for (const auto& [tensor, e] : files_[0]->entries()) where_[tensor] = 0, entries_[tensor] = e;
    }
  }
  const std::map<std::string, ckpt::st_entry>& entries() const noexcept { return entries_; }
  const std::string& path() const noexcept { return path_; }
  const ckpt::st_entry& entry(const std::string& name) const { return reader(name).entry(name); }
  std::vector<float> floats(const std::string& name) const { return reader(name).floats(name); }
  std::size_t files() const noexcept { return files_.size(); }

 private:
  const ckpt::st_reader& reader(const std::string& name) const {
    const auto it = where_.find(name);
    if (it == where_.end()) throw std::runtime_error(who_ + ": '" + path_ + "': tensor " + name + " is missing");
    return *files_[it->second];
  }
  /// The "weight_map" object of an index file: tensor name -> shard file name.
  std::map<std::string, std::string> weight_map(const std::string& file) const {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::runtime_error(who_ + ": '" + file + "' cannot be opened: " + detail::system_reason(errno));
    const std::string t((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto bad = [&](const std::string& why) -> void {
      throw std::runtime_error(who_ + ": '" + file + "': not a safetensors index (" + why + ")");
    };
    std::size_t i = t.find("\"weight_map\"");
    if (i == std::string::npos) bad("no \"weight_map\"");
    i = t.find('{', i);
    if (i == std::string::npos) bad("\"weight_map\" is not an object");
    ++i;
    auto ws = [&] { while (i < t.size() && std::isspace(static_cast<unsigned char>(t[i]))) ++i; };
    auto str = [&] {
      ws();
      if (i >= t.size() || t[i] != '"') bad("expected a string at byte " + std::to_string(i));
      std::string v;
      for (++i; i < t.size() && t[i] != '"'; ++i) {
        if (t[i] == '\\' && i + 1 < t.size()) ++i;
        v += t[i];
      }
      if (i >= t.size()) bad("an unterminated string");
      ++i;
      return v;
    };
    std::map<std::string, std::string> m;
    ws();
    if (i < t.size() && t[i] == '}') bad("an empty weight_map");
    for (;;) {
      auto k = str();
      ws();
      if (i >= t.size() || t[i] != ':') bad("expected ':' at byte " + std::to_string(i));
      ++i;
      m[k] = str();
      ws();
      if (i < t.size() && t[i] == ',') { ++i; continue; }
      if (i < t.size() && t[i] == '}') break;
      bad("expected ',' or '}' at byte " + std::to_string(i));
    }
    return m;
  }
  std::string path_, who_;
  std::vector<std::unique_ptr<ckpt::st_reader>> files_;
  std::map<std::string, std::size_t> where_;
  std::map<std::string, ckpt::st_entry> entries_;
};

/// Whether a tensor of a Hugging Face file is one whale does not need
/// (buffers older transformers saved: rotary inverse frequencies).
inline bool ignorable(const std::string& name) {
  // and GPT-2's causal-mask buffers, and a tied head saved beside its table
  return name.ends_with("rotary_emb.inv_freq") || name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") ||
         name == "lm_head.weight";
}
/// The hub's original GPT-2 files name the tensors without "transformer.":
/// the names of `maps` as file `r` has them.
template <class Reader> void match_prefix(const Reader& r, std::vector<tensor_map>& maps) {
  if (maps.empty() || !maps.front().name.starts_with("transformer.") || r.entries().count(maps.front().name)) return;
  if (!r.entries().count(maps.front().name.substr(12))) return;
  for (auto& m : maps) m.name = m.name.substr(12);
}

/// Checks that file `r` holds every tensor of `maps` (named `prefix` + name),
/// with its shape, as F32, BF16 or F16, and nothing else unless `extra_ok`.
template <class Reader>
void check_file(const Reader& r, const std::vector<tensor_map>& maps, const std::string& prefix,
                       const char* who, bool extra_ok = false) {
  for (const auto& m : maps) {
    const auto name = prefix + m.name;
    const auto where = std::string(who) + ": '" + r.path() + "': tensor " + name;
    const auto it = r.entries().find(name);
    if (it == r.entries().end() && m.name == "lm_head.weight" && r.entries().count(prefix + "model.embed_tokens.weight"))
      throw std::runtime_error(where + " is missing: the checkpoint ties its LM head to the token table "
                               "(tie_word_embeddings), which whale's llama does not support yet");
    if (it == r.entries().end()) throw std::runtime_error(where + " is missing (another architecture or size?)");
    const auto& e = r.entry(name);
    if (e.shape != m.shape)
      throw std::runtime_error(where + " has shape " + ckpt::shape_str(e.shape) + "; this model's is " + ckpt::shape_str(m.shape));
    const int w = e.dtype == "F32" ? 4 : (e.dtype == "BF16" || e.dtype == "F16") ? 2 : 0;
    if (w == 0) throw std::runtime_error(where + " is " + e.dtype + "; whale reads F32, BF16 and F16");
    if (e.offsets[1] - e.offsets[0] != static_cast<std::int64_t>(w) * m.count)
      throw std::runtime_error(where + " holds " + std::to_string(e.offsets[1] - e.offsets[0]) + " bytes for " +
                               std::to_string(m.count) + " elements of " + e.dtype);
  }
  if (extra_ok) return;
  for (const auto& [name, e] : r.entries()) {
    if (ignorable(name)) continue;
    const bool known = std::any_of(maps.begin(), maps.end(), [&](const tensor_map& m) { return prefix + m.name == name; });
    if (!known)
      throw std::runtime_error(std::string(who) + ": '" + r.path() + "': tensor " + name +
                               " is not part of this model (another architecture or size?)");
  }
}

/// The unsplit flat vector (`n` floats) of file `r`'s tensors `prefix` + name
/// (a checkpoint's weights, or a reference file's "grad." gradients).
template <class Reader>
std::vector<float> read_flat(const Reader& r, const std::vector<tensor_map>& maps, index_t n,
                                    const std::string& prefix = "") {
  std::vector<float> flat(static_cast<std::size_t>(n), 0.f);
  for (const auto& m : maps) {
    const auto v = whale_order(m, r.floats(prefix + m.name));
    std::copy(v.begin(), v.end(), flat.begin() + m.offset);
  }
  return flat;
}

}  // namespace hf

/// Set `net`'s parameters from a Hugging Face checkpoint, as transformers'
/// save_pretrained(..., safe_serialization=True) writes it: `path` is
/// model.safetensors, a folder holding it, or a sharded checkpoint
/// (model.safetensors.index.json or its folder); F32, BF16 or F16. Every tensor's name, shape and dtype
/// are checked, and a tensor the model does not have is refused, each with a
/// message naming it. Each rank reads the tensors of the layers it holds.
/// The optimizer state is not touched. Collective; throws on every rank.
template <Checkpointable Net> void import_hf_safetensors(const std::string& path, Net& net) {
  using M = typename Net::model_type;
  constexpr const char* who = "whale::import_hf_safetensors";
  const std::string err = ckpt::catching([&] {
    const hf::checkpoint r(path, who);
    auto maps = hf::tensors_for(describe<M>(), who);
    hf::match_prefix(r, maps);
    hf::check_file(r, maps, "", who);
    for (const auto& m : maps)  // a tied head: a saved lm_head.weight must be the table it is tied to
      if (m.tied && r.entries().count("lm_head.weight") && r.floats("lm_head.weight") != r.floats(m.name))
        throw std::runtime_error(std::string(who) + ": '" + r.path() + "': tensor lm_head.weight differs from " + m.name +
                                 ": the checkpoint's LM head is not tied to its token table (tie_word_embeddings false), "
                                 "but this model's head is (tied_head)");
    std::map<std::size_t, std::vector<float>> loaded;  // tensor index -> its values (read once, converted)
    ckpt::write_resident_params(net, [&](float* dst, const ckpt::layout& L) {
      for (const auto& p : ckpt::clip(L.all, L.resident_first, L.resident_end)) {
        // a tensor that ends before this piece is done (the pieces go up the flat order): free it
        for (auto it = loaded.begin(); it != loaded.end();)
          it = maps[it->first].offset + maps[it->first].count <= p.full ? loaded.erase(it) : std::next(it);
        // the tensors overlapping [p.full, p.full + p.count)
        auto it = std::upper_bound(maps.begin(), maps.end(), p.full,
                                   [](index_t v, const hf::tensor_map& m) { return v < m.offset; });
        for (auto t = static_cast<std::size_t>(it - maps.begin()) - 1; t < maps.size() && maps[t].offset < p.full + p.count; ++t) {
          const auto& m = maps[t];
          auto& v = loaded[t];
          if (v.empty()) v = hf::whale_order(m, r.floats(m.name));
          const index_t lo = std::max(p.full, m.offset), hi = std::min(p.full + p.count, m.offset + m.count);
          std::memcpy(dst + (p.local - L.resident_first) + (lo - p.full), v.data() + (lo - m.offset),
                      static_cast<std::size_t>(hi - lo) * sizeof(float));
        }
      }
    });
  });
  ckpt::agree(net, err);
}

/// Write `net`'s unsplit parameters to `path` in Hugging Face's names and
/// shapes, with the metadata {"format": "pt"} that transformers' loader
/// expects: with the model's config.json beside it, from_pretrained loads the
/// folder. `dtype`: precision::fp32 writes F32 (exact); precision::bf16 writes
/// BF16, each value rounded to the nearest (half the size, as checkpoints are
/// published). Collective (a plan gathers its parameters); rank 0 writes, atomically.
template <Checkpointable Net> void export_hf_safetensors(const std::string& path, Net& net, precision dtype = precision::fp32) {
  using M = typename Net::model_type;
  constexpr const char* who = "whale::export_hf_safetensors";
  std::string err = net.rank() == 0 ? detail::output_path_problem(path) : std::string();
  if (err.empty()) err = ckpt::catching([&] { (void)hf::tensors_for(describe<M>(), who); });
  else err = std::string(who) + ": '" + path + "': " + err;
  ckpt::agree(net, err);
  tensor<float> full;
  if constexpr (requires { net.full_params(); }) full = net.full_params();
  if (net.rank() == 0) err = ckpt::catching([&] {
    std::vector<float> host;
    const float* p = full.data() ? full.data() : ckpt::backend_of(net).host_readable(cview<float>(net.params()), host).data();
    const auto maps = hf::tensors_for(describe<M>(), who);
    const bool half = dtype == precision::bf16;
    const std::int64_t w = half ? 2 : 4;
    std::ostringstream hs;
    hs << "{\"__metadata__\":{\"format\":\"pt\"}";
    std::int64_t at = 0;
    for (const auto& m : maps) {
      if (m.tied) continue;  // a tied head: its table is written once
      hs << "," << ckpt::json_string(m.name) << ":{\"dtype\":\"" << (half ? "BF16" : "F32") << "\",\"shape\":[";
      for (std::size_t i = 0; i < m.shape.size(); ++i) hs << (i ? "," : "") << m.shape[i];
      hs << "],\"data_offsets\":[" << at << "," << at + w * m.count << "]}";
      at += w * m.count;
    }
    hs << "}";
    std::string h = hs.str();
    h.append((8 - h.size() % 8) % 8, ' ');
    std::string bytes(8 + h.size() + static_cast<std::size_t>(at), '\0');
    const std::uint64_t len = h.size();
    for (int b = 0; b < 8; ++b) bytes[static_cast<std::size_t>(b)] = static_cast<char>((len >> (8 * b)) & 0xff);
    std::memcpy(bytes.data() + 8, h.data(), h.size());
    std::size_t o = 8 + h.size();
    for (const auto& m : maps) {
      if (m.tied) continue;
      const auto v = hf::file_order(m, p + m.offset);
      if (half) {
        for (index_t i = 0; i < m.count; ++i) {
          const std::uint16_t b = kernels::bf16_bits(v[static_cast<std::size_t>(i)]);
          std::memcpy(bytes.data() + o + static_cast<std::size_t>(i) * 2, &b, 2);
        }
      } else {
        std::memcpy(bytes.data() + o, v.data(), static_cast<std::size_t>(m.count) * 4);
      }
      o += static_cast<std::size_t>(m.count * w);
    }
    detail::write_file_atomically(path, bytes, who);
  });
  ckpt::agree(net, err);
}

}  // namespace whale

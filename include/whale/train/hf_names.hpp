// Where each tensor of a Hugging Face checkpoint lives in whale's flat
// parameters: the models' layers are walked in flat order (GPT-2's and
// Llama's layer sequences) and each parameter is given its transformers name,
// shape and layout; a layer sequence that is not a known architecture is
// refused naming the first layer that does not fit. Part of
// train/hf_safetensors.hpp.
#pragma once

#include <cctype>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/train/safetensors.hpp"

namespace whale::hf {

/// One tensor of a Hugging Face checkpoint and where whale's unsplit flat
/// parameters hold it: `count` floats from `offset`, in the same row-major
/// order as the file's `shape`.
using tensor_map = ckpt::tensor_map;

/// The kind of a layer's name ("rms_norm<64>" -> "rms_norm") and its leading
/// integer template arguments ("rotary_attention<64, 4, 2>" -> {64, 4, 2}).
inline std::string kind_of(const std::string& layer) { return layer.substr(0, layer.find('<')); }
inline std::vector<std::int64_t> args_of(const std::string& layer) {
  std::vector<std::int64_t> v;
  std::size_t i = layer.find('<');
  while (i != std::string::npos && i + 1 < layer.size()) {
    ++i;
    while (i < layer.size() && layer[i] == ' ') ++i;
    std::size_t j = i;
    while (j < layer.size() && layer[j] >= '0' && layer[j] <= '9') ++j;
    if (j == i || j - i > 18) break;
    v.push_back(std::stoll(layer.substr(i, j - i)));
    i = layer.find(',', j);
  }
  return v;
}

/// A model's layers with parameters in flat order (units[k], layers[k]), as
/// the Hugging Face maps walk them: each one's tensors (ckpt::unit_tensors)
/// under transformers' names, into `out`. `arch` names the architecture in refusals.
struct layer_walk {
  layer_walk(const model_desc& d, const char* who_, const char* arch_) : units(ckpt::units_of(d)), who(who_), arch(arch_) {
    for (const auto& u : d.units)
      if (u.full_params > 0) layers.push_back(&u);
  }
  std::vector<ckpt::unit_rec> units;
  std::vector<const unit_desc*> layers;
  std::vector<tensor_map> out;
  std::size_t k = 0;
  const char* who;
  const char* arch;

  [[noreturn]] void refuse(const std::string& want) const {
    const std::string seen = k < units.size() ? "'" + units[k].name + "'" : "the end of the model";
    throw std::invalid_argument(std::string(who) + ": this model is not one whose Hugging Face names whale knows (" + arch +
                                "): at layer " + std::to_string(k) + " it has " + seen + " where " + want + " would be");
  }
  bool is(const char* kind) const { return k < units.size() && kind_of(units[k].name) == kind; }
  /// Layer k's tensors, in its flat order, as `prefix` + `names`; `transposed`:
  /// its matrices stored [in, out] (GPT-2's Conv1D).
  void add(const std::vector<std::string>& names, const std::string& prefix = "", bool transposed = false) {
    if (k >= units.size()) refuse("a layer with " + std::to_string(names.size()) + " tensors");
    auto mine = ckpt::unit_tensors(*layers[k], k, units[k].offset, who);
    if (mine.size() != names.size())
      throw std::invalid_argument(std::string(who) + ": layer " + std::to_string(k) + " ('" + units[k].name + "') has " +
                                  std::to_string(mine.size()) + " parameter tensors; Hugging Face's has " + std::to_string(names.size()));
    for (std::size_t t = 0; t < names.size(); ++t) {
      tensor_map m{prefix + names[t], std::move(mine[t].shape), mine[t].offset, mine[t].count};
      if (transposed && m.shape.size() == 2) std::swap(m.shape[0], m.shape[1]), m.transposed = true;
      out.push_back(std::move(m));
    }
  }
};

/// GPT2LMHeadModel's tensors (save_pretrained's names, "transformer." first)
/// for model `d`: embedding, position_embedding, per block layer_norm,
/// causal_self_attention, layer_norm, linear<D, F>, linear<F, D>; then
/// layer_norm and tied_head. The Conv1D weights are stored [in, out], the
/// transpose of the (out, in) the layers state; the tied head reads the token table.
inline std::vector<tensor_map> gpt2_tensors(const model_desc& d, const char* who) {
  layer_walk w(d, who, "GPT-2");
  auto& k = w.k;
  const auto& units = w.units;
  auto refuse = [&](const std::string& want) { w.refuse(want); };
  auto is = [&](const char* kind) { return w.is(kind); };
  // layer k's tensors under transformers' `names` ("transformer." added); `conv1d`: its weights transposed
  auto add = [&](const std::vector<std::string>& names, bool conv1d = false) {
    w.add(names, "transformer.", conv1d);
    ++k;
  };
  auto layer_norm = [&](const std::string& name, std::int64_t D) {
    if (!is("layer_norm") || args_of(units[k].name).at(0) != D) refuse("layer_norm<" + std::to_string(D) + "> (" + name + ")");
    add({name + ".weight", name + ".bias"});
  };
  const auto emb = args_of(units[k].name);
  const std::int64_t V = emb.at(0), D = emb.at(1);
  add({"wte.weight"});
  if (const auto pos = args_of(units[k].name); pos.size() < 2 || pos[1] != D) refuse("position_embedding<T, " + std::to_string(D) + ">");
  add({"wpe.weight"});
  for (int layer = 0; is("layer_norm") && k + 1 < units.size() && kind_of(units[k + 1].name) == "causal_self_attention"; ++layer) {
    const std::string p = "h." + std::to_string(layer) + ".";
    layer_norm(p + "ln_1", D);
    if (args_of(units[k].name).at(0) != D) refuse("causal_self_attention<" + std::to_string(D) + ", ...>");
    add({p + "attn.c_attn.weight", p + "attn.c_attn.bias", p + "attn.c_proj.weight", p + "attn.c_proj.bias"}, true);
    layer_norm(p + "ln_2", D);
    const auto fc = is("linear") ? args_of(units[k].name) : std::vector<std::int64_t>{};
    if (fc.size() < 2 || fc[0] != D || units[k].name.find("no_bias") != std::string::npos)
      refuse("the MLP's linear<" + std::to_string(D) + ", F>");
    const std::int64_t F = fc[1];
    add({p + "mlp.c_fc.weight", p + "mlp.c_fc.bias"}, true);
    const auto proj = is("linear") ? args_of(units[k].name) : std::vector<std::int64_t>{};
    if (proj.size() < 2 || proj[0] != F || proj[1] != D || units[k].name.find("no_bias") != std::string::npos)
      refuse("the MLP's linear<" + std::to_string(F) + ", " + std::to_string(D) + ">");
    add({p + "mlp.c_proj.weight", p + "mlp.c_proj.bias"}, true);
  }
  layer_norm("ln_f", D);
  if (!is("tied_head")) refuse("the LM head tied to the token table, tied_head<" + std::to_string(V) + ", " + std::to_string(D) + ">");
  if (const auto h = args_of(units[k].name); h.size() < 2 || h[0] != V || h[1] != D)
    refuse("tied_head<" + std::to_string(V) + ", " + std::to_string(D) + ">");
  add({"wte.weight"});
  w.out.back().tied = true;
  if (k != units.size()) refuse("nothing more");
  return w.out;
}

/// Hugging Face's tensors for model `d`'s parameter units (its unsplit
/// layers with parameters, in flat order): each layer's own tensors, with
/// the shapes it states (ckpt::unit_tensors), under transformers' names.
/// Known: GPT-2 (an embedding then a position_embedding: gpt2_tensors) and
/// Llama (LlamaForCausalLM: embedding, then per layer rms_norm,
/// rotary_attention, rms_norm, swiglu_mlp; then rms_norm and a linear head
/// without bias).
inline std::vector<tensor_map> tensors_for(const model_desc& d, const char* who) {
  layer_walk w(d, who, "Llama");
  auto& k = w.k;
  const auto& units = w.units;
  auto refuse = [&](const std::string& want) { w.refuse(want); };
  auto is = [&](const char* kind) { return w.is(kind); };
  auto add = [&](const std::vector<std::string>& names) { w.add(names); };  // layer k's tensors under Hugging Face's `names`
  if (!is("embedding")) refuse("a token embedding");
  if (units.size() > 1 && kind_of(units[1].name) == "position_embedding") return gpt2_tensors(d, who);
  const auto emb = args_of(units[k].name);
  const std::int64_t V = emb.at(0), D = emb.at(1);
  add({"model.embed_tokens.weight"});
  ++k;
  for (int layer = 0; is("rms_norm") && k + 1 < units.size() && kind_of(units[k + 1].name) == "rotary_attention"; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    add({p + "input_layernorm.weight"});
    ++k;
    if (const auto a = args_of(units[k].name); a.size() < 3 || a[0] != D) refuse("rotary_attention<" + std::to_string(D) + ", ...>");
    add({p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight"});
    ++k;
    if (!is("rms_norm")) refuse("the post-attention rms_norm");
    add({p + "post_attention_layernorm.weight"});
    ++k;
    if (!is("swiglu_mlp")) refuse("a swiglu_mlp");
    add({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"});
    ++k;
  }
  if (!is("rms_norm")) refuse("the final rms_norm");
  add({"model.norm.weight"});
  ++k;
  if (!is("linear") || units[k].name.find("no_bias") == std::string::npos) refuse("the LM head, a linear without bias");
  if (const auto h = args_of(units[k].name); h.size() < 2 || h[0] != D || h[1] != V)
    refuse("the LM head linear<" + std::to_string(D) + ", " + std::to_string(V) + ", no_bias> (width to vocabulary)");
  add({"lm_head.weight"});
  ++k;
  if (k != units.size()) refuse("nothing more");
  return w.out;
}

}  // namespace whale::hf

// The work of save_checkpoint and load_checkpoint for any network
// (train/checkpoint.hpp): every rank's shard written and the metadata by rank
// 0, the step directory renamed into place once complete, older ones removed;
// a checkpoint of any plan read back into this one. Compiled once in
// whale::core under the compiled core (detail/compiled.hpp); inline, as the
// rest of the library, without it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/train/checkpoint.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/train/checkpoint_impl.hpp holds the compiled core's definitions: include whale/train/checkpoint.hpp, not this file"
#endif

namespace whale::ckpt {

WHALE_CORE_INLINE std::string save(const std::string& dir, target& t, std::int64_t step, int keep_last) {
  namespace fs = std::filesystem;
  static constexpr const char* who = "whale::save_checkpoint";
  std::string err;
  const std::string name = step_name(step), final_dir = dir + "/" + name;
  std::string part = final_dir + ".partial-" + job_token();  // this job's own: never another job's folder
  if (t.rank == 0) err = catching([&] {
    if (dir.empty()) throw std::invalid_argument("whale::save_checkpoint: the checkpoint directory is empty");
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw std::runtime_error("whale::save_checkpoint: cannot create '" + dir + "': " + ec.message());
    hold_folder(dir, who);
    fs::remove_all(part, ec);  // this job's own leftover of the same step
    if (!fs::create_directory(part, ec)) throw std::runtime_error("whale::save_checkpoint: cannot create '" + part + "': " + ec.message());
    save_point("partial folder made");
  });
  agree(t.comm, err);
  share(t.comm, part);
  const auto& names = t.expected.vectors;
  file_rec mine;
  err = catching([&] {
    std::vector<vec_src> vecs{{t.params, t.L.resident_first}};
    for (std::size_t k = 1; k < names.size(); ++k) vecs.push_back({k - 1 < t.state.size() ? t.state[k - 1] : nullptr, t.L.state_first});
    if (t.state.size() + 1 != names.size() && !t.L.mine.empty())
      throw std::logic_error("whale::save_checkpoint: the optimizer state has " + std::to_string(t.state.size()) + " vectors, expected " +
                             std::to_string(names.size() - 1));
    mine = write_shard(part + "/" + rank_file(t.rank), t.L.mine, vecs);
    save_point("shard written");
  });
  agree(t.comm, err);
  std::vector<std::int64_t> recs(static_cast<std::size_t>(2 * t.world), 0);
  recs[static_cast<std::size_t>(2 * t.rank)] = static_cast<std::int64_t>(mine.bytes);
  recs[static_cast<std::size_t>(2 * t.rank + 1)] = static_cast<std::int64_t>(mine.checksum);
  if (t.comm) all_reduce(*t.comm, view<std::int64_t>(recs.data(), {2 * t.world}));
  if (t.rank == 0) err = catching([&] {
    meta m = t.expected;
    m.step = step;
    m.optimizer_steps = *t.optimizer_steps;
    for (int r = 0; r < t.world; ++r)
      m.files.push_back({rank_file(r), static_cast<std::uint64_t>(recs[static_cast<std::size_t>(2 * r)]),
                         static_cast<std::uint64_t>(recs[static_cast<std::size_t>(2 * r + 1)])});
    detail::write_file_atomically(part + "/meta.txt", m.text(), who);  // last: a folder with meta.txt is complete
    save_point("metadata written");
    publish(dir, part, final_dir, who);
    set_latest(dir, name, who);
    if (keep_last > 0) {  // the oldest other steps, never the one just written (which may be older than some)
      std::vector<std::string> steps;
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(dir)) {
        const auto n = e.path().filename().string();
        if (is_step_name(n) && n != name) steps.push_back(n);
      }
      std::sort(steps.begin(), steps.end());
      for (std::size_t i = 0; i + static_cast<std::size_t>(keep_last) < steps.size() + 1; ++i) {
        fs::remove_all(dir + "/" + steps[i], ec);
        save_point("older step removed");
      }
    }
  });
  agree(t.comm, err);
  return final_dir;
}


WHALE_CORE_INLINE checkpoint_info load(const std::string& path, target& t) {
  namespace fs = std::filesystem;
  checkpoint_info info;
  meta m;
  std::string err = catching([&] {
    std::vector<std::string> left;
    if (fs::exists(fs::path(path) / "meta.txt")) info.dir = path;
    else if (fs::is_directory(path)) info.dir = latest(path), left = leftovers(path);
    if (info.dir.empty() && !left.empty())
      throw std::runtime_error("whale::load_checkpoint: '" + path + "' holds no complete checkpoint in place, but " + leftover_note(left));
    if (info.dir.empty())
      throw std::runtime_error("whale::load_checkpoint: '" + path + "' is neither a checkpoint step directory (with meta.txt) nor a "
                               "directory holding one (step-<N>/meta.txt)");
    m = parse_meta(info.dir + "/meta.txt");
    if (const auto base = fs::path(info.dir).filename().string(); is_step_name(base) && base != step_name(m.step))
      throw std::runtime_error("whale::load_checkpoint: '" + info.dir + "/meta.txt' says step " + std::to_string(m.step) +
                               ", its folder's name another: the folder was renamed or its metadata damaged");
    info.note = leftover_note(left);
    if (!is_step_name(fs::path(info.dir).filename().string()))
      info.note = "the step 'latest' names is missing (a re-save was interrupted); loaded '" + info.dir + "' instead; " + info.note;
    // the same model: the same unsplit tensors in the same order (any plan of it)
    const auto& e = t.expected;
    const auto where = "whale::load_checkpoint: '" + info.dir + "' ";
    const std::string other = where + "holds another model (saved from " + m.plan + "; this is " + e.model + "): ";
    if (m.params != e.params || m.units.size() != e.units.size())
      throw std::runtime_error(other + std::to_string(m.params) + " parameters in " + std::to_string(m.units.size()) + " tensors there, " +
                               std::to_string(e.params) + " in " + std::to_string(e.units.size()) + " here");
    for (std::size_t k = 0; k < e.units.size(); ++k)
      if (m.units[k].name != e.units[k].name || m.units[k].count != e.units[k].count || m.units[k].offset != e.units[k].offset)
        throw std::runtime_error(other + "tensor " + std::to_string(k) + " is " + m.units[k].name + " (" + std::to_string(m.units[k].count) +
                                 " parameters) there, " + e.units[k].name + " (" + std::to_string(e.units[k].count) + ") here");
    if (m.optimizer != e.optimizer || m.vectors != e.vectors)
      throw std::runtime_error(where + "holds the state of optimizer " + m.optimizer + " (" + std::to_string(m.vectors.size() - 1) +
                               " vectors); this run uses " + e.optimizer + " (" + std::to_string(e.vectors.size() - 1) + ")");
    // what this rank needs: its resident parameters, and the state of its range
    auto needs_of = [](const std::vector<piece>& ps) {
      std::vector<need> n;
      for (const auto& p : ps) n.push_back({p.full, p.local, p.count});
      std::sort(n.begin(), n.end(), [](const need& a, const need& b) { return a.full < b.full; });
      return n;
    };
    const auto pn = needs_of(clip(t.L.all, t.L.resident_first, t.L.resident_end));
    const auto sn = needs_of(clip(t.L.all, t.L.state_first, t.L.state_end));
    std::vector<vec_dst> dst{{t.params, t.L.resident_first, &pn}};
    for (float* s : t.state) dst.push_back({s, t.L.state_first, &sn});
    read_shards(info.dir, m, dst);
    for (std::size_t v = 0; v < dst.size(); ++v) {
      const auto& ns = *dst[v].needs;
      for (std::size_t i = 0; i < ns.size(); ++i)
        if (dst[v].got[i] != ns[i].count) {
          std::string unit = "?";
          for (const auto& u : e.units)
            if (ns[i].full >= u.offset && ns[i].full < u.offset + u.count) unit = u.name;
          throw std::runtime_error(where + "lacks " + m.vectors[v] + " values of " + unit + " (unsplit parameters [" + std::to_string(ns[i].full) +
                                   ", " + std::to_string(ns[i].full + ns[i].count) + ")): a shard file is missing from its metadata");
        }
    }
  });
  agree(t.comm, err);
  t.upload();
  *t.optimizer_steps = m.optimizer_steps;
  info.step = m.step;
  info.plan = m.plan;
  info.mesh = m.mesh;
  info.ranks = m.ranks;
  return info;
}


}  // namespace whale::ckpt

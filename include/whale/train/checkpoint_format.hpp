// The model-independent half of checkpoints (train/checkpoint.hpp): the files,
// their checksums, the metadata text, and reading a rank's slices out of any
// set of shard files. Nothing here knows a plan; the caller says which
// unsplit-parameter ranges this rank writes and which it needs.
//
// A checkpoint of step S is the directory <dir>/step-<S, 8 digits>/ with
//   meta.txt          the model, its units (global sizes), the plan, the mesh,
//                     the step, the optimizer, and one line per shard file:
//                     its size, checksum and slices of the unsplit parameters
//   rank-<r>.bin      one rank's slices: "WHALECK1", u64 slices, u64 vectors,
//                     u64 floats per vector, slices × (u64 first, u64 count),
//                     then vectors × floats little-endian f32 (parameters, then
//                     each optimizer vector), slice after slice.
// It is written under <dir>/step-<S>.partial-<job>/ and put in place when
// complete (train/checkpoint_dir.hpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "whale/detail/io.hpp"
#include "whale/detail/parse.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale::ckpt {

static_assert(std::endian::native == std::endian::little, "whale checkpoints are little-endian files written from memory");

inline constexpr char magic[8] = {'W', 'H', 'A', 'L', 'E', 'C', 'K', '1'};
/// The metadata's format: 2 ends meta.txt with a checksum of every line before
/// it; version 1 (no checksum) is still read.
inline constexpr int format_version = 2;

/// A run of this rank's flat parameter buffer and where it lies in the unsplit model.
struct piece {
  index_t full = 0, local = 0, count = 0;
};

/// 64-bit checksum of a byte stream, fed in any chunks (FNV-1a over 8-byte words, then a final mix).
class hasher {
 public:
  void add(const void* p, std::size_t n) {
    auto* b = static_cast<const unsigned char*>(p);
    if (fill_ > 0) {
      const std::size_t take = std::min<std::size_t>(8 - fill_, n);
      std::memcpy(tail_ + fill_, b, take);
      fill_ += take, b += take, n -= take;
      if (fill_ < 8) return;
      word(tail_), fill_ = 0;
    }
    for (; n >= 8; n -= 8, b += 8) word(b);
    std::memcpy(tail_, b, n);
    fill_ = n;
  }
  std::uint64_t value() const {
    std::uint64_t h = h_ ^ (bytes_ + fill_);
    for (std::size_t i = 0; i < fill_; ++i) h = (h ^ tail_[i]) * 0x100000001b3ULL;
    h ^= h >> 33, h *= 0xff51afd7ed558ccdULL, h ^= h >> 33;
    return h;
  }

 private:
  void word(const unsigned char* b) {
    std::uint64_t w;
    std::memcpy(&w, b, 8);
    h_ = (h_ ^ w) * 0x100000001b3ULL;
    h_ ^= h_ >> 29;
    bytes_ += 8;
  }
  std::uint64_t h_ = 0xcbf29ce484222325ULL, bytes_ = 0;
  unsigned char tail_[8]{};
  std::size_t fill_ = 0;
};

inline std::string hex64(std::uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}
inline std::string step_name(std::int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08lld", static_cast<long long>(step));
  return b;
}
/// Whether a directory name is a step's, as step_name writes it ("step-" and 8 digits).
inline bool is_step_name(const std::string& n) {
  return n.size() == 13 && n.rfind("step-", 0) == 0 && n.find_first_not_of("0123456789", 5) == std::string::npos;
}
inline std::string rank_file(int r) {
  char b[32];
  std::snprintf(b, sizeof b, "rank-%05d.bin", r);
  return b;
}

/// One unit of the unsplit model as the metadata records it.
struct unit_rec {
  index_t offset = 0, count = 0;
  std::string name;
};
/// One shard file as the metadata records it.
struct file_rec {
  std::string name;
  std::uint64_t bytes = 0, checksum = 0;
};
/// meta.txt, parsed.
struct meta {
  std::string model, plan, mesh, optimizer;
  int ranks = 1;
  std::int64_t step = 0, optimizer_steps = 0;
  index_t params = 0;
  std::vector<std::string> vectors;  ///< "param", then the optimizer's vectors
  std::vector<unit_rec> units;
  std::vector<file_rec> files;

  std::string text() const {
    std::ostringstream o;
    o << "whale-checkpoint " << format_version << "\nmodel " << model << "\nplan " << plan << "\nmesh " << mesh
      << "\nranks " << ranks << "\nstep " << step << "\nparams " << params << "\noptimizer " << optimizer_steps << " "
      << optimizer << "\nvectors";
    for (const auto& v : vectors) o << " " << v;
    o << "\n";
    for (const auto& u : units) o << "unit " << u.offset << " " << u.count << " " << u.name << "\n";
    for (const auto& f : files) o << "file " << f.bytes << " " << hex64(f.checksum) << " " << f.name << "\n";
    std::string body = o.str();
    return body + "checksum " + hex64(checksum_of(body)) + "\n";
  }
  /// The checksum meta.txt's last line records: of every byte before that line.
  static std::uint64_t checksum_of(std::string_view body) {
    hasher h;
    h.add(body.data(), body.size());
    return h.value();
  }
};

/// meta.txt at `path`, parsed and checked: its checksum (version 2), every
/// entry, and that it names one file per rank. Throws naming the file and line.
inline meta parse_meta(const std::string& path) {
  std::string text;
  {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("the checkpoint's metadata '" + path + "' cannot be read: " + detail::system_reason(errno));
    std::ostringstream all;
    all << f.rdbuf();
    text = all.str();
  }
  if (text.rfind("whale-checkpoint 2\n", 0) == 0) {  // version 2: the last line is the checksum of the rest
    const auto last = text.rfind("checksum ", text.size() >= 2 ? text.size() - 2 : 0);
    const bool at_line = last != std::string::npos && last > 0 && text[last - 1] == '\n' && text.back() == '\n';
    if (!at_line)
      throw std::runtime_error("the checkpoint's metadata '" + path + "' has no checksum line at its end: it was cut short or edited; "
                               "nothing was loaded");
    const std::string recorded = text.substr(last + 9, text.size() - last - 10);
    const std::string actual = hex64(meta::checksum_of(std::string_view(text).substr(0, last)));
    if (recorded != actual)
      throw std::runtime_error("the checkpoint's metadata '" + path + "' fails its checksum (" + actual + ", its last line says " +
                               recorded + "): it was edited or damaged; nothing was loaded");
    text.resize(last);
  }
  std::istringstream in(text);
  meta m;
  std::string line;
  int n = 0;
  auto bad = [&](const std::string& why) {
    throw std::runtime_error("the checkpoint's metadata '" + path + "', line " + std::to_string(n) + ": " + why);
  };
  auto num = [&](const std::string& s, const char* what) -> std::int64_t {
    std::int64_t v = 0;
    std::size_t used = 0;
    try {
      v = std::stoll(s, &used);
    } catch (...) {
      used = 0;
    }
    if (used != s.size() || s.empty() || v < 0) bad(std::string("expected a count for ") + what + ", got '" + s + "'");
    return v;
  };
  bool header = false;
  while (std::getline(in, line)) {
    ++n;
    const auto sp = line.find(' ');
    const std::string key = line.substr(0, sp), rest = sp == std::string::npos ? "" : line.substr(sp + 1);
    std::istringstream r(rest);
    std::string a, b;
    if (n == 1) {
      if (key != "whale-checkpoint") bad("not a whale checkpoint (the first line is not 'whale-checkpoint 1')");
      if (rest != "1" && rest != std::to_string(format_version))
        bad("format version " + rest + ", this build reads versions 1 and " + std::to_string(format_version));
      header = true;
    } else if (key == "model") m.model = rest;
    else if (key == "plan") m.plan = rest;
    else if (key == "mesh") m.mesh = rest;
    else if (key == "ranks") m.ranks = static_cast<int>(num(rest, "ranks"));
    else if (key == "step") m.step = num(rest, "step");
    else if (key == "params") m.params = num(rest, "params");
    else if (key == "optimizer") {
      r >> a;
      m.optimizer_steps = num(a, "the optimizer's steps");
      std::getline(r >> std::ws, m.optimizer);
    } else if (key == "vectors") {
      while (r >> a) m.vectors.push_back(a);
    } else if (key == "unit") {
      r >> a >> b;
      unit_rec u{num(a, "a unit's offset"), num(b, "a unit's size"), {}};
      std::getline(r >> std::ws, u.name);
      m.units.push_back(u);
    } else if (key == "file") {
      r >> a >> b;
      file_rec f{{}, static_cast<std::uint64_t>(num(a, "a file's size")), 0};
      if (b.size() != 16 || b.find_first_not_of("0123456789abcdef") != std::string::npos) bad("a checksum of 16 hex digits, got '" + b + "'");
      f.checksum = std::stoull(b, nullptr, 16);
      std::getline(r >> std::ws, f.name);
      if (f.name.empty() || f.name.find('/') != std::string::npos) bad("a file name without '/', got '" + f.name + "'");
      m.files.push_back(f);
    } else if (!line.empty()) bad("unknown entry '" + key + "'");
  }
  if (!header) throw std::runtime_error("the checkpoint's metadata '" + path + "' is empty");
  if (m.files.empty() || m.vectors.empty() || m.units.empty()) bad("incomplete (no files, vectors or units): the save did not finish");
  if (m.files.size() != static_cast<std::size_t>(m.ranks))
    throw std::runtime_error("the checkpoint's metadata '" + path + "' names " + std::to_string(m.files.size()) + " shard files for " +
                             std::to_string(m.ranks) + " ranks: it is damaged");
  return m;
}

/// Write one rank's shard: `pieces` of `vecs` (parameters first), each vector
/// addressed by a piece's `local` index relative to that vector's own base.
/// Returns the file's size and checksum. Throws naming the file.
struct vec_src {
  const float* base;   ///< element `local - first` of the piece
  index_t first;       ///< the local index of base[0]
};
inline file_rec write_shard(const std::string& path, const std::vector<piece>& pieces, const std::vector<vec_src>& vecs) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot create the checkpoint file '" + path + "': " + detail::system_reason(errno));
  hasher h;
  std::uint64_t bytes = 0;
  bool ok = true;
  auto put = [&](const void* p, std::size_t n) {
    if (!ok || n == 0) return;
    h.add(p, n);
    bytes += n;
    ok = std::fwrite(p, 1, n, f) == n;
  };
  index_t floats = 0;
  for (const auto& p : pieces) floats += p.count;
  const std::uint64_t hdr[3] = {pieces.size(), vecs.size(), static_cast<std::uint64_t>(floats)};
  put(magic, 8);
  put(hdr, sizeof hdr);
  for (const auto& p : pieces) {
    const std::uint64_t r[2] = {static_cast<std::uint64_t>(p.full), static_cast<std::uint64_t>(p.count)};
    put(r, sizeof r);
  }
  for (const auto& v : vecs)
    for (const auto& p : pieces) put(v.base + (p.local - v.first), static_cast<std::size_t>(p.count) * sizeof(float));
  const int err = errno;
  if (!ok || std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) {
    std::fclose(f);
    throw std::runtime_error("cannot write the checkpoint file '" + path + "': " + detail::system_reason(ok ? errno : err));
  }
  if (std::fclose(f) != 0) throw std::runtime_error("cannot write the checkpoint file '" + path + "': " + detail::system_reason(errno));
  return {path.substr(path.find_last_of('/') + 1), bytes, h.value()};
}

/// What a rank needs: `count` floats of unsplit parameters from `full`, into
/// each vector's destination at `local` (relative to the destination's `first`).
struct need {
  index_t full = 0, local = 0, count = 0;
};
struct vec_dst {
  float* base;
  index_t first;
  const std::vector<need>* needs;  ///< sorted by full, not overlapping
  std::vector<index_t> got = {};   ///< floats found for each need
};

/// Read every file of `m` in `dir` that holds something the destinations need,
/// verifying each file's size and checksum (a file is read whole when any of it is needed).
inline void read_shards(const std::string& dir, const meta& m, std::vector<vec_dst>& dst) {
  std::vector<float> buf;
  for (auto& d : dst) d.got.assign(d.needs->size(), 0);
  for (const auto& fr : m.files) {
    const std::string path = dir + "/" + fr.name;
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("the checkpoint file '" + path + "' cannot be opened: " + detail::system_reason(errno));
    struct closer { std::FILE* f; ~closer() { std::fclose(f); } } c{f};
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec || size != fr.bytes)
      throw std::runtime_error("the checkpoint file '" + path + "' has " + (ec ? "an unknown size" : std::to_string(size) + " bytes") +
                               ", the metadata says " + std::to_string(fr.bytes) + " (truncated or replaced)");
    hasher h;
    auto get = [&](void* p, std::size_t n) {
      if (std::fread(p, 1, n, f) != n) throw std::runtime_error("the checkpoint file '" + path + "' cannot be read: it ends early");
      h.add(p, n);
    };
    char mg[8];
    std::uint64_t hdr[3];
    get(mg, 8);
    get(hdr, sizeof hdr);
    if (std::memcmp(mg, magic, 8) != 0) throw std::runtime_error("the checkpoint file '" + path + "' is not a whale shard (bad magic)");
    if (hdr[1] != m.vectors.size())
      throw std::runtime_error("the checkpoint file '" + path + "' holds " + std::to_string(hdr[1]) + " vectors, the metadata names " +
                               std::to_string(m.vectors.size()));
    // what this file gives, staged and copied only once its checksum holds
    struct copy_rec { float* to; std::size_t at, n; vec_dst* d; std::size_t need; };
    std::vector<float> staged;
    std::vector<copy_rec> copies;
    std::vector<std::uint64_t> table(2 * hdr[0]);
    if (hdr[0] > (fr.bytes / 16)) throw std::runtime_error("the checkpoint file '" + path + "' has a corrupt header");
    get(table.data(), table.size() * 8);
    bool wanted = false;  // a file holding nothing this rank needs is not read further
    for (std::size_t k = 0; k < hdr[0] && !wanted; ++k)
      for (std::size_t v = 0; v < std::min<std::size_t>(hdr[1], dst.size()) && !wanted; ++v) {
        const auto& ns = *dst[v].needs;
        const auto first = static_cast<index_t>(table[2 * k]), count = static_cast<index_t>(table[2 * k + 1]);
        auto it = std::lower_bound(ns.begin(), ns.end(), first, [](const need& a, index_t x) { return a.full + a.count <= x; });
        wanted = it != ns.end() && it->full < first + count && count > 0;
      }
    if (!wanted) continue;
    for (std::size_t v = 0; v < hdr[1]; ++v) {
      vec_dst* d = v < dst.size() ? &dst[v] : nullptr;
      for (std::size_t k = 0; k < hdr[0]; ++k) {
        const auto first = static_cast<index_t>(table[2 * k]), count = static_cast<index_t>(table[2 * k + 1]);
        if (first < 0 || count < 0 || first + count > m.params)
          throw std::runtime_error("the checkpoint file '" + path + "' has a slice outside the model's " + std::to_string(m.params) + " parameters");
        buf.resize(static_cast<std::size_t>(count));
        get(buf.data(), static_cast<std::size_t>(count) * sizeof(float));
        if (!d) continue;
        const auto& ns = *d->needs;
        auto it = std::lower_bound(ns.begin(), ns.end(), first, [](const need& a, index_t x) { return a.full + a.count <= x; });
        for (; it != ns.end() && it->full < first + count; ++it) {
          const index_t a = std::max(first, it->full), b = std::min(first + count, it->full + it->count);
          copies.push_back({d->base + (it->local + (a - it->full) - d->first), staged.size(), static_cast<std::size_t>(b - a), d,
                            static_cast<std::size_t>(it - ns.begin())});
          staged.insert(staged.end(), buf.begin() + (a - first), buf.begin() + (b - first));
        }
      }
    }
    if (h.value() != fr.checksum)
      throw std::runtime_error("the checkpoint file '" + path + "' fails its checksum (" + hex64(h.value()) + ", the metadata says " +
                               hex64(fr.checksum) + "): it is corrupt; its values were not used");
    for (const auto& c : copies) {
      std::memcpy(c.to, staged.data() + c.at, c.n * sizeof(float));
      c.d->got[c.need] += static_cast<index_t>(c.n);
    }
  }
}

}  // namespace whale::ckpt

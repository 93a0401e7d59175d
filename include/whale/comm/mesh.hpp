// The device mesh: named axes (data, pipe, model; model innermost so its ranks
// are neighbours), rank <-> coordinates, parsing and validation of a shape
// (mesh_shape, pure), and the per-axis-group communicators of one rank (basic_mesh).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "whale/comm/communicator.hpp"

namespace whale {

/// The mesh axes, outermost first: a rank's number is ((data·P) + pipe)·M + model.
enum class axis : int { data = 0, pipe = 1, model = 2 };
inline constexpr int axis_count = 3;
inline constexpr std::array<axis, axis_count> all_axes{axis::data, axis::pipe, axis::model};
inline const char* to_string(axis a) noexcept {
  constexpr const char* names[] = {"data", "pipe", "model"};
  return names[static_cast<int>(a)];
}

/// A set of axes: `axis::data | axis::model`.
class axes {
 public:
  constexpr axes() = default;
  constexpr axes(axis a) noexcept : bits_(1u << static_cast<int>(a)) {}
  static constexpr axes from_bits(unsigned b) noexcept {
    axes s;
    s.bits_ = b & 7u;
    return s;
  }
  constexpr bool contains(axis a) const noexcept { return bits_ & (1u << static_cast<int>(a)); }
  constexpr unsigned bits() const noexcept { return bits_; }
  constexpr bool empty() const noexcept { return bits_ == 0; }
  friend constexpr axes operator|(axes a, axes b) noexcept { return from_bits(a.bits_ | b.bits_); }
  friend constexpr bool operator==(axes, axes) = default;
  /// "data", "data+model", ...
  std::string name() const {
    std::string s;
    for (axis a : all_axes)
      if (contains(a)) {
        if (!s.empty()) s += '+';
        s += to_string(a);
      }
    return s.empty() ? "none" : s;
  }

 private:
  unsigned bits_ = 0;
};
constexpr axes operator|(axis a, axis b) noexcept { return axes(a) | axes(b); }

/// A mesh that cannot run: bad syntax, or a size that differs from the world's.
struct mesh_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// The shape of a mesh and its rank arithmetic. Pure: no communication.
class mesh_shape {
 public:
  constexpr mesh_shape() = default;
  mesh_shape(int data, int pipe, int model) : n_{data, pipe, model} {
    for (axis a : all_axes)
      if (size(a) < 1)
        throw mesh_error("whale: mesh axis '" + std::string(to_string(a)) + "' has size " +
                         std::to_string(size(a)) + "; every axis needs at least 1 rank");
  }

  /// Parse "data=2,model=2" (axes in any order; missing ones are 1, except
  /// `data`, which is inferred as world / (pipe·model) when omitted; an empty
  /// spec puts every rank on `data`), then validate() against `world` ranks.
  /// `origin` says where the spec came from, for the message ("--mesh", "WHALE_MESH").
  static mesh_shape parse(std::string_view spec, int world, std::string_view origin = "--mesh") {
    std::array<int, axis_count> n{0, 1, 1};
    std::array<bool, axis_count> seen{};
    const std::string where = std::string(origin) + " " + std::string(spec);
    std::size_t at = 0;
    while (at < spec.size()) {
      auto end = spec.find_first_of(", ", at);
      if (end == std::string_view::npos) end = spec.size();
      auto item = spec.substr(at, end - at);
      at = end + 1;
      if (item.empty()) continue;
      auto eq = item.find('=');
      if (eq == std::string_view::npos)
        throw mesh_error("whale: cannot read the mesh '" + where + "': '" + std::string(item) +
                         "' is not axis=size; write e.g. --mesh data=2,model=2");
      auto key = item.substr(0, eq);
      auto val = item.substr(eq + 1);
      int ai = -1;
      for (axis a : all_axes)
        if (key == to_string(a)) ai = static_cast<int>(a);
      if (ai < 0)
        throw mesh_error("whale: cannot read the mesh '" + where + "': unknown axis '" +
                         std::string(key) + "'; the axes are data, pipe and model");
      if (seen[static_cast<std::size_t>(ai)])
        throw mesh_error("whale: cannot read the mesh '" + where + "': axis '" + std::string(key) +
                         "' is given twice");
      int v = 0;
      bool ok = !val.empty() && val.size() < 9;
      for (char ch : val) ok = ok && ch >= '0' && ch <= '9';
      if (ok) for (char ch : val) v = v * 10 + (ch - '0');
      if (!ok || v < 1)
        throw mesh_error("whale: cannot read the mesh '" + where + "': the size of axis '" +
                         std::string(key) + "' must be a positive integer, not '" + std::string(val) + "'");
      n[static_cast<std::size_t>(ai)] = v;
      seen[static_cast<std::size_t>(ai)] = true;
    }
    if (!seen[0]) {
      const int inner = n[1] * n[2];
      if (world % inner != 0)
        throw mesh_error("whale: the mesh '" + where + "' needs a multiple of pipe×model = " +
                         std::to_string(inner) + " ranks, but the job has " + std::to_string(world) +
                         " (mpirun -np " + std::to_string(world) + "); change -np or the mesh");
      n[0] = world / inner;
    }
    mesh_shape m(n[0], n[1], n[2]);
    m.validate(world, where);
    return m;
  }

  /// Throws mesh_error unless the mesh has exactly `world` ranks.
  void validate(int world, std::string_view origin = {}) const {
    if (size() == world) return;
    std::ostringstream os;
    os << "whale: the mesh " << *this;
    if (!origin.empty()) os << " (from " << origin << ")";
    os << " needs " << size() << " ranks, but the job has " << world << " (mpirun -np " << world
       << "); launch with -np " << size() << " or give a mesh whose axis sizes multiply to "
       << world;
    throw mesh_error(os.str());
  }

  int size(axis a) const noexcept { return n_[static_cast<std::size_t>(a)]; }
  int size() const noexcept { return n_[0] * n_[1] * n_[2]; }
  /// Ranks in a group over `s` (the product of those axes' sizes).
  int size(axes s) const noexcept {
    int p = 1;
    for (axis a : all_axes)
      if (s.contains(a)) p *= size(a);
    return p;
  }

  std::array<int, axis_count> coords(int rank) const {
    check(rank);
    return {rank / (n_[1] * n_[2]), (rank / n_[2]) % n_[1], rank % n_[2]};
  }
  int coord(int rank, axis a) const { return coords(rank)[static_cast<std::size_t>(a)]; }
  int rank_of(std::array<int, axis_count> c) const {
    for (axis a : all_axes) {
      auto i = static_cast<std::size_t>(a);
      if (c[i] < 0 || c[i] >= n_[i])
        throw std::out_of_range("whale::mesh_shape::rank_of: coordinate " + std::to_string(c[i]) +
                                " out of axis '" + to_string(a) + "' of size " + std::to_string(n_[i]));
    }
    return (c[0] * n_[1] + c[1]) * n_[2] + c[2];
  }

  /// Which group over `s` holds `rank` (its coordinates on the other axes, flattened).
  int group_of(axes s, int rank) const { return flatten(coords(rank), s, false); }
  /// `rank`'s index inside its group over `s` (its coordinates on `s`, flattened).
  int index_in(axes s, int rank) const { return flatten(coords(rank), s, true); }
  /// The ranks that differ from `rank` only in axes `s`, in group order.
  std::vector<int> group(axes s, int rank) const {
    std::vector<int> g;
    const int color = group_of(s, rank);
    for (int r = 0; r < size(); ++r)
      if (group_of(s, r) == color) g.push_back(r);
    return g;
  }
  /// Every group over `s`, in order of group_of.
  std::vector<std::vector<int>> groups(axes s) const {
    std::vector<std::vector<int>> gs(static_cast<std::size_t>(size() / size(s)));
    for (int r = 0; r < size(); ++r) gs[static_cast<std::size_t>(group_of(s, r))].push_back(r);
    return gs;
  }

  /// "data=2,pipe=1,model=2": what --mesh accepts.
  std::string spec() const {
    return "data=" + std::to_string(n_[0]) + ",pipe=" + std::to_string(n_[1]) + ",model=" +
           std::to_string(n_[2]);
  }
  friend bool operator==(const mesh_shape&, const mesh_shape&) = default;
  /// "data:2 × pipe:1 × model:2"
  friend std::ostream& operator<<(std::ostream& os, const mesh_shape& m) {
    return os << "data:" << m.n_[0] << " × pipe:" << m.n_[1] << " × model:" << m.n_[2];
  }

 private:
  void check(int rank) const {
    if (rank < 0 || rank >= size())
      throw std::out_of_range("whale::mesh_shape: rank " + std::to_string(rank) +
                              " is not in a mesh of " + std::to_string(size()) + " ranks");
  }
  int flatten(std::array<int, axis_count> c, axes s, bool inside) const {
    int v = 0;
    for (axis a : all_axes) {
      if (s.contains(a) != inside) continue;
      auto i = static_cast<std::size_t>(a);
      v = v * n_[i] + c[i];
    }
    return v;
  }
  std::array<int, axis_count> n_{1, 1, 1};
};

/// One rank's view of a mesh: its shape and coordinates, and one communicator
/// per non-empty set of axes (the ranks that differ only in those axes; the set
/// of all three is a copy of the world). Building it is collective over the world.
template <Communicator Comm>
class basic_mesh {
 public:
  basic_mesh(Comm& world, mesh_shape shape) : shape_(shape), rank_(world.rank()) {
    shape_.validate(world.size());
    for (unsigned b = 1; b < 8; ++b) {
      const auto s = axes::from_bits(b);
      comms_[b] = std::make_unique<Comm>(
          world.split(shape_.group_of(s, rank_), shape_.index_in(s, rank_), s.name()));
    }
  }

  const mesh_shape& shape() const noexcept { return shape_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return shape_.size(); }
  int size(axes s) const noexcept { return shape_.size(s); }
  std::array<int, axis_count> coords() const { return shape_.coords(rank_); }
  int coord(axis a) const { return shape_.coord(rank_, a); }
  /// This rank's communicator over axes `s`; its rank is index_in(s, rank()).
  Comm& comm(axes s) const {
    if (s.empty()) throw std::invalid_argument("whale::mesh::comm: name at least one axis");
    return *comms_[s.bits()];
  }
  /// Traffic summed over every axis communicator.
  comm_stats stats() const {
    comm_stats t;
    for (unsigned b = 1; b < 8; ++b) t += comms_[b]->stats();
    return t;
  }

  /// "mesh data:2 × pipe:1 × model:2 (4 ranks)" then the groups of each axis.
  friend std::ostream& operator<<(std::ostream& os, const basic_mesh& m) {
    os << "mesh " << m.shape_ << " (" << m.size() << (m.size() == 1 ? " rank)" : " ranks)");
    for (axis a : all_axes) {
      os << "\n  " << to_string(a) << " groups:";
      for (auto& g : m.shape_.groups(a)) {
        os << " {";
        for (std::size_t i = 0; i < g.size(); ++i) os << (i ? "," : "") << g[i];
        os << '}';
      }
    }
    return os;
  }

 private:
  mesh_shape shape_;
  int rank_ = 0;
  std::array<std::unique_ptr<Comm>, 8> comms_{};
};

}  // namespace whale

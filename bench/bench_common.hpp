// Shared pieces of whale's benchmarks: a flat JSON line writer, peak RSS, and
// the GEMM-alone measurement (the compute limit) at a step's own GEMM shapes.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/tensor/memory.hpp"
#include "whale/tensor/tensor.hpp"

namespace bench {

/// One JSON object on one line, fields in insertion order.
class json_line {
 public:
  json_line& add(const std::string& k, const std::string& v) {
    field(k) << '"' << v << '"';
    return *this;
  }
  json_line& add(const std::string& k, const char* v) { return add(k, std::string(v)); }
  json_line& add(const std::string& k, double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.6g", v);
    field(k) << b;
    return *this;
  }
  json_line& add(const std::string& k, long long v) {
    field(k) << v;
    return *this;
  }
  json_line& add(const std::string& k, int v) { return add(k, static_cast<long long>(v)); }
  json_line& raw(const std::string& k, const std::string& json) {
    field(k) << json;
    return *this;
  }
  std::string str() const { return "{" + s_.str() + "}"; }
  void print() const { std::printf("%s\n", str().c_str()); std::fflush(stdout); }

 private:
  std::ostringstream& field(const std::string& k) {
    if (n_++) s_ << ", ";
    s_ << '"' << k << "\": ";
    return s_;
  }
  std::ostringstream s_;
  int n_ = 0;
};

/// Peak resident set size of this process in MiB.
inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

/// Memory by category, peak MiB, as a JSON object.
inline std::string memory_json(const whale::memory_stats& m) {
  std::string s = "{";
  for (int i = 0; i < whale::mem_kind_count; ++i) {
    char b[96];
    std::snprintf(b, sizeof b, "%s\"%s\": %.2f", i ? ", " : "", whale::to_string(static_cast<whale::mem_kind>(i)),
                  static_cast<double>(m.peak[static_cast<std::size_t>(i)]) / 1048576.0);
    s += b;
  }
  return s + "}";
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

struct gemm_limit {
  double seconds = 0;  ///< time of one step's GEMMs, each shape timed alone
  double flops = 0;    ///< their FLOPs
  double gflops() const { return seconds > 0 ? flops / seconds / 1e9 : 0; }
};

/// Time every distinct GEMM of `calls` alone (median of `reps` after one warm-up
/// run), and add them up with their multiplicities.
inline gemm_limit time_gemms(const std::vector<whale::cpu::gemm_call>& calls, int reps = 3) {
  using key = std::tuple<bool, bool, whale::index_t, whale::index_t, whale::index_t>;
  std::map<key, int> count;
  for (const auto& c : calls) ++count[key{c.ta, c.tb, c.M, c.N, c.K}];
  gemm_limit r;
  whale::tensor<float> a, b, c;
  for (const auto& [k, n] : count) {
    const auto [ta, tb, M, N, K] = k;
    a.resize({M * K});
    b.resize({K * N});
    c.resize({M * N});
    for (auto& x : a) x = 0.5f;
    for (auto& x : b) x = 0.25f;
    auto run = [&] {
      whale::cpu::gemm(ta ? whale::cpu::trans::yes : whale::cpu::trans::no,
                       tb ? whale::cpu::trans::yes : whale::cpu::trans::no, M, N, K, 1.f, a.data(),
                       b.data(), 0.f, c.data());
    };
    run();
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    r.seconds += median(t) * n;
    r.flops += 2.0 * static_cast<double>(M) * N * K * n;
  }
  return r;
}

}  // namespace bench

// Table entries of bench_workloads (bench_workloads.cpp): single, dp, hybrid, hetpipe, auto.
// The plans are compiled in a few translation units so that the benchmark builds in parallel.
#include "single.hpp"
#include "dp.hpp"
#include "hybrid.hpp"
#include "hetero.hpp"
#include "auto.hpp"

namespace bench {
plan_entry entry_single() { return plan<plans::single>(); }
plan_entry entry_dp() { return plan<plans::dp>(); }
plan_entry entry_hybrid() { return plan<plans::hybrid>(); }
plan_entry entry_hetpipe() { return plan<plans::hetpipe>(); }
plan_entry entry_auto() { return plan<plans::auto_choice>(); }
}  // namespace bench

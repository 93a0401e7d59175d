// Table entries of bench_workloads (bench_workloads.cpp): pipeline, 3d.
#include "pipeline.hpp"
#include "threed.hpp"

namespace bench {
plan_entry entry_pipeline() { return plan<plans::pipeline>(); }
plan_entry entry_threed() { return plan<plans::threed>(); }
}  // namespace bench

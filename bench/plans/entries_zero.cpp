// Table entries of bench_workloads (bench_workloads.cpp): zero1, zero2, zero3.
#include "zero.hpp"

namespace bench {
plan_entry entry_zero1() { return plan<plans::zero1>(); }
plan_entry entry_zero2() { return plan<plans::zero2>(); }
plan_entry entry_zero3() { return plan<plans::zero3>(); }
}  // namespace bench

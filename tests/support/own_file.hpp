// What both test mains share (support/doctest_main.cpp, support/mpi_doctest_main.cpp):
// a test program runs the cases of its own test file only (whale_test_file,
// written by tests/CMakeLists.txt: a group's files are one object, which every
// program of the group links), and fails, naming the file, when no case is
// left to run: a filter that matches nothing is a mistake, not a pass.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <string>

extern const char* const whale_test_file;

namespace whale::test {

/// Test cases that passed the filters in this process's run; -1 while none ran (a query such as --count).
inline int cases_run = -1;

/// A doctest listener that keeps only that count.
struct count_cases : doctest::IReporter {
  explicit count_cases(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override { cases_run = static_cast<int>(s.numTestCasesPassingFilters); }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

/// Only this program's own file's cases. A -tc or -ts filter on the command line narrows them;
/// a -sf filter there adds its files (doctest joins filters of one kind by "or").
inline void only_own_file(doctest::Context& ctx) { ctx.addFilter("source-file", ("*" + std::string(whale_test_file)).c_str()); }

/// `rc`, or 1 when the run found no case of this program's file to run (saying so on stderr).
inline int fail_if_none_ran(int rc) {
  if (cases_run != 0) return rc;
  std::fprintf(stderr, "whale test: no test case of %s passed the filters; nothing was tested\n", whale_test_file);
  return rc ? rc : 1;
}

}  // namespace whale::test

DOCTEST_REGISTER_LISTENER("whale_count_cases", 1, whale::test::count_cases);

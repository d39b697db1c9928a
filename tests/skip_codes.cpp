// A program for check_skip_codes.sh: tests that pass, skip, or skip and then fail, to check the exit codes
// tests/gtest_main.cpp gives them (and so what CTest reports).
#include <gtest/gtest.h>

namespace {

TEST(Passes, Passes) { EXPECT_EQ(1 + 1, 2); }

TEST(Skips, Skips) { GTEST_SKIP() << "skipped on purpose"; }

// The skip line is printed, then the fixture's TearDown fails: the test must count as failed.
class SkipThenFail : public ::testing::Test {
 protected:
  void TearDown() override { ADD_FAILURE() << "a failure after the skip"; }
};

TEST_F(SkipThenFail, FailsAfterSkipping) { GTEST_SKIP() << "skipped, then fails in TearDown"; }

}  // namespace

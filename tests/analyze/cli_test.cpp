// The CLI's errors carry their exit codes (docs/cli.md#exit-codes): failure_of() maps each error
// type to its code and message in one place, and run_contained() returns that code, in this
// process and in the contained child alike. Out of memory and internal errors say what they are,
// never "I/O or format error".
#include "cli.h"

#include <gtest/gtest.h>

#include <new>
#include <stdexcept>
#include <string>

#include "dynaprobe/formats/error.h"

namespace dynaprobe::cli {
namespace {

template <typename E>
Failure failure_from(const E& error) {
  return failure_of(std::make_exception_ptr(error), "runs/x/step_00000003.h5");
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CliErrors, DynaprobeErrorsKeepTheirMessageAndMapToTheirCode) {
  const Failure usage = failure_from(UsageError("step 7 is not in runs/x"));
  EXPECT_EQ(usage.code, kExitUsage);
  EXPECT_EQ(usage.message, "step 7 is not in runs/x");
  const Failure format = failure_from(FormatError("f.h5: damaged /index"));
  EXPECT_EQ(format.code, kExitIo);
  EXPECT_EQ(format.message, "f.h5: damaged /index");
  const Failure io = failure_from(IoError("cannot write r.csv: Permission denied"));
  EXPECT_EQ(io.code, kExitIo);
  EXPECT_EQ(io.message, "cannot write r.csv: Permission denied");
}

TEST(CliErrors, CliErrorCarriesItsOwnCode) {
  for (ExitCode code : {kExitMismatch, kExitUsage, kExitIo}) {
    const Failure failure = failure_from(CliError(code, "why"));
    EXPECT_EQ(failure.code, code);
    EXPECT_EQ(failure.message, "why");
  }
}

// Running out of memory is the reader past --memory-limit (or a damaged size): exit 3, said so.
TEST(CliErrors, OutOfMemoryNamesTheFileAndTheLimit) {
  const Failure failure = failure_from(std::bad_alloc());
  EXPECT_EQ(failure.code, kExitIo);
  EXPECT_EQ(failure.message.rfind("out of memory while reading runs/x/step_00000003.h5", 0), 0u)
      << failure.message;
  EXPECT_TRUE(contains(failure.message, "--memory-limit")) << failure.message;
  EXPECT_FALSE(contains(failure.message, "internal error")) << failure.message;
}

// Any other exception is a bug of dynaprobe: said so, with its text and a request to report it.
TEST(CliErrors, OtherExceptionsAreInternalErrorsToReport) {
  for (const Failure& failure :
       {failure_from(std::runtime_error("map::at")), failure_from(std::out_of_range("vector")),
        failure_of(std::make_exception_ptr(42), "runs/x/step_00000003.h5")}) {
    EXPECT_EQ(failure.code, kExitIo);
    EXPECT_EQ(failure.message.rfind("internal error while reading runs/x/step_00000003.h5", 0), 0u)
        << failure.message;
    EXPECT_TRUE(contains(failure.message, "this is a bug in dynaprobe: please report it"))
        << failure.message;
  }
  EXPECT_TRUE(contains(failure_from(std::runtime_error("map::at")).message, ": map::at;"));
}

// What a command throws becomes "dynaprobe: error: <message>" on stderr and its exit code, run
// here (DYNAPROBE_NO_ISOLATION=1) or in the contained child.
TEST(CliErrors, RunContainedReturnsTheCodeOfWhatTheCommandThrows) {
  struct Case {
    std::function<int()> run;
    int code;
    std::string message;
  };
  const Case cases[] = {
      {[]() -> int { return kExitMismatch; }, kExitMismatch, ""},
      {[]() -> int { throw UsageError("bad step"); }, kExitUsage, "dynaprobe: error: bad step\n"},
      {[]() -> int { throw FormatError("f.h5: corrupt"); }, kExitIo,
       "dynaprobe: error: f.h5: corrupt\n"},
      {[]() -> int { throw std::bad_alloc(); }, kExitIo,
       "dynaprobe: error: out of memory while reading runs/x"},
  };
  for (bool isolate : {false, true}) {
    for (const Case& c : cases) {
      Limits limits;
      limits.isolate = isolate;
      limits.memory_mib = 0;
      testing::internal::CaptureStderr();
      const int code = run_contained(limits, Command{"runs/x", c.run});
      const std::string stderr_text = testing::internal::GetCapturedStderr();
      EXPECT_EQ(code, c.code) << "isolate=" << isolate << " " << stderr_text;
      if (c.message.empty()) {
        EXPECT_EQ(stderr_text, "");
      } else {
        EXPECT_EQ(stderr_text.rfind(c.message, 0), 0u) << stderr_text;
      }
    }
  }
}

}  // namespace
}  // namespace dynaprobe::cli

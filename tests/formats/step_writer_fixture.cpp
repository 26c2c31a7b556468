// A real writer process for crash_safety_test: the tests kill it with SIGKILL in the middle of a
// step, or run it under a file-size limit, and then check what a reader finds in its dump.
//
//   step_writer_fixture DUMP_DIR STEPS BYTES_PER_STEP [--pause-in-step N] [--grow]
//
// Writes steps 0..STEPS-1, each the records of testing::fixture_step(step, bytes) (so the test
// can regenerate them), and prints "committed <step>" after each commit. --pause-in-step N writes
// the first half of step N's records, prints "writing <N>" and sleeps until killed. --grow makes
// step s hold (s + 1) * BYTES_PER_STEP bytes, so that a file-size limit lets early steps commit
// and fails a later one. On a dynaprobe::Error: the message on stderr, exit code 3 (the CLI's
// code for an I/O or format error).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/writer.h"
#include "test_util.h"

namespace {

namespace formats = dynaprobe::formats;

constexpr int kUsageExit = 2;
constexpr int kErrorExit = 3;

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: step_writer_fixture DUMP_DIR STEPS BYTES_PER_STEP [--pause-in-step N] "
               "[--grow]\n");
  std::exit(kUsageExit);
}

std::int64_t parse_count(const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < 0) usage();
  return value;
}

// Each line is flushed at once: the test reads the pipe to know how far the writer got.
void say(const char* what, std::int64_t step) {
  std::printf("%s %lld\n", what, static_cast<long long>(step));
  std::fflush(stdout);
}

void run(const std::string& dump_dir, std::int64_t steps, std::size_t bytes_per_step,
         std::int64_t pause_step, bool grow) {
  // Small chunks, so that every record spans several chunks as large tensors do.
  formats::WriterOptions options;
  options.chunk_bytes = 64 << 10;
  const formats::Provenance provenance{{"scenario", "crash_safety_fixture"}};
  for (std::int64_t step = 0; step < steps; ++step) {
    const std::size_t bytes =
        grow ? bytes_per_step * static_cast<std::size_t>(step + 1) : bytes_per_step;
    const formats::testing::FixtureStep content = formats::testing::fixture_step(step, bytes);
    formats::StepWriter writer(dump_dir, step, provenance, options);
    if (step == pause_step) {
      const std::span<const formats::Record> records(content.records);
      writer.write(records.first(records.size() / 2));
      say("writing", step);
      while (true) ::pause();  // until the test kills us
    }
    writer.write(content.records);
    writer.commit();
    say("committed", step);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) usage();
  const std::string dump_dir = argv[1];
  const std::int64_t steps = parse_count(argv[2]);
  const auto bytes_per_step = static_cast<std::size_t>(parse_count(argv[3]));
  std::int64_t pause_step = -1;
  bool grow = false;
  for (int i = 4; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--pause-in-step" && i + 1 < argc) {
      pause_step = parse_count(argv[++i]);
    } else if (arg == "--grow") {
      grow = true;
    } else {
      usage();
    }
  }
  try {
    run(dump_dir, steps, bytes_per_step, pause_step, grow);
  } catch (const dynaprobe::Error& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return kErrorExit;
  }
  return 0;
}

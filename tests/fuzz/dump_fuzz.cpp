// Fuzz target over the dump reader and the analyzer: one input is the bytes of a step file, read
// as `dynaprobe compare` and `dynaprobe ls` read it (index, provenance, modules, graphs, every
// record, every report). A damaged input must end in a dynaprobe::Error or a report, never in a
// crash, a hang or an escaped exception of another kind.
//
// Two ways to run it:
//   - libFuzzer (clang, -DDYNAPROBE_FUZZ_LIBFUZZER=ON: ASan + UBSan, see tests/python/test_fuzz.py
//     which builds it): LLVMFuzzerTestOneInput below, e.g.
//       ASAN_OPTIONS=detect_leaks=0 build-fuzz/tests/dump_fuzz NEW_CORPUS tests/data/fuzz_seeds \
//         -max_total_time=600
//     The seeds are format 2.0 files (tests/fuzz/make_seeds.py writes them). Files of format 1
//     (tests/data/format_1.*) hold variable-length strings, whose reads crash libhdf5 1.10
//     in-process on a damaged global heap: fuzz those with the driver below.
//   - the driver of this file (any compiler; built by default with the tests):
//       build/tests/dump_fuzz [--mutations N] [--seed S] [--timeout S] FILE_OR_FOLDER...
//     runs every seed, then N mutants of each (bit flips, zeroed blocks, truncation, appended
//     bytes), each in a child process with a timeout, and reports every input that killed or hung
//     its child (saved next to the working folder as crash-<n>.h5). HDF5 1.10 itself still
//     crashes or loops on some crafted files of format 1 (the CLI contains that: docs/cli.md);
//     what this finds beyond those is a bug of ours.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/report.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"

namespace fs = std::filesystem;
namespace analyze = dynaprobe::analyze;
namespace formats = dynaprobe::formats;

namespace {

const fs::path& work_dir() {
  static const fs::path dir = [] {
    std::string pattern = (fs::temp_directory_path() / "dynaprobe-fuzz-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) std::abort();
    return fs::path(pattern);
  }();
  return dir;
}

// Everything a command reads of a step file.
void exercise(const fs::path& dump) {
  try {
    formats::StepReader reader(dump / "step_00000000.h5");
    (void)reader.graphs();
    (void)reader.modules();
    for (const auto& record : reader.records()) {
      if (record.nbytes() <= (64u << 20)) (void)reader.read(record);
    }
  } catch (const dynaprobe::Error&) {
  }
  try {
    analyze::CompareOptions options;
    options.threads = 1;
    const analyze::Comparison comparison = analyze::compare(dump, dump, options);
    for (const auto& step : comparison.steps) {
      (void)analyze::render_text(step);
      (void)analyze::render_csv({step});
    }
    (void)analyze::render_json({analyze::RankComparison{0, "", comparison}});
  } catch (const dynaprobe::Error&) {
  }
}

void write_input(const fs::path& file, const std::uint8_t* data, std::size_t size) {
  std::ofstream(file, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fs::path dump = work_dir();
  write_input(dump / "step_00000000.h5", data, size);
  exercise(dump);
  return 0;
}

#ifndef DYNAPROBE_FUZZ_LIBFUZZER
namespace {

std::vector<std::uint8_t> read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::uint8_t> mutate(std::vector<std::uint8_t> bytes, std::mt19937_64& rng) {
  if (bytes.empty()) return bytes;
  const auto below = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  switch (below(5)) {
    case 0:
    case 1:  // a few bit flips anywhere
      for (std::size_t i = 0, n = 1 + below(4); i < n; ++i) {
        bytes[below(bytes.size())] ^= static_cast<std::uint8_t>(1u << below(8));
      }
      break;
    case 2: {  // a zeroed block
      const std::size_t start = below(bytes.size());
      const std::size_t length =
          std::min<std::size_t>(std::size_t{8} << (3 * below(4)), bytes.size() - start);
      std::fill_n(bytes.begin() + static_cast<std::ptrdiff_t>(start), length, 0);
      break;
    }
    case 3:  // truncated
      bytes.resize(below(bytes.size()));
      break;
    default:  // garbage appended
      for (std::size_t i = 0, n = 1 + below(4096); i < n; ++i) bytes.push_back(rng() & 0xff);
  }
  return bytes;
}

// Runs one input in a child; returns "" or what went wrong.
std::string run_contained(const std::vector<std::uint8_t>& bytes, double timeout_s) {
  const pid_t child = ::fork();
  if (child == 0) {
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
    ::_exit(0);
  }
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  while (::waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
        timeout_s) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      return "timeout";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (WIFSIGNALED(status)) return std::string("signal ") + ::strsignal(WTERMSIG(status));
  if (WEXITSTATUS(status) != 0) return "exit " + std::to_string(WEXITSTATUS(status));
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mutations = 0;
  std::uint64_t seed = 1;
  double timeout_s = 20;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--mutations" || arg == "--seed" || arg == "--timeout") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--mutations") mutations = std::stoul(value);
      if (arg == "--seed") seed = std::stoull(value);
      if (arg == "--timeout") timeout_s = std::stod(value);
    } else if (fs::is_directory(arg)) {
      for (const auto& entry : fs::directory_iterator(arg)) inputs.push_back(entry.path());
    } else {
      inputs.push_back(arg);
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr,
                 "usage: dump_fuzz [--mutations N] [--seed S] [--timeout S] FILE_OR_FOLDER...\n");
    return 2;
  }
  std::sort(inputs.begin(), inputs.end());
  std::mt19937_64 rng(seed);
  std::size_t runs = 0, failures = 0;
  for (const fs::path& input : inputs) {
    const auto original = read_bytes(input);
    for (std::size_t m = 0; m <= mutations; ++m) {
      const auto bytes = m == 0 ? original : mutate(original, rng);
      const std::string outcome = run_contained(bytes, timeout_s);
      ++runs;
      if (outcome.empty()) continue;
      const fs::path saved = "crash-" + std::to_string(failures++) + ".h5";
      write_input(saved, bytes.data(), bytes.size());
      std::printf("%s%s: %s, saved as %s\n", input.c_str(),
                  m == 0 ? "" : (" mutant " + std::to_string(m)).c_str(), outcome.c_str(),
                  saved.c_str());
    }
  }
  std::printf("%zu inputs run, %zu killed or hung their process\n", runs, failures);
  std::error_code ignored;
  fs::remove_all(work_dir(), ignored);
  return failures == 0 ? 0 : 1;
}
#endif

// analyze_bench: how fast the analyzer compares stored tensors (analyze::compare, the engine of the
// CLI and the Python API), against (b) plain HDF5 (H5Dread of each whole dataset through HDF5's own
// filter pipeline, then a simple metrics loop) and (c) an h5py + numpy script
// (bench/analyze_reference.py); with its peak memory on a large pair and its cost per small pair.
// Prints the figures of docs/performance.md ("Analyzer") and whether each target is met.
//
//   analyze_bench [--mib N] [--pairs N] [--pair-bytes N] [--reps N] [--large-reps N]
//                 [--threads N] [--python PATH] [--script PATH] [--dir PATH] [--keep]
//
// Cases: (L) two dumps, an eager and a compiled one, each a step file holding one --mib MiB
// float32 tensor of bf16-rounded Gaussian values (the low 16 bits zero, like activations of
// mixed-precision training); compiled = eager with one bf16 ulp added to the magnitude of 1 element
// in 64. (S) one dump holding both sides of --pairs pairs of --pair-bytes float32 tensors.
// Every (L) measurement runs in a fresh child process (this program with --child), as a CLI run
// would, best of --large-reps (the h5py + numpy script once: it takes ~20 s), and the child's peak
// RSS comes from wait4(). (S) figures are the best of --reps runs in this process. Files are
// compared right after they are written (from the page cache), and the temporary folder is removed
// at the end.
#include <fcntl.h>
#include <hdf5.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/writer.h"
#include "h5.h"  // formats/src: private, for white-box tests and benchmarks

#ifndef DYNAPROBE_SOURCE_DIR
#define DYNAPROBE_SOURCE_DIR "."
#endif

namespace {

namespace fs = std::filesystem;
namespace fmt = dynaprobe::formats;
namespace an = dynaprobe::analyze;
using namespace dynaprobe::bench;

constexpr std::int64_t kColumns = 4096;
constexpr std::size_t kTensorsPerModule = 6;
constexpr an::Tolerances kTolerances{1e-4, 1e-3};  // the engine's defaults, passed to all three

struct Options {
  std::size_t mib = 1024;
  std::size_t pairs = 10000;
  std::size_t pair_bytes = 4096;
  int reps = 3;
  int large_reps = 3;
  int threads = 0;
  std::string python = ".venv/bin/python";
  std::string script = DYNAPROBE_SOURCE_DIR "/bench/analyze_reference.py";
  fs::path dir;
  bool keep = false;  // keep the temporary files (to profile a --child run on them)
  // --child MODE EAGER_DUMP COMPILED_DUMP: one (L) measurement, run in a child process.
  std::string child_mode;
  fs::path child_eager, child_compiled;
};

[[noreturn]] void usage(const std::string& message) {
  std::fprintf(
      stderr,
      "analyze_bench: %s\n"
      "usage: analyze_bench [--mib N] [--pairs N] [--pair-bytes N] [--reps N] [--large-reps N]\n"
      "                     [--threads N] [--python PATH] [--script PATH] [--dir PATH] [--keep]\n"
      "  --mib N         size of each side of the large pair in MiB (default 1024)\n"
      "  --pairs N       number of small pairs (default 10000)\n"
      "  --pair-bytes N  bytes of each small tensor, a multiple of 4 (default 4096)\n"
      "  --reps N        repetitions of the small-pair runs, the best is reported (default 3)\n"
      "  --large-reps N  fresh-process runs of the engine and of (b) on the large pair, the\n"
      "                  best is reported (default 3; the h5py + numpy script runs once)\n"
      "  --threads N     analyzer threads of the 'all threads' runs (default 0: all cores)\n"
      "  --python PATH   Python with h5py, hdf5plugin and numpy for the reference script\n"
      "                  (default .venv/bin/python, then <source>/.venv/bin/python; 'none' skips)\n"
      "  --script PATH   the reference script (default <source>/bench/analyze_reference.py)\n"
      "  --dir PATH      where the temporary files go (default: the system temp folder)\n"
      "  --keep          keep the dumps (eager, compiled, small), to profile a run on them:\n"
      "                  analyze_bench --child engine1 DUMP DUMP (or engine, plain)\n",
      message.c_str());
  std::exit(2);
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage("benchmark of the analyzer");
    if (flag == "--keep") {
      options.keep = true;
      continue;
    }
    if (flag == "--child") {
      if (i + 3 >= argc) usage("--child needs MODE EAGER_DUMP COMPILED_DUMP");
      options.child_mode = argv[++i];
      options.child_eager = argv[++i];
      options.child_compiled = argv[++i];
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + flag);
    const std::string value = argv[++i];
    const auto number = [&] {
      char* end = nullptr;
      const long long parsed = std::strtoll(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || parsed < 0) {
        usage(flag + " needs a non-negative integer, got '" + value + "'");
      }
      return parsed;
    };
    if (flag == "--mib") {
      options.mib = static_cast<std::size_t>(number());
    } else if (flag == "--pairs") {
      options.pairs = static_cast<std::size_t>(number());
    } else if (flag == "--pair-bytes") {
      options.pair_bytes = static_cast<std::size_t>(number());
    } else if (flag == "--reps") {
      options.reps = static_cast<int>(number());
    } else if (flag == "--large-reps") {
      options.large_reps = static_cast<int>(number());
    } else if (flag == "--threads") {
      options.threads = static_cast<int>(number());
    } else if (flag == "--python") {
      options.python = value;
    } else if (flag == "--script") {
      options.script = value;
    } else if (flag == "--dir") {
      options.dir = value;
    } else {
      usage("unknown option " + flag);
    }
  }
  if (options.mib == 0 || options.pairs == 0 || options.reps == 0 || options.large_reps == 0) {
    usage("--mib, --pairs, --reps and --large-reps must be positive");
  }
  if (options.pair_bytes == 0 || options.pair_bytes % 4 != 0) {
    usage("--pair-bytes must be a positive multiple of 4");
  }
  return options;
}

double gb_per_s(double bytes, double seconds) { return bytes / 1e9 / seconds; }

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"); 0 if unreadable.
long status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) {
      return std::strtol(line.c_str() + field.size() + 1, nullptr, 10);
    }
  }
  return 0;
}

// The 1-minute load average: other work on the machine makes every figure here slower, and the
// multi-threaded ones most.
double load_average() {
  double load = 0;
  std::ifstream("/proc/loadavg") >> load;
  return load;
}

// ---- data ---------------------------------------------------------------------------------------

// `count` deterministic bf16-rounded N(0, 1) samples as float32 bit patterns, generated in
// parallel blocks (1 GiB in a few seconds on two cores).
std::unique_ptr<std::uint32_t[]> bf16_rounded_gaussian(std::size_t count, std::uint64_t seed) {
  std::unique_ptr<std::uint32_t[]> out(new std::uint32_t[count]);
  constexpr std::size_t kBlock = 1 << 16;
  tbb::parallel_for(std::size_t{0}, (count + kBlock - 1) / kBlock, [&](std::size_t block) {
    std::mt19937_64 random(mix(seed * 1000003 + block));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const std::size_t end = std::min(count, (block + 1) * kBlock);
    for (std::size_t i = block * kBlock; i < end; ++i) out[i] = bf16_rounded_bits(normal(random));
  });
  return out;
}

// The compiled side: one bf16 ulp added to the magnitude of 1 element in 64 (a relative change of
// 2^-8 to 2^-7, so those elements fail allclose, as a real compiled kernel's rounding would). The
// result stays bf16-rounded and finite.
void perturb(std::uint32_t* bits, std::size_t count, std::uint64_t first_index) {
  tbb::parallel_for(std::size_t{0}, count, [&](std::size_t i) {
    if ((mix(first_index + i) & 63) == 0) bits[i] += 0x10000u;
  });
}

fmt::RecordKey key_of(std::size_t i, fmt::Side side) {
  return {0,
          "layers." + std::to_string(i / kTensorsPerModule),
          0,
          fmt::Kind::kFwdOutput,
          static_cast<std::uint32_t>(i % kTensorsPerModule),
          side};
}

fs::path step_file(const fs::path& dump) { return dump / fmt::step_file_name(0); }

// Writes the (L) case: the dumps root/eager and root/compiled, one step file each.
void write_large(const Options& options, const fs::path& root) {
  const std::size_t count = (options.mib << 20) / 4;
  const std::vector<std::int64_t> shape = {static_cast<std::int64_t>(count) / kColumns, kColumns};
  auto bits = bf16_rounded_gaussian(count, 1);
  for (const fmt::Side side : {fmt::Side::kEager, fmt::Side::kCompiled}) {
    if (side == fmt::Side::kCompiled) perturb(bits.get(), count, 0);
    const std::string name(fmt::side_name(side));
    fmt::StepWriter writer(root / name, 0, {{"producer", "bench/analyze_bench"}, {"side", name}});
    writer.write(fmt::Record{key_of(0, side), "", {fmt::DType::kFloat32, shape, bits.get()}});
    load_into_page_cache(writer.commit());
  }
}

// Writes the (S) case: one dump root/small holding both sides of every pair.
void write_small(const Options& options, const fs::path& root) {
  const std::size_t elements = options.pair_bytes / 4;
  const std::size_t count = options.pairs * elements;
  auto eager = bf16_rounded_gaussian(count, 2);
  std::unique_ptr<std::uint32_t[]> compiled(new std::uint32_t[count]);
  std::memcpy(compiled.get(), eager.get(), count * 4);
  perturb(compiled.get(), count, 0);
  std::vector<fmt::Record> records;
  records.reserve(2 * options.pairs);
  for (std::size_t i = 0; i < options.pairs; ++i) {
    const std::vector<std::int64_t> shape = {static_cast<std::int64_t>(elements)};
    records.push_back({key_of(i, fmt::Side::kEager),
                       "",
                       {fmt::DType::kFloat32, shape, eager.get() + i * elements}});
    records.push_back({key_of(i, fmt::Side::kCompiled),
                       "",
                       {fmt::DType::kFloat32, shape, compiled.get() + i * elements}});
  }
  fmt::StepWriter writer(root / "small", 0, {{"producer", "bench/analyze_bench"}});
  writer.write(records);
  load_into_page_cache(writer.commit());
}

// ---- results ------------------------------------------------------------------------------------

// The figures of one run over some pairs: time, and the metrics aggregated over pairs (largest
// max_abs and max_rel, mean of mean_abs, number of allclose pairs) to check that all agree.
struct Run {
  double seconds = 0;
  std::uint64_t pairs = 0;
  std::uint64_t bytes = 0;  // both sides, uncompressed
  double max_abs = 0, mean_abs = 0, max_rel = 0;
  std::uint64_t allclose = 0;
  long peak_rss_kib = 0;   // of the child process that ran it, if one did
  long start_rss_kib = 0;  // the child's RSS just before it started comparing
  bool ran = false;

  double gbps() const { return gb_per_s(static_cast<double>(bytes), seconds); }
  double us_per_pair() const { return seconds / static_cast<double>(pairs) * 1e6; }
};

std::string result_line(const Run& run) {
  char line[512];
  std::snprintf(line, sizeof(line),
                "RESULT pairs=%llu bytes=%llu seconds=%.6f max_abs=%.9g mean_abs=%.17g "
                "max_rel=%.9g allclose=%llu rss_before_kib=%ld",
                static_cast<unsigned long long>(run.pairs),
                static_cast<unsigned long long>(run.bytes), run.seconds, run.max_abs, run.mean_abs,
                run.max_rel, static_cast<unsigned long long>(run.allclose), run.start_rss_kib);
  return line;
}

// Parses the "RESULT key=value ..." line of a child's or of the reference script's output.
std::optional<Run> parse_result(const std::string& output) {
  const std::size_t at = output.rfind("RESULT ");
  if (at == std::string::npos) return std::nullopt;
  std::map<std::string, std::string> fields;
  std::size_t position = at + 7;
  const std::size_t end = output.find('\n', at);
  const std::string line = output.substr(position, end == std::string::npos ? end : end - position);
  std::size_t start = 0;
  while (start < line.size()) {
    std::size_t stop = line.find(' ', start);
    if (stop == std::string::npos) stop = line.size();
    const std::string token = line.substr(start, stop - start);
    const std::size_t equals = token.find('=');
    if (equals != std::string::npos) fields[token.substr(0, equals)] = token.substr(equals + 1);
    start = stop + 1;
  }
  const auto number = [&](const char* key) {
    auto found = fields.find(key);
    return found == fields.end() ? 0.0 : std::strtod(found->second.c_str(), nullptr);
  };
  Run run;
  run.seconds = number("seconds");
  run.pairs = static_cast<std::uint64_t>(number("pairs"));
  run.bytes = static_cast<std::uint64_t>(number("bytes"));
  run.max_abs = number("max_abs");
  run.mean_abs = number("mean_abs");
  run.max_rel = number("max_rel");
  run.allclose = static_cast<std::uint64_t>(number("allclose"));
  run.start_rss_kib = static_cast<long>(number("rss_before_kib"));
  run.ran = run.seconds > 0 && run.pairs > 0;
  return run;
}

// ---- the engine ---------------------------------------------------------------------------------

Run run_engine(const fs::path& eager_dump, const fs::path& compiled_dump, int threads) {
  an::CompareOptions options;
  options.threads = threads;
  options.atol = kTolerances.atol;
  options.rtol = kTolerances.rtol;
  Run run;
  an::Comparison comparison;
  run.seconds = timed([&] { comparison = an::compare(eager_dump, compiled_dump, options); });
  for (const an::StepReport& step : comparison.steps) {
    for (const an::Row& row : step.rows) {
      if (!row.metrics) continue;
      const an::TensorMetrics& m = *row.metrics;
      ++run.pairs;
      run.bytes += m.elements * 8;  // float32 on both sides
      run.max_abs = std::max(run.max_abs, m.max_abs);
      run.mean_abs += m.mean_abs;
      run.max_rel = std::max(run.max_rel, m.max_rel);
      run.allclose += m.allclose;
    }
  }
  if (run.pairs) run.mean_abs /= static_cast<double>(run.pairs);
  run.ran = true;
  return run;
}

// ---- (b) plain HDF5 + a simple loop -------------------------------------------------------------

// The spec's four metrics with the obvious loop (float32 differences like torch, a double sum),
// as one would write it without thinking about vectorisation. Computes fewer metrics than the
// engine (no cosine, RMSE, NaN/Inf counts, worst element), which only flatters the baseline.
struct SimpleMetrics {
  float max_abs = 0, max_rel = 0;
  double mean_abs = 0;
  bool allclose = true;
};

SimpleMetrics simple_metrics(const float* a, const float* b, std::size_t n,
                             const an::Tolerances& tolerances) {
  const auto atol = static_cast<float>(tolerances.atol);
  const auto rtol = static_cast<float>(tolerances.rtol);
  SimpleMetrics m;
  double sum = 0;
  bool nan = false;
  for (std::size_t i = 0; i < n; ++i) {
    const float diff = std::fabs(a[i] - b[i]);
    const float rel = diff / (std::fabs(a[i]) + 1e-8f);
    if (std::isnan(diff)) nan = true;
    m.max_abs = std::max(m.max_abs, diff);
    m.max_rel = std::max(m.max_rel, rel);
    sum += diff;
    if (!(a[i] == b[i] || (std::isfinite(diff) && diff <= atol + rtol * std::fabs(b[i])))) {
      m.allclose = false;
    }
  }
  m.mean_abs = n ? sum / static_cast<double>(n) : 0;
  if (nan) m.max_abs = m.max_rel = std::numeric_limits<float>::quiet_NaN();
  return m;
}

void read_whole(hid_t file, const std::string& name, float* out) {
  const std::string where = "plain H5Dread " + name;
  fmt::h5::Handle dataset =
      fmt::h5::dataset_handle(H5Dopen2(file, name.c_str(), H5P_DEFAULT), "opening", where);
  fmt::h5::check(H5Dread(dataset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out),
                 "reading", where);
}

fmt::h5::Handle open_plain(const fs::path& path) {
  return fmt::h5::file_handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "opening",
                              path.string());
}

void add(Run& run, const SimpleMetrics& m, std::size_t elements) {
  ++run.pairs;
  run.bytes += elements * 8;
  run.max_abs = std::max<double>(run.max_abs, m.max_abs);
  run.mean_abs += static_cast<float>(m.mean_abs);  // torch's mean of float32 is a float32
  run.max_rel = std::max<double>(run.max_rel, m.max_rel);
  run.allclose += m.allclose;
}

// The large pair: reads each whole dataset into memory (allocation included: a plain reader
// needs O(tensor) memory), then one pass of the loop.
Run run_plain_large(const fs::path& eager_dump, const fs::path& compiled_dump) {
  fmt::h5::init();  // registers the zstd filter for HDF5's own pipeline
  fmt::h5::Lock lock(fmt::h5::hdf5_mutex());
  Run run;
  run.seconds = timed([&] {
    fmt::h5::Handle eager_file = open_plain(step_file(eager_dump));
    fmt::h5::Handle compiled_file = open_plain(step_file(compiled_dump));
    const std::string eager_name = fmt::dataset_path(key_of(0, fmt::Side::kEager));
    const std::string compiled_name = fmt::dataset_path(key_of(0, fmt::Side::kCompiled));
    fmt::h5::Handle dataset = fmt::h5::dataset_handle(
        H5Dopen2(eager_file.get(), eager_name.c_str(), H5P_DEFAULT), "opening", eager_name);
    fmt::h5::Handle space =
        fmt::h5::space_handle(H5Dget_space(dataset.get()), "dataspace", eager_name);
    const auto n = static_cast<std::size_t>(H5Sget_simple_extent_npoints(space.get()));
    std::unique_ptr<float[]> a(new float[n]), b(new float[n]);
    read_whole(eager_file.get(), eager_name, a.get());
    read_whole(compiled_file.get(), compiled_name, b.get());
    add(run, simple_metrics(a.get(), b.get(), n, kTolerances), n);
  });
  run.ran = true;
  return run;
}

// The small pairs: one file open, then per pair two H5Dopen + H5Dread into reused buffers.
Run run_plain_small(const Options& options, const fs::path& dump) {
  fmt::h5::Lock lock(fmt::h5::hdf5_mutex());
  const std::size_t n = options.pair_bytes / 4;
  std::vector<float> a(n), b(n);
  Run run;
  run.seconds = timed([&] {
    fmt::h5::Handle file = open_plain(step_file(dump));
    for (std::size_t i = 0; i < options.pairs; ++i) {
      read_whole(file.get(), fmt::dataset_path(key_of(i, fmt::Side::kEager)), a.data());
      read_whole(file.get(), fmt::dataset_path(key_of(i, fmt::Side::kCompiled)), b.data());
      add(run, simple_metrics(a.data(), b.data(), n, kTolerances), n);
    }
  });
  run.mean_abs /= static_cast<double>(run.pairs);
  run.ran = true;
  return run;
}

// ---- child processes ----------------------------------------------------------------------------

struct ChildOutput {
  std::string stdout_text;
  int status = 0;
  long max_rss_kib = 0;
};

// Runs `args` (args[0] is the program) with stdout captured; stderr passes through.
ChildOutput run_child(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw dynaprobe::IoError("pipe2 failed");
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid < 0) throw dynaprobe::IoError("fork failed");
  if (pid == 0) {  // only async-signal-safe calls until exec: the parent has TBB threads
    ::dup2(fds[1], STDOUT_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  ChildOutput output;
  char buffer[4096];
  ssize_t got;
  while ((got = ::read(fds[0], buffer, sizeof(buffer))) > 0) {
    output.stdout_text.append(buffer, static_cast<std::size_t>(got));
  }
  ::close(fds[0]);
  rusage usage{};
  ::wait4(pid, &output.status, 0, &usage);
  output.max_rss_kib = usage.ru_maxrss;  // KiB on Linux
  return output;
}

// One (L) measurement in a fresh process: "engine" (all threads), "engine1" (one thread), "plain".
Run run_large_child(const Options& options, const std::string& mode, const fs::path& root) {
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const ChildOutput output =
      run_child({self, "--child", mode, (root / "eager").string(), (root / "compiled").string(),
                 "--threads", std::to_string(options.threads)});
  auto run = parse_result(output.stdout_text);
  if (!WIFEXITED(output.status) || WEXITSTATUS(output.status) != 0 || !run || !run->ran) {
    throw dynaprobe::Error("the child run '" + mode + "' failed: " + output.stdout_text);
  }
  run->peak_rss_kib = output.max_rss_kib;
  return *run;
}

// The fastest of --large-reps fresh-process runs, with the largest peak RSS of them.
Run best_large_child(const Options& options, const std::string& mode, const fs::path& root) {
  Run best = run_large_child(options, mode, root);
  for (int i = 1; i < options.large_reps; ++i) {
    const Run again = run_large_child(options, mode, root);
    const long peak = std::max(best.peak_rss_kib, again.peak_rss_kib);
    if (again.seconds < best.seconds) best = again;
    best.peak_rss_kib = peak;
  }
  return best;
}

int child_main(const Options& options) {
  const long start_rss_kib = status_kib("VmRSS");
  Run run;
  if (options.child_mode == "engine") {
    run = run_engine(options.child_eager, options.child_compiled, options.threads);
  } else if (options.child_mode == "engine1") {
    run = run_engine(options.child_eager, options.child_compiled, 1);
  } else if (options.child_mode == "plain") {
    run = run_plain_large(options.child_eager, options.child_compiled);
  } else {
    usage("unknown --child mode " + options.child_mode);
  }
  run.start_rss_kib = start_rss_kib;
  std::printf("%s\n", result_line(run).c_str());
  return 0;
}

// (c): the reference script, if a Python is there: --python as given, else relative to the
// source folder (the project's .venv).
std::string find_python(const Options& options) {
  if (options.python == "none" || options.python.empty()) return "";
  std::error_code error;
  if (fs::exists(options.python, error)) return options.python;
  const fs::path in_source = fs::path(DYNAPROBE_SOURCE_DIR) / options.python;
  if (fs::path(options.python).is_relative() && fs::exists(in_source, error)) {
    return in_source.string();
  }
  return "";
}

Run run_python(const std::string& python, const Options& options, const fs::path& eager_file,
               const fs::path& compiled_file, int reps) {
  char atol[32], rtol[32];
  std::snprintf(atol, sizeof(atol), "%.17g", kTolerances.atol);
  std::snprintf(rtol, sizeof(rtol), "%.17g", kTolerances.rtol);
  const ChildOutput output =
      run_child({python, options.script, eager_file.string(), compiled_file.string(), "--atol",
                 atol, "--rtol", rtol, "--reps", std::to_string(reps)});
  auto run = parse_result(output.stdout_text);
  if (!WIFEXITED(output.status) || WEXITSTATUS(output.status) != 0 || !run || !run->ran) {
    std::fprintf(stderr, "analyze_bench: the reference script failed (status %d): %s\n",
                 output.status, output.stdout_text.c_str());
    return {};
  }
  run->peak_rss_kib = output.max_rss_kib;
  return *run;
}

// ---- report -------------------------------------------------------------------------------------

// The engine's metrics against a baseline's: max_abs and max_rel are exact float32 maxima;
// mean_abs differs only by summation order; allclose must agree pair by pair (checked by count).
bool agrees(const Run& engine, const Run& other, const char* name) {
  if (!other.ran) return true;
  const auto close = [](double x, double y, double tolerance) {
    return x == y || std::fabs(x - y) <= tolerance * std::max(std::fabs(x), std::fabs(y));
  };
  const bool ok = engine.pairs == other.pairs && close(engine.max_abs, other.max_abs, 1e-6) &&
                  close(engine.max_rel, other.max_rel, 1e-6) &&
                  close(engine.mean_abs, other.mean_abs, 1e-5) && engine.allclose == other.allclose;
  if (!ok) {
    std::printf(
        "  METRICS DISAGREE with %s: pairs %llu/%llu max_abs %.9g/%.9g mean_abs %.9g/%.9g "
        "max_rel %.9g/%.9g allclose %llu/%llu\n",
        name, static_cast<unsigned long long>(engine.pairs),
        static_cast<unsigned long long>(other.pairs), engine.max_abs, other.max_abs,
        engine.mean_abs, other.mean_abs, engine.max_rel, other.max_rel,
        static_cast<unsigned long long>(engine.allclose),
        static_cast<unsigned long long>(other.allclose));
  }
  return ok;
}

std::string mib(long kib) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.0f MiB", static_cast<double>(kib) / 1024);
  return text;
}

void print_run(const char* name, const Run& run, bool per_pair) {
  if (!run.ran) {
    std::printf("  %-34s skipped\n", name);
    return;
  }
  std::printf("  %-34s %8.3f s  %7.2f GB/s", name, run.seconds, run.gbps());
  if (per_pair) std::printf("  %8.1f us/pair", run.us_per_pair());
  if (run.peak_rss_kib > 0) std::printf("  peak RSS %s", mib(run.peak_rss_kib).c_str());
  std::printf("\n");
}

struct Target {
  std::string what;
  double value;
  double limit;
  bool at_most;  // value must be <= limit (else >=)
  bool known = true;
  bool met() const { return at_most ? value <= limit : value >= limit; }
};

// Removes the temporary folder however the benchmark ends.
struct TempDir {
  fs::path path;
  bool keep = false;
  ~TempDir() {
    std::error_code ignored;
    if (!keep) fs::remove_all(path, ignored);
  }
};

// The runs of one case: the engine on all threads and on one, (b) plain and (c) h5py + numpy.
struct CaseRuns {
  Run all, one, plain, python;
};

// The benchmark's heading, and a note when other work already competes for the cores.
void print_heading(const Options& options, int threads, const std::string& python,
                   const fs::path& folder) {
  std::printf(
      "analyze_bench: %zu MiB per side, %zu pairs x %zu B, %d threads, best of %d runs "
      "(large pair) and %d (small pairs), files in %s\n  reference: %s %s\n",
      options.mib, options.pairs, options.pair_bytes, threads, options.large_reps, options.reps,
      folder.c_str(), python.empty() ? "(no Python found: skipped)" : python.c_str(),
      options.script.c_str());
  const double load = load_average();
  if (load > 0.5) {
    std::printf(
        "  note: load average %.2f before starting: other work competes for the cores, "
        "so the figures are low and noisy\n",
        load);
  }
  std::fflush(stdout);
}

// Prints a case's runs; whether their metrics agree with the engine's.
bool print_case(const CaseRuns& runs, int threads, bool per_pair) {
  const std::string all_name = "engine, " + std::to_string(threads) + " threads";
  print_run(all_name.c_str(), runs.all, per_pair);
  print_run("engine, 1 thread", runs.one, per_pair);
  print_run("(b) plain H5Dread + loop", runs.plain, per_pair);
  print_run("(c) h5py + numpy", runs.python, per_pair);
  return agrees(runs.all, runs.one, "engine, 1 thread") &&
         agrees(runs.all, runs.plain, "(b) plain") && agrees(runs.all, runs.python, "(c) python");
}

// (L) one large pair in two dumps, each run in a fresh process like a CLI run (nothing pooled,
// its own peak RSS); the dumps are removed afterwards unless --keep.
CaseRuns measure_large(const Options& options, const fs::path& folder, const std::string& python,
                       int threads, bool& agree) {
  const double write_s = timed([&] { write_large(options, folder); });
  const fs::path eager_file = step_file(folder / "eager");
  const fs::path compiled_file = step_file(folder / "compiled");
  std::printf(
      "\n(L) 1 pair of %zu MiB float32 (bf16-rounded) in two dumps: written in %.1f s, "
      "%.0f MiB on disk\n",
      options.mib, write_s,
      static_cast<double>(fs::file_size(eager_file) + fs::file_size(compiled_file)) / (1 << 20));
  std::fflush(stdout);
  CaseRuns runs;
  runs.all = best_large_child(options, "engine", folder);
  runs.one = best_large_child(options, "engine1", folder);
  runs.plain = best_large_child(options, "plain", folder);
  if (!python.empty()) runs.python = run_python(python, options, eager_file, compiled_file, 1);
  agree = print_case(runs, threads, false) && agree;
  std::printf("  engine peak RSS %s (%s above its start)\n", mib(runs.all.peak_rss_kib).c_str(),
              mib(runs.all.peak_rss_kib - runs.all.start_rss_kib).c_str());
  if (!options.keep) {  // frees ~0.7 GB of page cache before (S)
    std::error_code ignored;
    fs::remove_all(folder / "eager", ignored);
    fs::remove_all(folder / "compiled", ignored);
  }
  return runs;
}

// (S) many small pairs, both sides in one dump; each figure the best of --reps in this process.
CaseRuns measure_small(const Options& options, const fs::path& folder, const std::string& python,
                       int threads, bool& agree) {
  const double write_s = timed([&] { write_small(options, folder); });
  const fs::path dump = folder / "small";
  std::printf("\n(S) %zu pairs of %zu B float32 (bf16-rounded) in one dump: written in %.1f s\n",
              options.pairs, options.pair_bytes, write_s);
  std::fflush(stdout);
  const auto best = [&](const std::function<Run()>& body) {
    Run result = body();
    for (int i = 1; i < options.reps; ++i) {
      Run again = body();
      if (again.seconds < result.seconds) result = again;
    }
    return result;
  };
  CaseRuns runs;
  runs.all = best([&] { return run_engine(dump, dump, options.threads); });
  runs.one = best([&] { return run_engine(dump, dump, 1); });
  runs.plain = best([&] { return run_plain_small(options, dump); });
  if (!python.empty()) {
    runs.python = run_python(python, options, step_file(dump), step_file(dump), options.reps);
  }
  agree = print_case(runs, threads, true) && agree;
  return runs;
}

// How many times faster `ours` ran than `theirs` (0 when `theirs` did not run).
double ratio(const Run& ours, const Run& theirs) {
  return theirs.ran ? theirs.seconds / ours.seconds : 0.0;
}

// The table of docs/performance.md.
void print_table(const Options& options, int threads, const CaseRuns& large,
                 const CaseRuns& small) {
  std::printf(
      "\n| case | engine %dT | engine 1T | (a) %dT/1T | (b) plain H5Dread | engine/(b) | "
      "(c) h5py+numpy | engine/(c) | engine peak RSS |\n|---|---|---|---|---|---|---|---|---|\n",
      threads, threads);
  std::printf(
      "| (L) 1 x %zu MiB pair | %.2f GB/s | %.2f GB/s | %.2fx | %.2f GB/s | %.1fx | "
      "%.2f GB/s | %.1fx | %s |\n",
      options.mib, large.all.gbps(), large.one.gbps(), ratio(large.all, large.one),
      large.plain.gbps(), ratio(large.all, large.plain),
      large.python.ran ? large.python.gbps() : 0.0, ratio(large.all, large.python),
      mib(large.all.peak_rss_kib).c_str());
  std::printf(
      "| (S) %zu x %zu B pairs | %.1f us/pair | %.1f us/pair | %.2fx | %.1f us/pair | "
      "%.1fx | %.1f us/pair | %.1fx | |\n",
      options.pairs, options.pair_bytes, small.all.us_per_pair(), small.one.us_per_pair(),
      ratio(small.all, small.one), small.plain.us_per_pair(), ratio(small.all, small.plain),
      small.python.ran ? small.python.us_per_pair() : 0.0, ratio(small.all, small.python));
}

// Prints each target as met or MISSED; whether all were met.
bool print_targets(int threads, const CaseRuns& large, const CaseRuns& small) {
  const std::vector<Target> targets = {
      {"(a) speed-up 1 -> " + std::to_string(threads) + " threads (L)", ratio(large.all, large.one),
       1.7, false},
      {"(b) engine / plain H5Dread (L)", ratio(large.all, large.plain), 4.0, false},
      {"(c) engine / h5py + numpy (L)", ratio(large.all, large.python), 10.0, false,
       large.python.ran},
      {"peak RSS comparing (L), MiB", static_cast<double>(large.all.peak_rss_kib) / 1024, 256.0,
       true},
      {"us per small pair (S)", small.all.us_per_pair(), 40.0, true},
  };
  std::printf("\ntargets:\n");
  bool all = true;
  for (const Target& t : targets) {
    if (!t.known) {
      std::printf("  %-38s %8s  %s %5.1f  skipped\n", t.what.c_str(), "-",
                  t.at_most ? "<=" : ">=", t.limit);
      all = false;
      continue;
    }
    std::printf("  %-38s %8.2f  %s %5.1f  %s\n", t.what.c_str(), t.value,
                t.at_most ? "<=" : ">=", t.limit, t.met() ? "met" : "MISSED");
    all = all && t.met();
  }
  return all;
}

int bench_main(const Options& options) {
  fmt::h5::init();
  const int threads = options.threads > 0 ? options.threads : tbb::info::default_concurrency();
  const std::string python = find_python(options);
  const fs::path base = options.dir.empty() ? fs::temp_directory_path() : options.dir;
  TempDir temp{base / ("analyze_bench." + std::to_string(::getpid())), options.keep};
  fs::create_directories(temp.path);
  print_heading(options, threads, python, temp.path);
  bool agree = true;
  const CaseRuns large = measure_large(options, temp.path, python, threads, agree);
  const CaseRuns small = measure_small(options, temp.path, python, threads, agree);
  print_table(options, threads, large, small);
  const bool all = print_targets(threads, large, small);
  std::printf("%s; metrics %s; load average %.2f at the end\n",
              all ? "all targets met" : "some targets missed or skipped",
              agree ? "agree across engine, plain and h5py+numpy" : "DISAGREE", load_average());
  return agree ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  try {
    return options.child_mode.empty() ? bench_main(options) : child_main(options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "analyze_bench: %s\n", error.what());
    return 3;
  }
}

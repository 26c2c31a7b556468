// The dynaprobe command line: compare dumps, list them, extract their graphs.
// Exit codes: 0 all pass, 1 mismatches found, 2 usage error, 3 I/O or format error.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <thread>

#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/report.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"

namespace fs = std::filesystem;
namespace analyze = dynaprobe::analyze;
namespace formats = dynaprobe::formats;

namespace {

constexpr int kExitPass = 0;
constexpr int kExitMismatch = 1;
constexpr int kExitUsage = 2;
constexpr int kExitIo = 3;

// Writes a report or a graph. O_NOFOLLOW: a symbolic link at the name (planted in an output
// folder) is refused rather than followed, so nothing is written outside the folder given.
void write_text_file(const fs::path& path, const std::string& text) {
  if (path.has_parent_path()) {
    std::error_code error;
    fs::create_directories(path.parent_path(), error);
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int code = errno;
    throw dynaprobe::IoError("cannot write " + path.string() + ": " +
                             (code == ELOOP ? std::string("it is a symbolic link, which dynaprobe "
                                                          "does not follow; remove it")
                                            : std::string(std::strerror(code))));
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string reason = std::strerror(errno);
      ::close(fd);
      throw dynaprobe::IoError("cannot write " + path.string() + ": " + reason);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0) {
    throw dynaprobe::IoError("cannot write " + path.string() + ": " + std::strerror(errno));
  }
}

// "report.csv" -> "report_rank1.csv", for per-rank CSVs of a run folder.
fs::path with_rank(const fs::path& path, int rank) {
  fs::path result = path;
  result.replace_filename(path.stem().string() + "_rank" + std::to_string(rank) +
                          path.extension().string());
  return result;
}

// A progress bar on stderr, drawn only when stderr is a terminal and the work takes a while.
std::function<void(std::uint64_t, std::uint64_t)> progress_bar() {
  if (!::isatty(STDERR_FILENO)) return nullptr;
  const auto start = std::chrono::steady_clock::now();
  return [start, drawn = false](std::uint64_t done, std::uint64_t total) mutable {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (total == 0 || (elapsed < 0.5 && !drawn)) return;
    const double fraction = std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
    const int width = 40;
    const int filled = static_cast<int>(fraction * width);
    std::fprintf(stderr, "\r  comparing [%s%s] %3.0f%%  %.2f / %.2f GB  ",
                 std::string(filled, '#').c_str(), std::string(width - filled, ' ').c_str(),
                 fraction * 100, static_cast<double>(done) / 1e9, static_cast<double>(total) / 1e9);
    if (done >= total) std::fprintf(stderr, "\r%80s\r", "");
    std::fflush(stderr);
    drawn = true;
  };
}

// ---------------------------------------------------------------------------------------------
struct CompareCommand {
  std::string dump, dump2;
  std::string csv, merged_csv, json;
  std::optional<double> atol, rtol;
  std::optional<std::int64_t> step;
  std::string module;
  int threads = 0;
};

void setup_compare(CLI::App& app, CompareCommand& cmd) {
  auto* sub = app.add_subcommand(
      "compare", "Compare the eager and the compiled side of a dump and print the report");
  sub->fallthrough();  // --time-limit and --memory-limit may follow the command
  sub->footer(
      "DUMP is a run folder (rank<R>/ folders), a dump folder (step_<N>.h5 files) or one step\n"
      "file, holding both sides (single-pass, two-pass). With DUMP2, the eager side comes from\n"
      "DUMP and the compiled side from DUMP2: captures made in different processes or on\n"
      "different machines (PrecisionChecker.capture). Run folders are paired rank by rank.\n"
      "Provenance that differs between DUMP and DUMP2 (torch version, backend, ...) is printed\n"
      "before the report.\n"
      "\n"
      "Examples:\n"
      "  dynaprobe compare dynaprobe_runs/20250101-120000-4242-0/rank0\n"
      "  dynaprobe compare eager/ compiled/ --csv report.csv\n"
      "  dynaprobe compare RUN --step 3 --module 'layers.*' --atol 1e-2 --rtol 1.6e-2\n"
      "\n"
      "Exit codes: 0 all pass, 1 not all pass (a FAIL or WARN row, or the loss check failed),\n"
      "2 usage error, 3 I/O or format error.");
  sub->add_option("DUMP", cmd.dump,
                  "Run folder, dump folder or step file: both sides, or the eager "
                  "side when DUMP2 is given")
      ->type_name("")
      ->required();
  sub->add_option("DUMP2", cmd.dump2, "The compiled side, captured separately")->type_name("");
  sub->add_option("--csv", cmd.csv,
                  "Also write the 9-column CSV report to PATH (a run folder of several ranks: one "
                  "file per rank, PATH_rank<R>.csv)")
      ->type_name("PATH");
  sub->add_option("--merged-csv", cmd.merged_csv,
                  "Also write one CSV for all ranks to PATH: rank,scenario and the 9 columns")
      ->type_name("PATH");
  sub->add_option("--json", cmd.json,
                  "Also write every row with every metric (cosine, RMSE, NaN/Inf counts, worst "
                  "element, ...) and both sides' provenance to PATH as JSON")
      ->type_name("PATH");
  sub->add_option("--atol", cmd.atol,
                  "Absolute tolerance (default: the one the dump was captured with, else 1e-4)")
      ->type_name("X")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--rtol", cmd.rtol,
                  "Relative tolerance (default: the one the dump was captured with, else 1e-3)")
      ->type_name("X")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--step", cmd.step, "Compare only step N (default: every step)")->type_name("N");
  sub->add_option("--module", cmd.module,
                  "Compare only modules whose name matches GLOB (shell-style, e.g. 'layers.*')")
      ->type_name("GLOB");
  sub->add_option("--threads", cmd.threads, "Threads to compare with (default, 0: all cores)")
      ->type_name("N")
      ->check(CLI::NonNegativeNumber);
}

int run_compare(const CompareCommand& cmd) {
  analyze::CompareOptions options;
  options.atol = cmd.atol;
  options.rtol = cmd.rtol;
  options.step = cmd.step;
  options.module_glob = cmd.module;
  options.threads = cmd.threads;
  options.progress = progress_bar();

  const auto eager_ranks = analyze::find_rank_dumps(cmd.dump);
  auto compiled_ranks = eager_ranks;
  if (!cmd.dump2.empty()) {
    compiled_ranks = analyze::find_rank_dumps(cmd.dump2);
    if (compiled_ranks.size() != eager_ranks.size()) {
      throw dynaprobe::UsageError(
          cmd.dump + " has " + std::to_string(eager_ranks.size()) + " rank(s) but " + cmd.dump2 +
          " has " + std::to_string(compiled_ranks.size()) +
          "; compare runs with the same ranks, or name one rank folder each");
    }
  }
  std::vector<analyze::RankComparison> results;
  const bool many_ranks = eager_ranks.size() > 1;
  for (std::size_t i = 0; i < eager_ranks.size(); ++i) {
    analyze::RankComparison result;
    result.rank = eager_ranks[i].rank;
    result.comparison = analyze::compare(eager_ranks[i].path, compiled_ranks[i].path, options);
    const auto& provenance = result.comparison.compiled_provenance;
    auto scenario = provenance.find("scenario");
    result.scenario = scenario == provenance.end() ? "" : scenario->second;

    for (const auto& warning : result.comparison.warnings) {
      std::cerr << "dynaprobe: warning: " << warning << "\n";
    }
    if (many_ranks) {
      std::cout << "Rank " << result.rank
                << (result.scenario.empty() ? "" : " (scenario " + result.scenario + ")") << ": "
                << eager_ranks[i].path.string() << "\n";
    }
    std::cout << analyze::render_provenance(result.comparison);
    const auto& steps = result.comparison.steps;
    for (const auto& step : steps) {
      if (steps.size() > 1) std::cout << "Step " << step.step << "\n";
      std::cout << analyze::render_text(step);
    }
    if (!cmd.csv.empty()) {
      const fs::path path = many_ranks ? with_rank(cmd.csv, result.rank) : fs::path(cmd.csv);
      write_text_file(path, analyze::render_csv(steps));
      std::cout << "CSV report saved to: " << path.string() << "\n";
    }
    results.push_back(std::move(result));
  }
  if (!cmd.merged_csv.empty()) {
    write_text_file(cmd.merged_csv, analyze::render_merged_csv(results));
    std::cout << "Merged CSV report saved to: " << cmd.merged_csv << "\n";
  }
  if (!cmd.json.empty()) {
    write_text_file(cmd.json, analyze::render_json(results));
    std::cout << "JSON report saved to: " << cmd.json << "\n";
  }
  const bool all_pass = std::all_of(results.begin(), results.end(),
                                    [](const auto& r) { return r.comparison.all_pass(); });
  return all_pass ? kExitPass : kExitMismatch;
}

// ---------------------------------------------------------------------------------------------
struct LsCommand {
  std::string dump;
};

void setup_ls(CLI::App& app, LsCommand& cmd) {
  auto* sub = app.add_subcommand(
      "ls", "List a dump's steps, provenance, modules, records and graphs (no tensor data read)");
  sub->fallthrough();
  sub->footer(
      "For each step file: its provenance (torch version, backend, mode, tolerances, host, ...),\n"
      "the modules the capture knew of (role, calls, compiled functions, graph breaks, notes),\n"
      "every record (module, call, kind, tensor index, side, dtype, shape, bytes, stored bytes,\n"
      "compression ratio) and the graphs. Steps a crash left unfinished are listed as such.\n"
      "\n"
      "Example:\n"
      "  dynaprobe ls dynaprobe_runs/20250101-120000-4242-0");
  sub->add_option("DUMP", cmd.dump, "Run folder, dump folder or step file")
      ->type_name("")
      ->required();
}

// A name from the file, printable on one line (formats::printable_name); valid until the next
// call, so use it once per printf.
const char* printable(const std::string& name) {
  static thread_local std::string buffer;
  buffer = formats::printable_name(name);
  return buffer.c_str();
}

std::string human_bytes(std::uint64_t bytes) {
  char buffer[32];
  if (bytes < 1024) {
    std::snprintf(buffer, sizeof(buffer), "%llu B", static_cast<unsigned long long>(bytes));
  } else if (bytes < (1u << 20)) {
    std::snprintf(buffer, sizeof(buffer), "%.1f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes < (1u << 30)) {
    std::snprintf(buffer, sizeof(buffer), "%.1f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return buffer;
}

int run_ls(const LsCommand& cmd) {
  for (const auto& rank : analyze::find_rank_dumps(cmd.dump)) {
    const auto files = formats::list_dump(rank.path);
    for (const auto& file : files.steps) {
      formats::StepReader reader(file);
      std::printf("%s  (step %lld, format %s)\n", file.c_str(),
                  static_cast<long long>(reader.step()), printable(reader.format_version()));
      for (const auto& [key, value] : reader.provenance()) {
        std::printf("  %-16s %s\n", (formats::printable_name(key) + ":").c_str(), printable(value));
      }
      const auto modules = reader.modules();
      if (!modules.empty()) {
        std::printf("  modules:\n");
        for (const auto& module : modules) {
          std::string attributes;
          for (const auto& [key, value] : module.attributes) {
            attributes += (attributes.empty() ? "" : ", ") + formats::printable_name(key) + "=" +
                          formats::printable_name(value);
          }
          std::printf("    %-40s %s\n", printable(module.module), attributes.c_str());
        }
      }
      std::printf("  %-32s %4s %-11s %5s %-9s %-15s %-20s %10s %10s %6s\n", "module", "call",
                  "kind", "index", "side", "dtype", "shape", "bytes", "stored", "ratio");
      std::uint64_t total = 0, stored = 0;
      for (const auto& record : reader.records()) {
        total += record.nbytes();
        stored += record.stored_bytes;
        std::printf(
            "  %-32s %4u %-11s %5u %-9s %-15s %-20s %10s %10s %6.2f\n",
            printable(record.key.module), record.key.call,
            std::string(formats::kind_name(record.key.kind)).c_str(), record.key.tensor_index,
            std::string(formats::side_name(record.key.side)).c_str(),
            std::string(formats::dtype_name(record.dtype)).c_str(),
            formats::shape_string(record.shape).c_str(), human_bytes(record.nbytes()).c_str(),
            human_bytes(record.stored_bytes).c_str(),
            record.stored_bytes
                ? static_cast<double>(record.nbytes()) / static_cast<double>(record.stored_bytes)
                : 0.0);
      }
      std::printf("  %zu records, %s of tensors stored in %s\n", reader.records().size(),
                  human_bytes(total).c_str(), human_bytes(stored).c_str());
      for (const auto& graph : reader.graphs()) {
        std::printf("  graph %s (%s, %zu bytes)\n", formats::printable_name(graph.name).c_str(),
                    formats::printable_name(graph.kind).c_str(), graph.text.size());
      }
    }
    for (const auto& file : files.unfinished) {
      std::printf("%s  (unfinished: the writer stopped during this step; it is skipped)\n",
                  file.c_str());
    }
    // As compare does: a dump without a committed step is an error, not an empty listing.
    std::fflush(stdout);
    analyze::require_committed_steps(rank.path, files);
  }
  return kExitPass;
}

// ---------------------------------------------------------------------------------------------
struct GraphsCommand {
  std::string dump;
  std::string output;
};

void setup_graphs(CLI::App& app, GraphsCommand& cmd) {
  auto* sub = app.add_subcommand(
      "graphs", "Write the Dynamo and AOTAutograd graphs stored in a dump as .py files");
  sub->fallthrough();
  sub->footer(
      "Files are named as PyTorch names them, one per graph:\n"
      "  __compiled_fn_<n>.Captured_Graph.<hash>.py   what Dynamo traced\n"
      "  __compiled_fn_<n>.Forward_Graph.<hash>.py    AOTAutograd's forward (or inference) graph\n"
      "  __compiled_fn_<n>.Backward_Graph.<hash>.py   AOTAutograd's backward graph\n"
      "A run folder of several ranks gets one folder per rank, OUTPUT/rank<R>/. Every dump stores\n"
      "its graphs, whether or not it was captured with dump_graphs=True.\n"
      "\n"
      "Example:\n"
      "  dynaprobe graphs dynaprobe_runs/20250101-120000-4242-0 -o graphs/");
  sub->add_option("DUMP", cmd.dump, "Run folder, dump folder or step file")
      ->type_name("")
      ->required();
  sub->add_option("-o,--output", cmd.output, "Folder to write the graphs to (created if needed)")
      ->type_name("OUTPUT")
      ->required();
}

// Graph names come from the file: keep them to a safe alphabet so nothing is written outside
// the output folder.
std::string safe_file_name(const std::string& name) {
  std::string safe;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    safe += ok ? c : '_';
  }
  if (safe.empty() || safe.front() == '.') safe = "_" + safe;
  // File names are limited to 255 bytes: a longer name keeps its first 200 characters and gets a
  // hash of the whole name, so different long names stay different files.
  constexpr std::size_t kMaxStem = 200;
  if (safe.size() > kMaxStem) {
    char hash[20];
    std::snprintf(hash, sizeof(hash), ".%016llx",
                  static_cast<unsigned long long>(std::hash<std::string>{}(name)));
    safe = safe.substr(0, kMaxStem) + hash;
  }
  return safe;
}

int run_graphs(const GraphsCommand& cmd) {
  const auto ranks = analyze::find_rank_dumps(cmd.dump);
  std::size_t written = 0;
  for (const auto& rank : ranks) {
    const fs::path folder = ranks.size() > 1
                                ? fs::path(cmd.output) / ("rank" + std::to_string(rank.rank))
                                : fs::path(cmd.output);
    std::map<std::string, std::string> texts;
    const auto files = formats::list_dump(rank.path);
    analyze::require_committed_steps(rank.path, files);
    for (const auto& file : files.steps) {
      formats::StepReader reader(file);
      for (const auto& graph : reader.graphs()) {
        std::string name = safe_file_name(graph.name);
        auto existing = texts.find(name);
        if (existing != texts.end() && existing->second == graph.text) continue;
        if (existing != texts.end()) name += ".step" + std::to_string(reader.step());
        texts[name] = graph.text;
        const fs::path path = folder / (name + ".py");
        write_text_file(path, graph.text);
        std::printf("%s\n", path.c_str());
        ++written;
      }
    }
  }
  if (written == 0) {
    std::fprintf(stderr,
                 "dynaprobe: no graphs in %s (graphs are stored in the step that compiled the "
                 "wrapped modules; eager-only captures and dumps of other tools have none)\n",
                 cmd.dump.c_str());
  }
  return kExitPass;
}

// ---------------------------------------------------------------------------------------------
// Containment. Dumps are untrusted input, and HDF5 1.10 itself can crash (segmentation faults in
// its global heap and variable-length conversions) or loop forever on a damaged or crafted file,
// below anything dynaprobe can check first. So each command runs in a child process, under a
// memory limit (RLIMIT_AS) and a wall-clock limit, while this process only waits: a child that
// dies by a signal or runs past the limit becomes exit code 3 with the name of the file it was
// reading. A child process was chosen over checking files up front (the crashes are inside HDF5's
// own parsing, which cannot be pre-validated) and over threads (a crash takes the whole process).
// It costs one fork (about a millisecond) per command; the report is written by the child.
struct Limits {
  double seconds = 3600;         // 0: no time limit
  std::uint64_t memory_mib = 0;  // 0: the machine's physical memory
  bool isolate = true;
};

// The file the child is reading, in memory shared with this process.
struct SharedFile {
  std::atomic_flag busy = ATOMIC_FLAG_INIT;
  char path[4096];
};
SharedFile* shared_file = nullptr;

void note_open(const fs::path& path) {
  if (!shared_file) return;
  while (shared_file->busy.test_and_set(std::memory_order_acquire)) {
  }
  std::snprintf(shared_file->path, sizeof(shared_file->path), "%s", path.c_str());
  shared_file->busy.clear(std::memory_order_release);
}

std::uint64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), size = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0
             ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(size)
             : 0;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;  // its shadow memory needs a huge address space
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

int run_contained(const Limits& limits, const std::string& what, const std::function<int()>& run) {
  if (!limits.isolate) return run();
  void* memory = ::mmap(nullptr, sizeof(SharedFile), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) return run();
  shared_file = new (memory) SharedFile();
  std::cout.flush();
  std::fflush(nullptr);
  // Forked before any thread exists (TBB and HDF5 start theirs in the child).
  const pid_t child = ::fork();
  if (child < 0) return run();
  if (child == 0) {
    const std::uint64_t bytes = limits.memory_mib ? limits.memory_mib << 20 : physical_memory();
    if (bytes && !kAddressSanitizer) {
      const rlimit limit{static_cast<rlim_t>(bytes), static_cast<rlim_t>(bytes)};
      ::setrlimit(RLIMIT_AS, &limit);
    }
    formats::set_open_observer(note_open);
    const int code = run();
    std::cout.flush();
    std::fflush(nullptr);
    ::_exit(code);  // no atexit handlers: HDF5's could trip over the damage again
  }
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  bool timed_out = false;
  auto pause = std::chrono::microseconds(500);
  for (;;) {
    const pid_t done = ::waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0 && errno != EINTR) {
      std::cerr << "dynaprobe: error: lost the worker process: " << std::strerror(errno) << "\n";
      return kExitIo;
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (limits.seconds > 0 && elapsed > limits.seconds) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
  if (!timed_out && WIFEXITED(status)) return WEXITSTATUS(status);
  const std::string file = shared_file->path[0] ? std::string(shared_file->path) : what;
  std::cout.flush();
  if (timed_out) {
    std::cerr << "dynaprobe: error: " << file << ": reading did not finish within "
              << limits.seconds
              << " s and was stopped (HDF5 loops forever on some damaged files); the file is "
                 "damaged, or raise --time-limit for a very large dump\n";
  } else {
    const int signal = WTERMSIG(status);
    std::cerr << "dynaprobe: error: " << file << ": reading it crashed the reader (signal "
              << signal << ", " << ::strsignal(signal)
              << "); the file is damaged or not a dynaprobe dump"
              << (signal == SIGKILL || signal == SIGABRT
                      ? " (or it needed more memory than --memory-limit allows)"
                      : "")
              << "\n";
  }
  return kExitIo;
}

void add_limit_options(CLI::App& app, Limits& limits) {
  app.add_option("--time-limit", limits.seconds,
                 "Stop reading after this many seconds and exit 3 (default 3600; 0: none)")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--memory-limit", limits.memory_mib,
                 "Address-space limit of the reading process in MiB, exit 3 past it (default: "
                 "the machine's memory)")
      ->type_name("MIB");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "dynaprobe: find where torch.compile changes a PyTorch model's numbers.\n"
      "Analyses the dumps dynaprobe.PrecisionChecker writes: compares their eager and compiled\n"
      "sides module by module, lists them, extracts their graphs. No PyTorch needed.",
      "dynaprobe");
  app.footer(
      "Run 'dynaprobe COMMAND --help' for a command's options and examples; docs/cli.md has\n"
      "the full reference.\n"
      "\n"
      "Exit codes: 0 all pass, 1 differences found (compare: a FAIL or WARN row, or the loss),\n"
      "2 usage error, 3 I/O or format error (missing, unreadable or corrupt dump).");
  app.require_subcommand(1);
  Limits limits;
  add_limit_options(app, limits);
  CompareCommand compare;
  LsCommand ls;
  GraphsCommand graphs;
  setup_compare(app, compare);
  setup_ls(app, ls);
  setup_graphs(app, graphs);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }
  const auto run = [&]() -> int {
    try {
      if (app.got_subcommand("compare")) return run_compare(compare);
      if (app.got_subcommand("ls")) return run_ls(ls);
      return run_graphs(graphs);
    } catch (const dynaprobe::UsageError& e) {
      std::cerr << "dynaprobe: error: " << e.what() << "\n";
      return kExitUsage;
    } catch (const dynaprobe::Error& e) {
      std::cerr << "dynaprobe: error: " << e.what() << "\n";
      return kExitIo;
    } catch (const std::bad_alloc&) {
      std::cerr << "dynaprobe: error: out of memory while reading "
                << (shared_file && shared_file->path[0] ? shared_file->path : "the dump")
                << " (the file is damaged, or raise --memory-limit)\n";
      return kExitIo;
    } catch (const std::exception& e) {
      std::cerr << "dynaprobe: error: " << e.what() << "\n";
      return kExitIo;
    }
  };
  const std::string dumps =
      app.got_subcommand("compare")
          ? compare.dump + (compare.dump2.empty() ? "" : " or " + compare.dump2)
      : app.got_subcommand("ls") ? ls.dump
                                 : graphs.dump;
  // DYNAPROBE_NO_ISOLATION=1 runs in this process, e.g. under a debugger.
  const char* no_isolation = std::getenv("DYNAPROBE_NO_ISOLATION");
  limits.isolate = !(no_isolation && std::string(no_isolation) == "1");
  return run_contained(limits, dumps, run);
}

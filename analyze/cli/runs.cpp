// dynaprobe runs: the runs of a folder of runs, newest first, and the pruning of old ones
// (docs/cli.md#dynaprobe-runs).
#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>

#include "cli.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/number_text.h"
#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/run_folders.h"
#include "dynaprobe/formats/dump_lock.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::cli {
namespace fs = std::filesystem;

namespace {

namespace vocabulary = formats::vocabulary;

std::string local_time(fs::file_time_type time) {
  const std::time_t seconds =
      std::chrono::system_clock::to_time_t(std::chrono::file_clock::to_sys(time));
  std::tm parts{};
  localtime_r(&seconds, &parts);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &parts);
  return text;
}

std::uint64_t folder_bytes(const fs::path& folder) {
  std::uint64_t total = 0;
  std::error_code error;
  for (const auto& entry : fs::recursive_directory_iterator(folder, error)) {
    if (entry.is_regular_file(error)) total += entry.file_size(error);
  }
  return total;
}

// One run: its ranks, committed steps and verdict (ALL PASS, FAILED, one side only for a
// capture(side=...) dump, or why it cannot be read).
struct RunSummary {
  std::size_t ranks = 0;
  std::size_t steps = 0;
  std::string verdict;
};

RunSummary summarize(const fs::path& run) {
  RunSummary summary;
  bool all_pass = true;
  try {
    for (const auto& rank : analyze::find_rank_dumps(run)) {
      ++summary.ranks;
      const auto files = formats::list_dump(rank.path);
      summary.steps += files.steps.size();
      if (files.steps.empty()) continue;
      const auto provenance = formats::StepReader(files.steps.front()).provenance();
      const auto mode = provenance.find(std::string(vocabulary::provenance::kMode));
      if (mode != provenance.end() && (mode->second == vocabulary::mode::kEagerOnly ||
                                       mode->second == vocabulary::mode::kCompiledOnly)) {
        summary.verdict = "one side (" + mode->second + ")";
        return summary;
      }
      all_pass = all_pass && analyze::compare(rank.path, rank.path, {}).all_pass();
    }
    summary.verdict =
        summary.steps == 0 ? "no committed step" : std::string(analyze::verdict_text(all_pass));
  } catch (const std::exception& error) {
    summary.verdict = std::string("unreadable: ") + error.what();
  }
  return summary;
}

// Removes a run unless a process is writing one of its dumps (it holds the dump's lock): then
// returns why it was kept.
std::string remove_run(const fs::path& run) {
  std::vector<std::unique_ptr<formats::DumpLock>> locks;
  try {
    for (const auto& rank : analyze::find_rank_dumps(run)) {
      locks.push_back(std::make_unique<formats::DumpLock>(rank.path, "dynaprobe runs --keep"));
    }
  } catch (const formats::DumpBusyError& busy) {
    return std::string("kept: being written (") + busy.what() + ")";
  }
  fs::remove_all(run);
  return "";
}

}  // namespace

void setup_runs(CLI::App& app, Command& selected) {
  auto options = std::make_shared<RunsOptions>();
  auto* sub = app.add_subcommand(
      "runs", "List the runs of a folder of runs, newest first; --keep N removes older ones");
  sub->fallthrough();
  sub->footer(
      "PrecisionChecker writes one run per process under dynaprobe_runs/ (<time>-<pid>-<n>/).\n"
      "Each line: the run, when it was last written, its ranks, committed steps, size and\n"
      "verdict (ALL PASS, FAILED, or one side only for capture() dumps).\n"
      "\n"
      "Examples:\n"
      "  dynaprobe runs dynaprobe_runs\n"
      "  dynaprobe runs dynaprobe_runs --keep 3     remove all but the newest 3 runs");
  sub->add_option("FOLDER", options->folder, "Folder of runs (default: dynaprobe_runs)")
      ->type_name("");
  sub->add_option("--keep", options->keep,
                  "Remove every run but the newest N (only folders holding dumps are removed)")
      ->type_name("N");
  sub->final_callback([options, &selected] {
    if (options->folder.empty()) options->folder = formats::schema::kRunsDir;
    selected = {options->folder, [options] { return run_runs(*options); }};
  });
}

int run_runs(const RunsOptions& cmd) {
  const analyze::NewestRun all = analyze::newest_run(cmd.folder);
  if (all.runs.empty()) {
    throw UsageError(
        cmd.folder +
        ": no runs in it (folders holding rank<R>/ folders or step files): give the folder "
        "PrecisionChecker writes its runs to, e.g. dynaprobe runs dynaprobe_runs");
  }
  std::printf("%-40s %-19s %5s %6s %10s  %s\n", "run", "written", "ranks", "steps", "size",
              "verdict");
  std::uint64_t removed_bytes = 0;
  std::size_t removed = 0;
  for (std::size_t i = 0; i < all.runs.size(); ++i) {
    const fs::path& run = all.runs[i];
    const std::uint64_t bytes = folder_bytes(run);
    if (cmd.keep && i >= *cmd.keep) {
      const std::string kept = remove_run(run);
      if (kept.empty()) {
        removed_bytes += bytes;
        ++removed;
      }
      std::printf("%-40s %s\n", printable(run.filename().string()),
                  (kept.empty() ? "removed (" + analyze::format_bytes(bytes) + ")" : kept).c_str());
      continue;
    }
    const RunSummary summary = summarize(run);
    std::printf("%-40s %-19s %5zu %6zu %10s  %s\n", printable(run.filename().string()),
                local_time(analyze::last_written(run)).c_str(), summary.ranks, summary.steps,
                analyze::format_bytes(bytes).c_str(), summary.verdict.c_str());
  }
  if (removed > 0) {
    std::printf("removed %zu run(s), %s\n", removed, analyze::format_bytes(removed_bytes).c_str());
  }
  return kExitPass;
}

}  // namespace dynaprobe::cli

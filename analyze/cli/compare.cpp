// dynaprobe compare: compares the eager and the compiled side of dumps and prints the report
// (docs/cli.md#dynaprobe-compare, docs/report-format.md).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "cli.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/root_cause.h"
#include "dynaprobe/formats/error.h"

namespace dynaprobe::cli {
namespace fs = std::filesystem;

namespace {

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

// After the reports of several steps (or ranks), one line that says which failed and why, so a
// long run's verdict does not have to be found by scrolling: "Summary: 3 steps, 2 ALL PASS,
// 1 FAILED: step 1 (2 FAIL, 0 WARN)". Empty for a single step, whose RESULT line says it all.
std::string render_summary(const std::vector<analyze::RankComparison>& results) {
  std::size_t steps = 0, passed = 0;
  std::vector<std::string> failed;
  const bool many_ranks = results.size() > 1;
  for (const auto& result : results) {
    for (const auto& step : result.comparison.steps) {
      ++steps;
      if (step.all_pass()) {
        ++passed;
        continue;
      }
      const analyze::StepCounts counts = step.counts();
      std::string why = std::to_string(counts.fail) + " FAIL, " + std::to_string(counts.warn) +
                        " WARN" + (counts.loss_failed ? ", loss FAIL" : "") +
                        (counts.nothing_compared() ? ", nothing compared" : "");
      failed.push_back((many_ranks ? "rank " + std::to_string(result.rank) + " " : "") + "step " +
                       std::to_string(step.step) + " (" + why + ")");
    }
  }
  if (steps < 2) return "";
  // Where the differences first appear, across ranks and steps: the root cause of the first
  // failing step (rank by rank, step by step).
  std::string first_cause;
  for (const auto& result : results) {
    for (const auto& step : result.comparison.steps) {
      if (!first_cause.empty() || step.root_cause.empty()) continue;
      const analyze::Finding& finding =
          step.root_cause.forward ? *step.root_cause.forward : *step.root_cause.backward;
      first_cause = "Root cause first seen in " +
                    (many_ranks ? "rank " + std::to_string(result.rank) + " " : std::string()) +
                    "step " + std::to_string(step.step) + ": " +
                    (step.root_cause.forward ? "forward " : "backward ") +
                    analyze::describe_finding(step, finding) + "\n";
    }
  }
  std::string out =
      "Summary: " + std::to_string(steps) + " steps, " + std::to_string(passed) + " ALL PASS";
  if (!failed.empty()) {
    constexpr std::size_t kListed = 10;
    out += ", " + std::to_string(failed.size()) + " FAILED: ";
    for (std::size_t i = 0; i < std::min(failed.size(), kListed); ++i) {
      out += (i ? ", " : "") + failed[i];
    }
    if (failed.size() > kListed) {
      out += ", and " + std::to_string(failed.size() - kListed) + " more (--json has them all)";
    }
  }
  return out + "\n" + first_cause;
}

// "layers.*.mlp=1e-3,1e-2" -> a rule; a usage error naming the option otherwise.
analyze::ToleranceRule parse_tolerance_rule(const std::string& text) {
  const std::size_t equals = text.rfind('=');
  const std::size_t comma = text.rfind(',');
  analyze::ToleranceRule rule;
  if (equals != std::string::npos && equals > 0 && comma != std::string::npos && comma > equals) {
    rule.pattern = text.substr(0, equals);
    char* end = nullptr;
    const std::string atol = text.substr(equals + 1, comma - equals - 1);
    const std::string rtol = text.substr(comma + 1);
    rule.tolerances.atol = std::strtod(atol.c_str(), &end);
    const bool atol_ok = !atol.empty() && *end == '\0';
    rule.tolerances.rtol = std::strtod(rtol.c_str(), &end);
    const bool rtol_ok = !rtol.empty() && *end == '\0';
    if (atol_ok && rtol_ok && std::isfinite(rule.tolerances.atol) &&
        std::isfinite(rule.tolerances.rtol) && rule.tolerances.atol >= 0 &&
        rule.tolerances.rtol >= 0) {
      return rule;
    }
  }
  throw UsageError(
      "--tolerance expects PATTERN=ATOL,RTOL with finite tolerances >= 0 (e.g. "
      "'layers.*.mlp=1e-3,1e-2' or 'grad_*=1e-3,1e-2'), but received '" +
      text + "'");
}

}  // namespace

void setup_compare(CLI::App& app, Command& selected) {
  auto options = std::make_shared<CompareOptions>();
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
      "  dynaprobe compare RUN --html report.html\n"
      "\n"
      "Exit codes: 0 all pass, 1 not all pass (a FAIL or WARN row, or the loss check failed),\n"
      "2 usage error, 3 I/O or format error.");
  sub->add_option("DUMP", options->dump,
                  "Run folder, dump folder or step file: both sides, or the eager "
                  "side when DUMP2 is given")
      ->type_name("")
      ->required();
  sub->add_option("DUMP2", options->dump2, "The compiled side, captured separately")->type_name("");
  sub->add_option("--csv", options->csv,
                  "Also write the 9-column CSV report to PATH (a run folder of several ranks: one "
                  "file per rank, PATH_rank<R>.csv)")
      ->type_name("PATH");
  // --merged-csv, --json, --html, ...: one option per registered report format.
  for (const analyze::ReportFormat& format : analyze::report_formats()) {
    sub->add_option("--" + std::string(format.name), options->reports[std::string(format.name)],
                    std::string(format.description))
        ->type_name("PATH");
  }
  sub->add_option("--atol", options->atol,
                  "Absolute tolerance (default: the one the dump was captured with, else 1e-4)")
      ->type_name("X")
      ->check(non_negative("1e-4"));
  sub->add_option("--rtol", options->rtol,
                  "Relative tolerance (default: the one the dump was captured with, else 1e-3)")
      ->type_name("X")
      ->check(non_negative("1e-3"));
  sub->add_option("--tolerance", options->tolerance_rules,
                  "Tolerances for the rows PATTERN matches (shell-style, against the module, the "
                  "check type or <module>.<check type>), after the dump's own rules; the last "
                  "match wins. Repeatable")
      ->type_name("PATTERN=ATOL,RTOL");
  sub->add_flag("--fixed-tolerances", options->fixed_tolerances,
                "Judge bf16/fp16/fp8 rows with the tolerances as they are, without their "
                "dtype's floor (bf16: atol 1e-2, rtol 1.6e-2)");
  sub->add_option("--verdict", options->verdict,
                  "What decides a row that has a reference verdict: 'reference' (noise passes, "
                  "divergence fails) or 'tolerances' (the spec's tolerance check alone; the "
                  "verdict is still shown). Default: the capture's choice (PrecisionChecker("
                  "verdict=...), 'reference')")
      ->check(CLI::IsMember({"reference", "tolerances"}));
  sub->add_flag("--recompute", options->recompute,
                "Compute every pair's metrics from its stored tensors, also where the capture "
                "stored the metrics it computed in memory (checks them; slower). Pairs whose "
                "tensors were not stored (dump='failing' or 'stats') keep their stored metrics");
  sub->add_option("--step", options->step, "Compare only step N (default: every step)")
      ->type_name("N")
      ->check(non_negative("3", /*integer=*/true));
  sub->add_option("--module", options->module,
                  "Compare only modules whose name matches GLOB (shell-style, e.g. 'layers.*')")
      ->type_name("GLOB");
  sub->add_option("--threads", options->threads, "Threads to compare with (default, 0: all cores)")
      ->type_name("N")
      ->check(non_negative("4", /*integer=*/true));
  sub->final_callback([options, &selected] {
    selected = {options->dump + (options->dump2.empty() ? "" : " or " + options->dump2),
                [options] { return run_compare(*options); }};
  });
}

int run_compare(const CompareOptions& cmd) {
  analyze::CompareOptions options;
  options.atol = cmd.atol;
  options.rtol = cmd.rtol;
  for (const std::string& text : cmd.tolerance_rules) {
    options.tolerance_rules.push_back(parse_tolerance_rule(text));
  }
  if (cmd.fixed_tolerances) options.dtype_aware = false;
  if (!cmd.verdict.empty()) options.reference_decides = cmd.verdict == "reference";
  options.recompute = cmd.recompute;
  options.step = cmd.step;
  options.module_glob = cmd.module;
  options.threads = cmd.threads;
  options.progress = progress_bar();

  const auto eager_ranks = analyze::find_rank_dumps(chosen_dump("compare", cmd.dump));
  auto compiled_ranks = eager_ranks;
  if (!cmd.dump2.empty()) {
    compiled_ranks = analyze::find_rank_dumps(chosen_dump("compare", cmd.dump2));
    if (compiled_ranks.size() != eager_ranks.size()) {
      throw UsageError(cmd.dump + " has " + std::to_string(eager_ranks.size()) + " rank(s) but " +
                       cmd.dump2 + " has " + std::to_string(compiled_ranks.size()) +
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
    auto scenario = provenance.find(std::string(formats::vocabulary::provenance::kScenario));
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
  std::cout << render_summary(results);
  bool graphs_read = false;
  for (const analyze::ReportFormat& format : analyze::report_formats()) {
    const auto path = cmd.reports.find(std::string(format.name));
    if (path == cmd.reports.end() || path->second.empty()) continue;
    if (format.needs_graphs && !graphs_read) {
      for (std::size_t i = 0; i < results.size(); ++i) {
        results[i].graphs = analyze::read_graphs(compiled_ranks[i].path);
      }
      graphs_read = true;
    }
    write_text_file(path->second, format.render(results));
    std::cout << format.title << " report saved to: " << path->second << "\n";
  }
  const bool all_pass = std::all_of(results.begin(), results.end(),
                                    [](const auto& r) { return r.comparison.all_pass(); });
  return all_pass ? kExitPass : kExitMismatch;
}

}  // namespace dynaprobe::cli

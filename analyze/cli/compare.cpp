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
#include "dynaprobe/analyze/run.h"
#include "dynaprobe/formats/error.h"

namespace dynaprobe::cli {
namespace fs = std::filesystem;

namespace {

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

// --steps and --ranks: a list of indices (analyze::IndexSet).
CLI::Validator index_list() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          analyze::IndexSet::parse(text, "");
          return {};
        } catch (const UsageError&) {
          return "expected " + std::string(analyze::IndexSet::kExpected) + ", but received '" +
                 formats::printable_name(text) + "'";
        }
      },
      "LIST", "index list");
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
  add_report_options(*sub, *options);
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
  sub->add_option("--steps,--step", options->steps,
                  "Compare only these steps: N, N-M or a list of them, e.g. '3' or '0-3,8' "
                  "(default: every step)")
      ->type_name("LIST")
      ->check(index_list());
  sub->add_option("--ranks", options->ranks,
                  "Compare only these ranks of a run folder: N, N-M or a list of them, e.g. "
                  "'0-3' (default: every rank). Reports of parts of a run merge with "
                  "dynaprobe merge")
      ->type_name("LIST")
      ->check(index_list());

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
  analyze::RunOptions run;
  analyze::CompareOptions& options = run.compare;
  options.atol = cmd.atol;
  options.rtol = cmd.rtol;
  for (const std::string& text : cmd.tolerance_rules) {
    options.tolerance_rules.push_back(parse_tolerance_rule(text));
  }
  if (cmd.fixed_tolerances) options.dtype_aware = false;
  if (!cmd.verdict.empty()) options.reference_decides = cmd.verdict == "reference";
  options.recompute = cmd.recompute;
  options.module_glob = cmd.module;
  options.threads = cmd.threads;
  options.progress = progress_bar();
  if (!cmd.steps.empty()) run.steps = analyze::IndexSet::parse(cmd.steps, "--steps");
  if (!cmd.ranks.empty()) run.ranks = analyze::IndexSet::parse(cmd.ranks, "--ranks");
  run.warn = [](const std::string& warning) {
    std::cerr << "dynaprobe: warning: " << warning << "\n";
  };
  const std::string eager = chosen_dump("compare", cmd.dump);
  const std::string compiled = cmd.dump2.empty() ? eager : chosen_dump("compare", cmd.dump2);
  const analyze::RunPlan plan = analyze::plan_run(eager, compiled, run);
  return write_reports(plan.shape, cmd,
                       [&](const std::vector<analyze::ReportWriter*>& writers, bool read_graphs) {
                         run.read_graphs = read_graphs;
                         return analyze::analyze_run(plan, run, writers);
                       });
}

void add_report_options(CLI::App& sub, ReportOptions& options) {
  sub.add_option("--csv", options.csv,
                 "Also write the 9-column CSV report to PATH (a run folder of several ranks: one "
                 "file per rank, PATH_rank<R>.csv)")
      ->type_name("PATH");
  // --merged-csv, --json, --html, ...: one option per registered report format.
  for (const analyze::ReportFormat& format : analyze::report_formats()) {
    sub.add_option("--" + std::string(format.name), options.reports[std::string(format.name)],
                   std::string(format.description))
        ->type_name("PATH");
  }
  sub.add_flag("--all-steps", options.all_steps,
               "After the summary of a run of several steps or ranks, print every step's full "
               "report (default: the first 3 failing steps')");
  sub.add_flag("--failing", options.failing,
               "Each stdout report shows its FAIL and WARN rows alone (the RESULT line and the "
               "root cause are the whole step's; the file reports keep every row)");
}

int write_reports(const analyze::RunShape& shape, const ReportOptions& cmd,
                  const std::function<analyze::RunTotals(const std::vector<analyze::ReportWriter*>&,
                                                         bool read_graphs)>& run) {
  std::vector<std::unique_ptr<OutputFile>> files;
  std::vector<std::unique_ptr<analyze::ReportWriter>> writers;
  std::vector<std::string> saved;  // "JSON report saved to: PATH"
  bool read_graphs = false;
  analyze::TextOptions text;
  text.every_step = cmd.all_steps;
  text.only_failing = cmd.failing;
  for (const analyze::ReportFormat& format : analyze::report_formats()) {
    const auto path = cmd.reports.find(std::string(format.name));
    if (path == cmd.reports.end() || path->second.empty()) continue;
    files.push_back(std::make_unique<OutputFile>(path->second));
    writers.push_back(format.open(files.back()->stream(), shape));
    read_graphs = read_graphs || format.needs_graphs;
    saved.push_back(std::string(format.title) + " report saved to: " + path->second);
    text.full_reports +=
        (text.full_reports.empty() ? "" : ", ") + std::string(format.title) + " " + path->second;
  }
  std::vector<std::string> csv_saved;
  if (!cmd.csv.empty()) {
    writers.push_back(analyze::open_rank_csvs(
        cmd.csv, shape, [&](const std::filesystem::path& path, const std::string& csv) {
          write_text_file(path, csv);
          csv_saved.push_back("CSV report saved to: " + path.string());
        }));
  }
  if (text.full_reports.empty()) {
    text.full_reports = "--html PATH, --json PATH or --junit PATH write every rank and step";
  }
  writers.insert(writers.begin(), analyze::open_text_report(std::cout, shape, text));
  std::vector<analyze::ReportWriter*> pointers;
  for (const auto& writer : writers) pointers.push_back(writer.get());
  const analyze::RunTotals totals = run(pointers, read_graphs);
  for (const auto& file : files) file->close();
  for (const std::string& line : csv_saved) std::cout << line << "\n";
  for (const std::string& line : saved) std::cout << line << "\n";
  return totals.all_pass ? kExitPass : kExitMismatch;
}

}  // namespace dynaprobe::cli

// dynaprobe merge: partial JSON reports of one run (compare --ranks/--steps --json, on one machine
// or many) joined into the report of the whole, in every format (docs/cli.md#dynaprobe-merge).
#include <fstream>
#include <memory>
#include <sstream>

#include "cli.h"
#include "dynaprobe/analyze/run.h"
#include "dynaprobe/formats/error.h"

namespace dynaprobe::cli {

void setup_merge(CLI::App& app, Command& selected) {
  auto options = std::make_shared<MergeOptions>();
  auto* sub = app.add_subcommand(
      "merge", "Join partial JSON reports of one run into the report of the whole run");
  sub->fallthrough();
  sub->footer(
      "Each REPORT is the --json report of part of a run: dynaprobe compare RUN --ranks ... or\n"
      "--steps ... --json PART.json, or a shard of Python's analyze_run(executor=...). The\n"
      "merged report, on stdout and in every file asked for, is the one dynaprobe compare RUN\n"
      "writes for the whole run. A step of a rank may be in one report only.\n"
      "\n"
      "Examples:\n"
      "  dynaprobe compare RUN --ranks 0-3 --json part0.json\n"
      "  dynaprobe compare RUN --ranks 4-7 --json part1.json\n"
      "  dynaprobe merge part0.json part1.json --html report.html --junit junit.xml\n"
      "\n"
      "Exit codes: 0 all pass, 1 not all pass, 2 usage error, 3 a report that cannot be read.");
  sub->add_option("REPORT", options->reports_in, "JSON reports of parts of one run")
      ->type_name("")
      ->required();
  add_report_options(*sub, *options);
  sub->final_callback([options, &selected] {
    std::string reads;
    for (const std::string& path : options->reports_in) reads += (reads.empty() ? "" : ", ") + path;
    selected = {reads, [options] { return run_merge(*options); }};
  });
}

int run_merge(const MergeOptions& cmd) {
  std::vector<analyze::JsonReport> reports;
  for (const std::string& path : cmd.reports_in) {
    std::ifstream file(path, std::ios::binary);
    if (!file) throw IoError("cannot read " + path + ": no such file, or not readable");
    std::ostringstream text;
    text << file.rdbuf();
    reports.push_back({path, std::move(text).str()});
  }
  std::vector<analyze::RankComparison> ranks = analyze::read_json_reports(reports);
  return write_reports(analyze::RunShape::of(ranks), cmd,
                       [&](const std::vector<analyze::ReportWriter*>& writers, bool read_graphs) {
                         // The graphs are not in the JSON: from the compiled dumps, where they
                         // are still there to read (a shared file system).
                         for (analyze::RankComparison& rank : ranks) {
                           std::error_code gone;
                           if (read_graphs && std::filesystem::exists(rank.compiled_path, gone)) {
                             rank.graphs = analyze::read_graphs(rank.compiled_path);
                           }
                         }
                         return analyze::write_run(ranks, writers);
                       });
}

}  // namespace dynaprobe::cli

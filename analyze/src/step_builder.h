// Builds one step's report (compare() runs it for each step): its header, then, for the wanted
// modules in model order, a row per module note and per tensor key, and the metric tasks of the
// rows both sides hold (metric_tasks.h: run_tasks computes them later and sets those rows'
// statuses). The phases it runs are in step_rows.h. Private to analyze.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dynaprobe/analyze/compare_options.h"
#include "dynaprobe/analyze/comparison.h"
#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/formats/reader.h"
#include "metric_tasks.h"
#include "step_rows.h"

namespace dynaprobe::analyze {

// Whether a module filter (CompareOptions::module_glob, shell-style) selects `module`.
bool module_matches(const std::string& glob, const std::string& module);

class StepBuilder {
 public:
  // `options` must outlive the builder. `eager_side`: the side the eager dump's records are read
  // as, kCompiled for a baseline (Comparison::compiled_baseline).
  StepBuilder(const CompareOptions& options, Judging judging, formats::Side eager_side)
      : options_(options), judging_(std::move(judging)), eager_side_(eager_side) {}

  // The report of `step` from the readers of its two sides (either may be null, not both), with
  // the metric tasks of its rows appended to `tasks_out`; their `report` is left null, for the
  // caller to set once the report has its place.
  StepReport build(std::int64_t step, const formats::StepReader* eager,
                   const formats::StepReader* compiled, std::vector<Task>& tasks_out);

 private:
  // What the rows of one step are built from.
  struct StepRecords {
    const formats::StepReader* eager;
    const formats::StepReader* compiled;
    const ModuleAttributes& modules;
    const Pairs& pairs;
    const CallsRun& calls;
    const ModuleRoles& roles;
  };

  bool wanted(const std::string& module) const {
    return options_.module_glob.empty() || module_matches(options_.module_glob, module);
  }
  StepReport report_header(std::int64_t step, const formats::StepReader* eager,
                           const formats::StepReader* compiled) const;
  void add_module_rows(const std::string& module, const StepRecords& records, StepReport& report,
                       std::vector<Task>& tasks) const;
  void add_tensor_row(const TensorKey& key, Pair pair, const StepRecords& records,
                      StepReport& report, std::vector<Task>& tasks) const;
  void add_tasks(const Pair& pair, const StepRecords& records, const StepReport& report, Row& row,
                 std::vector<Task>& tasks) const;

  const CompareOptions& options_;
  Judging judging_;
  formats::Side eager_side_;
};

}  // namespace dynaprobe::analyze

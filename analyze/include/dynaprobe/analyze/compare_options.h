// What a comparison is asked to do: tolerances that replace the dump's, which step and modules,
// how many threads, whether to recompute stored metrics, progress. compare() (engine.h) and the
// engine's phases (step_builder.h, metric_tasks.h, ops_dumps.h) take it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dynaprobe/analyze/judging.h"

namespace dynaprobe::analyze {

struct CompareOptions {
  // Each tolerance not given is the dump's own (its atol/rtol provenance), else 1e-4 / 1e-3.
  std::optional<double> atol;
  std::optional<double> rtol;
  // Per-pattern tolerances, after the dump's own (its tolerance_rules provenance): they win.
  std::vector<ToleranceRule> tolerance_rules;
  // The dtype-aware floor: the dump's choice (dtype_aware_tolerances provenance, default on)
  // unless given.
  std::optional<bool> dtype_aware;
  // Whether a row's reference verdict decides its status: the dump's choice (verdict provenance,
  // default "reference") unless given; false keeps the tolerance-only status of the spec.
  std::optional<bool> reference_decides;
  std::optional<std::int64_t> step;  // only this step
  std::string module_glob;           // only modules matching (fnmatch), empty: all
  // A module_glob that matches no module of the dumps is a UsageError; false for a caller that
  // compares a run a step at a time and checks the whole run (analyze_run).
  bool require_module_match = true;
  int threads = 0;  // 0: all cores
  // Recompute every pair from its stored tensors, also where the capture stored its metrics
  // (PrecisionChecker judges rows in memory): checks those against the tensors. Pairs whose
  // tensors were not stored keep their stored metrics.
  bool recompute = false;
  // Read the op localisations of each step (<dump>/ops/*.step<S>/, dynaprobe bisect --ops) into
  // StepReport::ops; an ops dump that cannot be read is reported there, never thrown.
  bool read_ops = true;
  // Called now and then with uncompressed bytes compared so far and in total.
  std::function<void(std::uint64_t done, std::uint64_t total)> progress;
};

}  // namespace dynaprobe::analyze

// The metric tasks of a comparison: each compared pair of a step's rows, and each side against the
// fp64 reference, is a task the StepBuilder (step_builder.h) leaves; run_tasks computes them all
// at once, in parallel, and sets the rows' metrics and statuses. Private to analyze.
#pragma once

#include <cstddef>
#include <vector>

#include "dynaprobe/analyze/compare_options.h"
#include "dynaprobe/analyze/comparison.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::analyze {

// Which metrics of a row a task computes: the row's own (eager vs compiled, which decide its
// status), or a side against the fp64 reference.
enum class Target { kRow, kReferenceEager, kReferenceCompiled };

// A comparison still to be computed: a (first) vs b (second), as the metrics define them.
struct Task {
  StepReport* report;  // set once the step's report has its place in the Comparison
  std::size_t row;     // index into report->rows
  const formats::StepReader* eager_reader;
  const formats::RecordInfo* eager;
  const formats::StepReader* compiled_reader;
  const formats::RecordInfo* compiled;
  Target target = Target::kRow;
  Tolerances tolerances;
};

// Sets each task's metrics on its row, and a kRow task's status and reason: from the metrics the
// capture stored for the pair where they hold for the task's tolerances (unless
// options.recompute and the tensors are stored), else from the stored tensors, small pairs in one
// pipeline and large ones chunk pair by chunk pair, on options.threads threads, reporting
// progress to options.progress. Throws UsageError when a row must be judged again but the capture
// did not store its tensors. A row whose step file was not written is a WARN, and its report says
// why (StepReport::not_stored).
void run_tasks(std::vector<Task>& tasks, const CompareOptions& options);

}  // namespace dynaprobe::analyze

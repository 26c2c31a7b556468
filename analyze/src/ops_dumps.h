// The op localisations beside a dump (dynaprobe bisect --ops): private to analyze/src, called by
// the engine once a comparison's steps are judged.
#pragma once

#include <filesystem>
#include <functional>
#include <vector>

#include "dynaprobe/analyze/compare_options.h"
#include "dynaprobe/analyze/comparison.h"

namespace dynaprobe::analyze::detail {

// How the engine compares one ops dump with itself (compare(dump, dump, options)), handed in so
// that this layer sits below the engine that calls it.
using CompareDump =
    std::function<Comparison(const std::filesystem::path& dump, const CompareOptions& options)>;

// Fills StepReport::ops of `steps` from the ops dumps of their step in the folder of each of
// `dumps` (a dump folder or a step file; <folder>/ops/<module>.call<C>.step<S>/), each compared by
// `compare_dump` with its own tolerances on `options.threads`. Ops dumps of modules that
// options.module_glob does not match are left out. An ops dump that cannot be read is an OpsDump
// with its error, never an exception: it must not take the main report with it.
void attach_ops_dumps(std::vector<StepReport>& steps,
                      const std::vector<std::filesystem::path>& dumps,
                      const CompareOptions& options, const CompareDump& compare_dump);

// The ops dump of a call as one OpsGraph per aten graph, from its comparison (rows whose module
// is "<graph>.<node>", module attributes op, graph and source).
std::vector<OpsGraph> ops_graphs(const StepReport& report);

}  // namespace dynaprobe::analyze::detail

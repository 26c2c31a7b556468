// The comparison engine: aligns the records of an eager and a compiled side by (step, module, call,
// kind, tensor index) and computes the spec's metrics, in parallel over records and over chunks of
// large tensors, streaming chunk pairs from the dump reader (memory O(threads x chunk)).
// The CLI and the Python API both use it, so their results cannot differ. What it is asked is
// compare_options.h's CompareOptions; what it returns, comparison.h's Comparison.
#pragma once

#include <filesystem>
#include <string>

#include "dynaprobe/analyze/compare_options.h"
#include "dynaprobe/analyze/comparison.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::analyze {

// Compares the eager side of `eager_dump` with the compiled side of `compiled_dump` (the same path
// for a single-pass dump holding both). A dump is a rank folder of step files or one step file.
// Throws IoError / FormatError for unreadable or invalid dumps (also a dump without a committed
// step, or whose atol/rtol provenance is not a finite number >= 0); mismatches are results.
// Throws UsageError when options.module_glob matches no module of any step (a typo must not read
// as an empty pass), options.step is in neither dump, a tolerance is NaN, infinite or negative,
// or two dumps hold the other sides than they are given as (provenance mode, records).
Comparison compare(const std::filesystem::path& eager_dump,
                   const std::filesystem::path& compiled_dump, const CompareOptions& options);

// compare() of dumps already listed (formats::list_dump of each path; `same`: one dump holds both
// sides and `compiled_files` is unused). A run compared step by step lists each rank folder once,
// not once per step.
Comparison compare_listed(const std::filesystem::path& eager_dump,
                          const formats::DumpFiles& eager_files,
                          const std::filesystem::path& compiled_dump,
                          const formats::DumpFiles& compiled_files, bool same,
                          const CompareOptions& options);

// The comparison of a step the capture is still committing (formats::PendingStep; one dump with
// both sides), the same report as compare() of its dump once committed with options.step the
// step's. Reads the file (waiting for the commit) only for pairs without metrics judged in
// memory.
Comparison compare_pending(formats::PendingStep pending, const CompareOptions& options);

// Throws the UsageError compare() throws when `glob` (CompareOptions::module_glob) matches no
// module of the dumps' steps, naming the modules they have; reads every step file's index.
void check_module_glob(const std::filesystem::path& eager_dump,
                       const std::filesystem::path& compiled_dump, const std::string& glob);

// Throws FormatError unless `files` (formats::list_dump of `path`) holds a committed step: an
// empty folder and one holding only unfinished (.partial) steps are errors for every command.
void require_committed_steps(const std::filesystem::path& path, const formats::DumpFiles& files);

}  // namespace dynaprobe::analyze

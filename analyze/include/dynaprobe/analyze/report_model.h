// The report model: the engine's result described once, as a tree of named values. The JSON
// report, Python's row dicts (dynaprobe._C) and the HTML report all serialise this one tree, so
// their fields are the same by construction (docs/report-format.md#one-report-model). The text
// report and the CSV are the spec's fixed layouts and render the engine's structs directly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "dynaprobe/analyze/comparison.h"

namespace dynaprobe::analyze {

// A JSON-like value: null, bool, integer, number, string, array or object (keys in insertion
// order). Strings hold the dump's bytes as they are; each renderer makes them safe for its format
// (JSON and HTML escape them with formats::printable_name).
class Value {
 public:
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;  // null
  Value(std::nullptr_t) {}
  Value(bool value) : data_(value) {}
  Value(int value) : data_(static_cast<std::int64_t>(value)) {}
  Value(std::int64_t value) : data_(value) {}
  Value(std::uint32_t value) : data_(static_cast<std::int64_t>(value)) {}
  Value(std::uint64_t value) : data_(static_cast<std::int64_t>(value)) {}
  Value(double value) : data_(value) {}
  Value(std::string value) : data_(std::move(value)) {}
  Value(const char* value) : data_(std::string(value)) {}
  Value(std::string_view value) : data_(std::string(value)) {}
  Value(Array value) : data_(std::move(value)) {}
  Value(Object value) : data_(std::move(value)) {}

  template <typename T>
  const T* get() const {
    return std::get_if<T>(&data_);
  }
  bool is_null() const { return std::holds_alternative<std::monostate>(data_); }
  // The member named `key` of an object; null when absent or not an object.
  const Value& operator[](std::string_view key) const;

 private:
  std::variant<std::monostate, bool, std::int64_t, double, std::string, Array, Object> data_;
};

// The bins of a row's |eager - compiled| histogram (metrics "histogram"): bin 0 counts exact
// zeros, bin 1 differences below kHistogramEdges[0], bin i + 2 those in [edge i, edge i + 1), and
// the last bin those at or above the last edge (infinities too). NaN differences are not binned
// (the metrics count them).
Value histogram_edges_model();

// One report row: module, call, check_type, tensor_index, label, status, note, reason, sequence
// (execution order), eager and compiled ({dtype, shape} or null), tolerances, reference, metrics.
Value row_model(const Row& row);
// A step's verdict counts (the RESULT line's): verdict, fail, warn, pass, skip, compared,
// loss_fail, nothing_compared.
Value counts_model(const StepCounts& counts);
// A step's root-cause summary: null when no row FAILs, else {forward, backward, next}.
Value root_cause_model(const StepReport& report);
// A step's op localisations (StepReport::ops): [{module, call, backend, dump, error (null unless
// the ops dump is unreadable), graphs: [{graph, first_failing: {node, op, source, max_abs,
// mean_abs, status} or null, ops, failing}]}], empty without ops dumps.
Value ops_model(const StepReport& report);
// One step: step, single_pass, all_pass, result, root_cause, ops, cast_dtype, tolerances, loss,
// modules, rows.
Value step_model(const StepReport& report);

struct RankComparison;
struct RunTotals;
// What the report says of a rank before its steps: rank, scenario, path, provenance ({eager,
// compiled}), separate_dumps, provenance_differences. A rank of the report adds steps, warnings
// and all_pass after them, in that order (the JSON report streams them).
Value rank_header_model(const RankComparison& rank);
// A list of strings (warnings).
Value strings_model(const std::vector<std::string>& strings);
// A run's totals (the report's "summary"): all_pass, ranks, rows, pass, fail, warn, skip,
// compared, loss_fail, steps, failed_steps, nothing_compared_steps, root_cause_first_seen
// ({rank, step} or null), warnings (the run's consistency).
Value summary_model(const RunTotals& totals);
// The whole report: {"histogram_edges": [...], "ranks": [{rank header..., steps, warnings,
// all_pass}], "summary": {...}}.
Value report_model(const std::vector<RankComparison>& ranks, const RunTotals& totals);

// `value` as JSON text (render_json.cpp): strings as formats::printable_name() spells them (valid
// UTF-8, no control characters), non-finite numbers as the strings "nan", "inf", "-inf", arrays
// of objects one element per line. With `keep_newlines`, strings keep their newlines (graph code,
// each line made printable); without, a newline is escaped as printable_name() escapes it.
// `depth` is where `value` sits in an enclosing document (its arrays of objects indent to match).
std::string to_json(const Value& value, bool keep_newlines = false, int depth = 0);

}  // namespace dynaprobe::analyze

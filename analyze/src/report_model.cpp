// The report model (report_model.h): every field the JSON report, Python's row dicts and the
// HTML report have, built in one place. docs/report-format.md#json lists the fields.
#include "dynaprobe/analyze/report_model.h"

#include <cstring>
#include <map>

#include "dynaprobe/analyze/report.h"
#include "report_text.h"

namespace dynaprobe::analyze {
namespace {

using formats::Kind;

Value shape_model(const std::vector<std::int64_t>& shape) {
  Value::Array out;
  for (std::int64_t size : shape) out.emplace_back(size);
  return out;
}

Value side_model(const std::optional<TensorSide>& side) {
  if (!side) return nullptr;
  return Value::Object{{"dtype", formats::dtype_name(side->dtype)},
                       {"shape", shape_model(side->shape)}};
}

Value map_model(const std::map<std::string, std::string>& map) {
  Value::Object out;
  for (const auto& [key, value] : map) out.emplace_back(key, value);
  return out;
}

// The coordinates of a flat C-order index in `shape`.
std::vector<std::int64_t> unravel(std::int64_t index, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> coordinates(shape.size(), 0);
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 0) break;
    coordinates[i] = index % shape[i];
    index /= shape[i];
  }
  return coordinates;
}

// A field of TensorMetrics as the model shows it.
template <typename T>
T metric_value(const TensorMetrics& metrics, const formats::MetricField& field) {
  T value;
  std::memcpy(&value, reinterpret_cast<const char*>(&metrics) + field.offset, sizeof(T));
  return value;
}

// Every metric, in the order of formats::kMetricFields (so a new metric appears here, in the
// JSON, the HTML and Python, with no change), with two composed for readers: mismatch_fraction
// after mismatches, and the worst element as one object in place of its three fields.
Value metrics_model(const Row& row) {
  if (!row.metrics) return nullptr;
  using formats::MetricType;
  const TensorMetrics& m = *row.metrics;
  Value::Object object;
  for (const formats::MetricField& field : formats::kMetricFields) {
    if (field.name == "worst_eager" || field.name == "worst_compiled") continue;
    if (field.name == "worst_index") {
      Value worst = nullptr;
      if (m.worst_index >= 0) {
        // A complex tensor's values are its elements' real and imaginary parts, in turn.
        const auto values = static_cast<std::int64_t>(formats::value_count(row.eager->dtype));
        Value::Object fields{
            {"flat_index", m.worst_index},
            {"index", shape_model(unravel(m.worst_index / values, row.eager->shape))},
            {"eager", m.worst_eager},
            {"compiled", m.worst_compiled}};
        if (values == 2) fields.emplace_back("part", m.worst_index % 2 == 0 ? "real" : "imag");
        worst = std::move(fields);
      }
      object.emplace_back("worst", std::move(worst));
      continue;
    }
    switch (field.type) {
      case MetricType::kFloat64:
        object.emplace_back(std::string(field.name), metric_value<double>(m, field));
        break;
      case MetricType::kBool:
        object.emplace_back(std::string(field.name), metric_value<bool>(m, field));
        break;
      case MetricType::kUInt64:
        object.emplace_back(std::string(field.name), metric_value<std::uint64_t>(m, field));
        break;
      case MetricType::kInt64:
        object.emplace_back(std::string(field.name), metric_value<std::int64_t>(m, field));
        break;
      case MetricType::kHistogram: {
        Value::Array histogram;
        for (std::uint64_t count : m.histogram) histogram.emplace_back(count);
        object.emplace_back(std::string(field.name), std::move(histogram));
        break;
      }
    }
    if (field.name == "mismatches") {
      object.emplace_back(
          "mismatch_fraction",
          m.elements ? static_cast<double>(m.mismatches) / static_cast<double>(m.elements) : 0.0);
    }
  }
  return object;
}

Value tolerances_model(const Tolerances& tolerances) {
  return Value::Object{{"atol", tolerances.atol}, {"rtol", tolerances.rtol}};
}

Value reference_model(const Row& row) {
  if (row.reference_verdict.empty()) return nullptr;
  return Value::Object{{"verdict", row.reference_verdict},
                       {"dtype", row.reference_dtype.empty() ? "fp64" : row.reference_dtype},
                       {"tolerance_status",
                        row.tolerance_status ? Value(status_name(*row.tolerance_status)) : Value()},
                       {"eager_rmse", row.reference_eager->rmse},
                       {"compiled_rmse", row.reference_compiled->rmse},
                       {"eager_max_abs", row.reference_eager->max_abs},
                       {"compiled_max_abs", row.reference_compiled->max_abs},
                       {"noise_units", row.noise_units ? Value(*row.noise_units) : Value()},
                       {"reference_rms", row.reference_eager->rms_eager},
                       {"factor", kReferenceFactor}};
}

Value finding_model(const StepReport& report, const std::optional<Finding>& finding) {
  if (!finding) return nullptr;
  const Row& row = report.rows[finding->row];
  return Value::Object{{"module", row.module},
                       {"call", row.call},
                       {"check_type", formats::kind_name(*row.kind)},
                       {"tensor_index", row.tensor_index},
                       {"label", row.label},
                       {"origin", finding->origin},
                       {"evidence", finding->evidence}};
}

Value op_failure_model(const std::optional<OpFailure>& op) {
  if (!op) return nullptr;
  return Value::Object{{"node", op->node},         {"op", op->op},
                       {"source", op->source},     {"max_abs", op->max_abs},
                       {"mean_abs", op->mean_abs}, {"status", status_name(op->status)}};
}

Value ops_dump_model(const OpsDump& ops) {
  Value::Array graphs;
  for (const OpsGraph& graph : ops.graphs) {
    graphs.emplace_back(Value::Object{{"graph", graph.graph},
                                      {"first_failing", op_failure_model(graph.first_failing)},
                                      {"ops", graph.ops},
                                      {"failing", graph.failing}});
  }
  return Value::Object{{"module", ops.module},
                       {"call", ops.call},
                       {"backend", ops.backend},
                       {"dump", ops.dump.string()},
                       {"error", ops.error.empty() ? Value() : Value(ops.error)},
                       {"graphs", std::move(graphs)}};
}

Value loss_model(const StepReport& step) {
  const auto optional = [](const std::optional<double>& value) {
    return value ? Value(*value) : Value();
  };
  return Value::Object{{"eager", optional(step.single_pass ? std::nullopt : step.loss_eager)},
                       {"compiled", optional(step.loss_compiled)},
                       {"status", status_name(step.loss_status())}};
}

Value modules_model(const StepReport& step) {
  Value::Object out;
  for (const auto& [module, attributes] : step.modules)
    out.emplace_back(module, map_model(attributes));
  return out;
}

}  // namespace

const Value& Value::operator[](std::string_view key) const {
  static const Value kNull;
  if (const Object* object = get<Object>()) {
    for (const auto& [name, value] : *object) {
      if (name == key) return value;
    }
  }
  return kNull;
}

Value histogram_edges_model() {
  Value::Array edges;
  for (std::size_t i = 0; i < kHistogramEdges; ++i) {
    edges.emplace_back(static_cast<double>(histogram_edge(i)));
  }
  return edges;
}

Value row_model(const Row& row) {
  return Value::Object{
      {"module", row.module},
      {"call", row.call},
      {"check_type", row.kind ? formats::kind_name(*row.kind) : std::string_view("note")},
      {"pass", row.kind ? Value(formats::pass_name(*row.kind)) : Value()},
      {"tensor_index", row.tensor_index},
      {"label", row.label},
      {"status", status_name(row.status)},
      {"note", row.note},
      {"reason", row.reason},
      {"sequence", row.sequence},
      {"eager", side_model(row.eager)},
      {"compiled", side_model(row.compiled)},
      {"tolerances", row.tolerances ? tolerances_model(*row.tolerances) : Value()},
      {"reference", reference_model(row)},
      {"fp32_screen", row.beyond_screen ? Value(*row.beyond_screen) : Value()},
      {"metrics", metrics_model(row)}};
}

Value counts_model(const StepCounts& counts) {
  return Value::Object{{"verdict", verdict_text(counts.all_pass())},
                       {"fail", counts.fail},
                       {"warn", counts.warn},
                       {"pass", counts.pass},
                       {"skip", counts.skip},
                       {"compared", counts.compared},
                       {"noise_pass", counts.noise_pass},
                       {"no_reference_calls", counts.no_reference_calls},
                       {"referenced", counts.referenced},
                       {"screened", counts.screened},
                       {"low_precision_unreferenced", counts.low_precision_unreferenced},
                       {"loss_fail", counts.loss_failed},
                       {"nothing_compared", counts.nothing_compared()}};
}

Value root_cause_model(const StepReport& report) {
  const RootCause& cause = report.root_cause;
  if (cause.empty()) return nullptr;
  return Value::Object{{"forward", finding_model(report, cause.forward)},
                       {"backward", finding_model(report, cause.backward)},
                       {"next", cause.next}};
}

Value ops_model(const StepReport& report) {
  Value::Array out;
  for (const OpsDump& ops : report.ops) out.push_back(ops_dump_model(ops));
  return out;
}

Value step_model(const StepReport& step) {
  Value::Array rows;
  for (const Row& row : step.rows) rows.push_back(row_model(row));
  return Value::Object{{"step", step.step},
                       {"single_pass", step.single_pass},
                       {"all_pass", step.all_pass()},
                       {"result", counts_model(step.counts())},
                       {"result_details", detail::result_details(step)},
                       {"root_cause", root_cause_model(step)},
                       {"ops", ops_model(step)},
                       {"capture_input", step.capture_input},
                       {"cast_dtype", step.cast_dtype},
                       {"autocast", step.autocast},
                       {"reference_decides", step.reference_decides},
                       {"not_stored", step.not_stored},
                       {"tolerances", tolerances_model(step.tolerances)},
                       {"loss", loss_model(step)},
                       {"modules", modules_model(step)},
                       {"rows", std::move(rows)}};
}

Value rank_header_model(const RankComparison& rank) {
  const Comparison& c = rank.comparison;
  Value::Array differences;
  for (const auto& d : c.provenance_differences) {
    differences.emplace_back(
        Value::Object{{"key", d.key}, {"eager", d.eager}, {"compiled", d.compiled}});
  }
  return Value::Object{
      {"rank", rank.rank},
      {"scenario", rank.scenario},
      {"path", rank.path.string()},
      {"compiled_path", rank.compiled_path.string()},
      {"provenance", Value::Object{{"eager", map_model(c.eager_provenance)},
                                   {"compiled", map_model(c.compiled_provenance)}}},
      {"separate_dumps", c.separate_dumps},
      {"compiled_baseline", c.compiled_baseline},
      {"provenance_differences", std::move(differences)}};
}

Value strings_model(const std::vector<std::string>& strings) {
  Value::Array out;
  for (const std::string& text : strings) out.emplace_back(text);
  return out;
}

Value summary_model(const RunTotals& totals) {
  Value first_cause = nullptr;
  if (totals.root_cause_first_seen) {
    first_cause = Value::Object{{"rank", totals.root_cause_first_seen->rank},
                                {"step", totals.root_cause_first_seen->step}};
  }
  return Value::Object{{"all_pass", totals.all_pass},
                       {"ranks", totals.ranks},
                       {"rows", totals.rows},
                       {"pass", totals.pass},
                       {"fail", totals.fail},
                       {"warn", totals.warn},
                       {"skip", totals.skip},
                       {"compared", totals.compared},
                       {"loss_fail", totals.loss_fail},
                       {"steps", totals.steps},
                       {"failed_steps", totals.failed_steps},
                       {"nothing_compared_steps", totals.nothing_compared_steps},
                       {"root_cause_first_seen", std::move(first_cause)},
                       {"warnings", strings_model(totals.warnings)}};
}

Value report_model(const std::vector<RankComparison>& ranks, const RunTotals& totals) {
  Value::Array out;
  for (const RankComparison& rank : ranks) {
    Value::Object object = *rank_header_model(rank).get<Value::Object>();
    Value::Array steps;
    for (const StepReport& step : rank.comparison.steps) steps.push_back(step_model(step));
    object.emplace_back("steps", std::move(steps));
    object.emplace_back("warnings", strings_model(rank.comparison.warnings));
    object.emplace_back("all_pass", rank.comparison.all_pass());
    out.emplace_back(std::move(object));
  }
  return Value::Object{{"histogram_edges", histogram_edges_model()},
                       {"ranks", std::move(out)},
                       {"summary", summary_model(totals)}};
}

}  // namespace dynaprobe::analyze

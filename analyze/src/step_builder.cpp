#include "step_builder.h"

#include <fnmatch.h>

#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"

namespace dynaprobe::analyze {
using formats::Kind;
using formats::RecordInfo;
using formats::Side;
using formats::StepReader;
namespace vocabulary = formats::vocabulary;

bool module_matches(const std::string& glob, const std::string& module) {
  return fnmatch(glob.c_str(), module.c_str(), 0) == 0;
}

namespace {

// The loss of one side, as a double.
std::optional<double> read_loss(const StepReader* reader, Side side) {
  if (!reader) return std::nullopt;
  const RecordInfo* info = reader->find(formats::RecordKey{
      reader->step(), std::string(formats::kLossModule), 0, Kind::kLoss, 0, side});
  if (!info || info->numel() != 1) return std::nullopt;
  const auto bytes = reader->read(*info);
  if (info->dtype == formats::DType::kFloat64) {
    double value;
    std::memcpy(&value, bytes.data(), sizeof(value));
    return value;
  }
  float value;
  formats::convert_to_float32(info->dtype, bytes.data(), 1, &value);
  return value;
}

// A gradient only one side holds: when it is all zeros, it equals the other side's absence of one
// (all_zeros in step_rows.h), and the row passes, saying so. A file not readable (not written,
// still being written elsewhere) leaves the row as it is.
void judge_zero_gradient(const StepReader* reader, const RecordInfo& held, Row& row) {
  try {
    reader->wait_readable();
    if (!all_zeros(*reader, held)) return;
  } catch (const Error&) {
    return;
  }
  const bool eager_held = row.eager.has_value();
  (eager_held ? row.compiled : row.eager) = eager_held ? row.eager : row.compiled;
  row.metrics = TensorMetrics{};
  row.metrics->elements = held.numel();
  row.status = Status::kPass;
  row.note.clear();
  row.reason = std::string(eager_held ? "compiled" : "eager") + ": no gradient; " +
               (eager_held ? "eager" : "compiled") + ": zeros (the same gradient)";
}

}  // namespace

StepReport StepBuilder::build(std::int64_t step, const StepReader* eager,
                              const StepReader* compiled, std::vector<Task>& tasks) {
  StepReport report = report_header(step, eager, compiled);
  const ModuleAttributes modules = merge_module_attributes(eager, compiled);
  for (const auto& [module, attributes] : modules) {
    if (wanted(module)) report.modules.emplace(module, attributes);
    // The user's own autocast, seen by a module's call when the step began outside it.
    auto autocast = attributes.find(std::string(vocabulary::provenance::kAutocast));
    if (report.autocast.empty() && autocast != attributes.end()) {
      report.autocast = autocast->second;
    }
  }
  ModuleOrder order;  // execution order: the modules with records first
  const Pairs pairs = pair_records(eager, compiled, order, eager_side_);
  add_listed_modules(eager, compiled, order);
  const CallsRun calls = calls_run(pairs);
  const ModuleRoles roles(modules);
  const StepRecords records{eager, compiled, modules, pairs, calls, roles};
  for (const std::string& module : order.modules()) {
    if (wanted(module)) add_module_rows(module, records, report, tasks);
  }
  return report;
}

StepReport StepBuilder::report_header(std::int64_t step, const StepReader* eager,
                                      const StepReader* compiled) const {
  StepReport report;
  report.step = step;
  report.tolerances = judging_.tolerances;
  report.tolerance_rules = judging_.rules;
  report.dtype_aware = judging_.dtype_aware;
  report.reference_decides = judging_.reference_decides;
  apply_provenance((eager ? eager : compiled)->provenance(), report);
  report.loss_eager = read_loss(eager, eager_side_);
  report.loss_compiled = read_loss(compiled, Side::kCompiled);
  return report;
}

void StepBuilder::add_module_rows(const std::string& module, const StepRecords& records,
                                  StepReport& report, std::vector<Task>& tasks) const {
  if (records.roles.ignored_or_under(module)) {
    // Only the ignored modules themselves get a row; their submodules are covered by it.
    if (records.roles.ignored(module)) report.rows.push_back(ignored_row(module));
    return;
  }
  const auto attributes = records.modules.find(module);
  if (attributes != records.modules.end()) {
    auto row = module_note_row(module, attributes->second, report.single_pass,
                               records.calls.eager_calls(module));
    if (row) report.rows.push_back(std::move(*row));
    if (auto missing = no_reference_row(module, attributes->second)) {
      report.no_reference_calls += missing->calls;
      report.rows.push_back(std::move(missing->row));
    }
  }
  for (auto it = records.pairs.lower_bound({module, 0, Kind::kFwdInput, 0});
       it != records.pairs.end() && it->first.module == module; ++it) {
    add_tensor_row(it->first, it->second, records, report, tasks);
  }
}

void StepBuilder::add_tensor_row(const TensorKey& key, Pair pair, const StepRecords& records,
                                 StepReport& report, std::vector<Task>& tasks) const {
  pair = compared_pair(key, pair, report.single_pass);
  Row row = tensor_row(key, pair, records.eager, records.compiled);
  if (pair.eager && pair.compiled) {
    if (row.shape_mismatch()) {
      row.status = Status::kFail;
      row.reason = "shape mismatch: eager " + formats::shape_string(pair.eager->shape) +
                   ", compiled " + formats::shape_string(pair.compiled->shape);
      if (formats::is_complex(pair.eager->dtype) != formats::is_complex(pair.compiled->dtype)) {
        row.reason = "dtype mismatch: eager " +
                     std::string(formats::dtype_name(pair.eager->dtype)) + ", compiled " +
                     std::string(formats::dtype_name(pair.compiled->dtype)) +
                     " (complex values compare with complex ones only)";
      }
    } else {
      add_tasks(pair, records, report, row, tasks);
    }
  } else {
    const bool compiled_ran = records.calls.compiled_ran(key.module, key.call, report.single_pass);
    const Verdict verdict = one_sided_verdict(
        {pair.eager ? Side::kEager : Side::kCompiled, key.kind, records.roles.wrapped(key.module),
         records.roles.inside_wrapped(key.module), compiled_ran});
    row.status = verdict.status;
    row.note = verdict.note;
    row.reason = verdict.reason;
    if (!is_forward(key.kind) && row.status == Status::kWarn && compiled_ran) {
      judge_zero_gradient(pair.eager ? records.eager : records.compiled,
                          pair.eager ? *pair.eager : *pair.compiled, row);
    }
  }
  report.rows.push_back(std::move(row));
}

// The row's own comparison and, with an fp64 reference of its shape, each side's against it;
// `row` is the next row of `report`.
void StepBuilder::add_tasks(const Pair& pair, const StepRecords& records, const StepReport& report,
                            Row& row, std::vector<Task>& tasks) const {
  const Tolerances tolerances =
      judging_.row_tolerances(row.module, *row.kind, row.eager->dtype, row.compiled->dtype);
  if (tolerances.atol != report.tolerances.atol || tolerances.rtol != report.tolerances.rtol) {
    row.tolerances = tolerances;
  }
  const std::size_t index = report.rows.size();
  const StepReader* eager = records.eager;
  const StepReader* compiled = records.compiled;
  tasks.push_back(
      Task{nullptr, index, eager, pair.eager, compiled, pair.compiled, Target::kRow, tolerances});
  if (pair.reference && pair.reference->shape == pair.eager->shape) {
    // The fp64 reference lives with the compiled side (single-pass writes both in one file).
    const StepReader* reference = compiled ? compiled : eager;
    tasks.push_back(Task{nullptr, index, reference, pair.reference, eager, pair.eager,
                         Target::kReferenceEager, tolerances});
    tasks.push_back(Task{nullptr, index, reference, pair.reference, compiled, pair.compiled,
                         Target::kReferenceCompiled, tolerances});
  }
}

}  // namespace dynaprobe::analyze

// The spec's 9-column CSV (docs/report-format.md#csv-9-columns) and the merged multi-rank CSV
// (docs/report-format.md#merged-multi-rank-csv).
#include <algorithm>
#include <cmath>

#include "dynaprobe/analyze/report.h"
#include "report_text.h"

namespace dynaprobe::analyze {
namespace {

using namespace detail;

// CSV field quoting as Python's csv module does by default (QUOTE_MINIMAL).
std::string csv_field(const std::string& field) {
  if (field.find_first_of(",\"\r\n") == std::string::npos) return field;
  std::string quoted = "\"";
  for (char c : field) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + "\"";
}

// A low-precision row no reference judged: what decided it.
constexpr std::string_view kNoReferenceNote = "no reference: judged by the tolerances";

std::string csv_line(const std::vector<std::string>& fields) {
  std::string text;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (i) text += ',';
    text += csv_field(fields[i]);
  }
  return text + "\n";
}

// The 9 CSV columns of each row of a step, LOSS first. `merged` uses the multi-rank example's
// spelling for rows without metrics ("-" and "N/A").
std::vector<std::vector<std::string>> csv_rows(const StepReport& report, bool merged) {
  std::vector<std::vector<std::string>> rows;
  const std::string loss_status(status_name(report.loss_status()));
  const double compiled = report.loss_compiled.value_or(NAN);
  if (report.single_pass || !report.loss_eager) {
    rows.push_back({"LOSS", "loss", "0", loss_status, "N/A", "N/A", "N/A",
                    "compiled=" + format_float(compiled, "%.6f"),
                    report.single_pass ? "single_pass mode" : ""});
  } else {
    const double eager = *report.loss_eager;
    rows.push_back(
        {"LOSS", "loss", "0", loss_status, format_float(std::fabs(eager - compiled), "%.6e"), "N/A",
         "N/A",
         "eager=" + format_float(eager, "%.6f") + " compiled=" + format_float(compiled, "%.6f"),
         ""});
  }
  const std::string empty = merged ? "N/A" : "";
  for (const Row& row : report.rows) {
    std::string module = formats::printable_name(row.module) +
                         (row.call > 0 ? " (call " + std::to_string(row.call) + ")" : "");
    const std::string status(status_name(row.status));
    if (!row.kind) {
      rows.push_back(
          {module, merged ? "-" : "note", "0", status, empty, empty, empty, "", row_note(row)});
      continue;
    }
    const std::string kind(formats::kind_name(*row.kind));
    const std::string index = std::to_string(row.tensor_index);
    if (!row.metrics && !row.shape_mismatch()) {
      rows.push_back(
          {module, kind, index, status, empty, empty, empty, shape_text(row), row_note(row)});
      continue;
    }
    const Numbers n = numbers(row);
    std::string note = row_note(row);
    if (report.judged_by_tolerances_only(row)) {
      note += (note.empty() ? "" : "; ") + std::string(kNoReferenceNote);
    }
    rows.push_back({module, kind, index, status, format_float(n.max_abs, "%.6e"),
                    format_float(n.mean_abs, "%.6e"), format_float(n.max_rel, "%.6e"),
                    shape_text(row), note});
  }
  return rows;
}

const std::vector<std::string> kCsvHeader = {"module_name",  "check_type",   "tensor_index",
                                             "status",       "max_abs_diff", "mean_abs_diff",
                                             "max_rel_diff", "shape",        "note"};

}  // namespace

// `columns` before the 9, each row's values of them from `prefix`.
std::vector<std::string> header_with(std::vector<std::string> columns) {
  columns.insert(columns.end(), kCsvHeader.begin(), kCsvHeader.end());
  return columns;
}

std::string render_csv(const std::vector<StepReport>& steps) {
  // One step: the spec's 9 columns. Several: a leading step column, so that a script or pandas
  // can tell the steps apart.
  const bool several = steps.size() > 1;
  std::string out = csv_line(several ? header_with({"step"}) : kCsvHeader);
  for (const StepReport& report : steps) {
    for (auto fields : csv_rows(report, false)) {
      if (several) fields.insert(fields.begin(), std::to_string(report.step));
      out += csv_line(fields);
    }
  }
  return out;
}

namespace {

// The merged CSV, a line per row as the steps come.
class MergedCsvWriter : public ReportWriter {
 public:
  MergedCsvWriter(std::ostream& out, const RunShape& shape)
      : out_(out), several_(shape.several_steps) {
    // The spec's rank,scenario + 9 columns; a step column after them when a rank has several
    // steps.
    out_ << csv_line(header_with(several_ ? std::vector<std::string>{"rank", "scenario", "step"}
                                          : std::vector<std::string>{"rank", "scenario"}));
  }
  void add_step(const RankComparison& rank, const StepReport& step) override {
    for (auto fields : csv_rows(step, true)) {
      std::vector<std::string> leading = {std::to_string(rank.rank), rank.scenario};
      if (several_) leading.push_back(std::to_string(step.step));
      fields.insert(fields.begin(), leading.begin(), leading.end());
      out_ << csv_line(fields);
    }
  }
  void end_rank(const RankComparison&, bool) override {}
  void finish(const RunTotals&) override { out_.flush(); }

 private:
  std::ostream& out_;
  bool several_;
};

// Each rank's 9-column CSV, kept until its rank ends.
class RankCsvWriter : public ReportWriter {
 public:
  RankCsvWriter(std::filesystem::path path, const RunShape& shape,
                std::function<void(const std::filesystem::path&, const std::string&)> write_file)
      : path_(std::move(path)), shape_(shape), write_file_(std::move(write_file)) {}
  void add_step(const RankComparison&, const StepReport& step) override {
    if (text_.empty()) text_ = csv_line(shape_.several_steps ? header_with({"step"}) : kCsvHeader);
    for (auto fields : csv_rows(step, false)) {
      if (shape_.several_steps) fields.insert(fields.begin(), std::to_string(step.step));
      text_ += csv_line(fields);
    }
  }
  void end_rank(const RankComparison& rank, bool) override {
    if (text_.empty()) return;
    std::filesystem::path path = path_;
    if (shape_.ranks > 1) {  // "report.csv" -> "report_rank1.csv"
      path.replace_filename(path_.stem().string() + "_rank" + std::to_string(rank.rank) +
                            path_.extension().string());
    }
    write_file_(path, text_);
    text_.clear();
  }
  void finish(const RunTotals&) override {}

 private:
  std::filesystem::path path_;
  RunShape shape_;
  std::function<void(const std::filesystem::path&, const std::string&)> write_file_;
  std::string text_;
};

}  // namespace

std::unique_ptr<ReportWriter> open_merged_csv(std::ostream& out, const RunShape& shape) {
  return std::make_unique<MergedCsvWriter>(out, shape);
}

std::unique_ptr<ReportWriter> open_rank_csvs(
    const std::filesystem::path& path, const RunShape& shape,
    std::function<void(const std::filesystem::path&, const std::string&)> write_file) {
  return std::make_unique<RankCsvWriter>(path, shape, std::move(write_file));
}

}  // namespace dynaprobe::analyze

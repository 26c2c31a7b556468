// The JSON report: the report model (report_model.h) as JSON text (docs/report-format.md#json).
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ostream>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/report_model.h"

namespace dynaprobe::analyze {
namespace {

// Strings are the printable_name() of the text, as in the text report, so they are valid UTF-8
// without control characters whatever bytes a damaged dump holds.
// With `keep_newlines` (graph code), each line is made printable and the newlines kept.
void append_string(std::string& out, const std::string& raw, bool keep_newlines = false) {
  std::string text;
  if (keep_newlines) {
    for (std::size_t start = 0; start <= raw.size();) {
      std::size_t end = raw.find('\n', start);
      if (end == std::string::npos) end = raw.size();
      text += formats::printable_name(std::string_view(raw).substr(start, end - start));
      if (end < raw.size()) text += '\n';
      start = end + 1;
    }
  } else {
    text = formats::printable_name(raw);
  }
  out += '"';
  for (unsigned char c : text) {
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      default:
        if (c < 0x20) {  // printable_name() leaves none; kept for safety
          char buffer[8];
          std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
          out += buffer;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void append_number(std::string& out, double value) {
  if (!std::isfinite(value)) {
    append_string(out, format_float(value, "%g"));
    return;
  }
  // The shortest text that reads back as the same double, so a report merged from JSON reports
  // (dynaprobe merge) states the very numbers of the run analysed whole.
  char buffer[32];
  const auto end = std::to_chars(buffer, buffer + sizeof(buffer), value).ptr;
  out.append(buffer, end);
}

bool all_objects(const Value::Array& array) {
  for (const Value& element : array) {
    if (!element.get<Value::Object>()) return false;
  }
  return !array.empty();
}

void append(std::string& out, const Value& value, int depth, bool keep_newlines) {
  if (value.is_null()) {
    out += "null";
  } else if (const bool* b = value.get<bool>()) {
    out += *b ? "true" : "false";
  } else if (const std::int64_t* i = value.get<std::int64_t>()) {
    out += std::to_string(*i);
  } else if (const double* d = value.get<double>()) {
    append_number(out, *d);
  } else if (const std::string* s = value.get<std::string>()) {
    append_string(out, *s, keep_newlines);
  } else if (const Value::Array* array = value.get<Value::Array>()) {
    // Rows, steps and ranks one per line, so a report reads (and diffs) line by line.
    const bool lines = all_objects(*array);
    const std::string indent = "\n" + std::string(2 * (depth + 1), ' ');
    out += '[';
    for (std::size_t k = 0; k < array->size(); ++k) {
      if (k) out += lines ? "," : ", ";
      if (lines) out += indent;
      append(out, (*array)[k], depth + 1, keep_newlines);
    }
    out += ']';
  } else if (const Value::Object* object = value.get<Value::Object>()) {
    // The top level one member per line, anything deeper on one line.
    const bool lines = depth == 0;
    out += '{';
    for (std::size_t k = 0; k < object->size(); ++k) {
      if (k) out += lines ? "," : ", ";
      if (lines) out += "\n  ";
      append_string(out, (*object)[k].first);
      out += ": ";
      append(out, (*object)[k].second, depth + 1, keep_newlines);
    }
    out += lines ? "\n}" : "}";
  }
}

// The JSON report, written as the run arrives: the top level's members one per line, each rank on
// a line of its own with its steps one per line (to_json's layout at their depth), the summary
// last, when the totals are known.
class JsonWriter : public ReportWriter {
 public:
  explicit JsonWriter(std::ostream& out) : out_(out) {
    out_ << "{\n  \"histogram_edges\": " << to_json(histogram_edges_model(), false, 1)
         << ",\n  \"ranks\": [";
  }
  void add_step(const RankComparison& rank, const StepReport& step) override {
    open_rank(rank);
    out_ << (steps_ ? "," : "") << "\n        " << to_json(step_model(step), false, 4);
    ++steps_;
  }
  void end_rank(const RankComparison& rank, bool all_pass) override {
    open_rank(rank);
    out_ << "], \"warnings\": " << to_json(strings_model(rank.comparison.warnings), false, 3)
         << ", \"all_pass\": " << (all_pass ? "true" : "false") << "}";
    rank_open_ = false;
  }
  void finish(const RunTotals& totals) override {
    out_ << "],\n  \"summary\": " << to_json(summary_model(totals), false, 1) << "\n}\n";
    out_.flush();
  }

 private:
  // The rank's members before its steps, and "steps": [.
  void open_rank(const RankComparison& rank) {
    if (rank_open_) return;
    std::string header = to_json(rank_header_model(rank), false, 2);
    header.pop_back();  // the closing brace: the steps and the rest follow
    out_ << (ranks_ ? "," : "") << "\n    " << header << ", \"steps\": [";
    rank_open_ = true;
    steps_ = 0;
    ++ranks_;
  }

  std::ostream& out_;
  bool rank_open_ = false;
  std::size_t ranks_ = 0;
  std::size_t steps_ = 0;
};

}  // namespace

std::string to_json(const Value& value, bool keep_newlines, int depth) {
  std::string out;
  append(out, value, depth, keep_newlines);
  return out;
}

std::unique_ptr<ReportWriter> open_json(std::ostream& out, const RunShape&) {
  return std::make_unique<JsonWriter>(out);
}

std::string render_root_cause_json(const StepReport& report) {
  return to_json(root_cause_model(report));
}

}  // namespace dynaprobe::analyze

// JSON reports read back into comparisons (run.h: read_json_reports), the inverse of the report
// model (report_model.cpp), so that partial reports of a run merge into the report of the whole.
// The reader is strict: a report is parsed whole (RFC 8259, nesting bounded) before anything is
// taken from it, and a value of the wrong type is a FormatError naming the report and the field.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "dynaprobe/analyze/report_model.h"
#include "dynaprobe/analyze/run.h"
#include "dynaprobe/formats/error.h"

namespace dynaprobe::analyze {
namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  Parser(const std::string& text, const std::string& name) : text_(text), name_(name) {}

  Value document() {
    Value value = parse(0);
    skip_space();
    if (at_ < text_.size()) fail("text after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(name_ + ": not a dynaprobe JSON report: " + what + " at byte " +
                      std::to_string(at_));
  }
  void skip_space() {
    while (at_ < text_.size() && std::strchr(" \t\r\n", text_[at_]) && text_[at_]) ++at_;
  }
  bool take(char c) {
    skip_space();
    if (at_ < text_.size() && text_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(std::string_view w) {
    if (text_.compare(at_, w.size(), w) != 0) return false;
    at_ += w.size();
    return true;
  }

  Value parse(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    skip_space();
    if (at_ >= text_.size()) fail("unexpected end");
    const char c = text_[at_];
    if (c == '{') {
      ++at_;
      Value::Object object;
      if (take('}')) return object;
      do {
        skip_space();
        std::string key = string();
        expect(':');
        object.emplace_back(std::move(key), parse(depth + 1));
      } while (take(','));
      expect('}');
      return object;
    }
    if (c == '[') {
      ++at_;
      Value::Array array;
      if (take(']')) return array;
      do {
        array.push_back(parse(depth + 1));
      } while (take(','));
      expect(']');
      return array;
    }
    if (c == '"') return string();
    if (word("true")) return true;
    if (word("false")) return false;
    if (word("null")) return nullptr;
    return number();
  }

  Value number() {
    const std::size_t start = at_;
    while (at_ < text_.size() && std::strchr("+-0123456789.eE", text_[at_]) && text_[at_]) ++at_;
    const char* first = text_.data() + start;
    const char* last = text_.data() + at_;
    if (first == last) fail("expected a value");
    if (std::none_of(first, last, [](char ch) { return ch == '.' || ch == 'e' || ch == 'E'; })) {
      std::int64_t integer = 0;
      const auto parsed = std::from_chars(first, last, integer);
      if (parsed.ec == std::errc() && parsed.ptr == last) return integer;
    }
    double value = 0;
    const auto parsed = std::from_chars(first, last, value);
    if (parsed.ec != std::errc() || parsed.ptr != last) fail("a malformed number");
    return value;
  }

  std::string string() {
    if (at_ >= text_.size() || text_[at_] != '"') fail("expected a string");
    ++at_;
    std::string out;
    while (true) {
      if (at_ >= text_.size()) fail("an unterminated string");
      const char c = text_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= text_.size()) fail("an unterminated string");
      const char e = text_[at_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'u':
          append_utf8(out, code_point());
          break;
        default:
          fail("an unknown escape in a string");
      }
    }
  }

  std::uint32_t hex4() {
    if (at_ + 4 > text_.size()) fail("a short \\u escape");
    std::uint32_t value = 0;
    const auto parsed = std::from_chars(text_.data() + at_, text_.data() + at_ + 4, value, 16);
    if (parsed.ec != std::errc() || parsed.ptr != text_.data() + at_ + 4) fail("a bad \\u escape");
    at_ += 4;
    return value;
  }
  std::uint32_t code_point() {
    std::uint32_t value = hex4();
    if (value >= 0xD800 && value < 0xDC00 && word("\\u")) {
      const std::uint32_t low = hex4();
      if (low < 0xDC00 || low > 0xDFFF) fail("a bad surrogate pair");
      value = 0x10000 + ((value - 0xD800) << 10) + (low - 0xDC00);
    }
    return value;
  }
  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  const std::string& text_;
  const std::string& name_;
  std::size_t at_ = 0;
};

// Typed access to the report model, each error naming the report and the field.
class Reader {
 public:
  explicit Reader(std::string name) : name_(std::move(name)) {}

  [[noreturn]] void fail(std::string_view field, std::string_view expected) const {
    throw FormatError(name_ + ": not a dynaprobe JSON report: \"" + std::string(field) +
                      "\" is not " + std::string(expected));
  }
  // The value as a T, or a FormatError naming the field and what was `expected`.
  template <typename T>
  const T& typed(const Value& value, std::string_view field, std::string_view expected) const {
    const T* typed_value = value.get<T>();
    if (!typed_value) fail(field, expected);
    return *typed_value;
  }
  const Value::Object& object(const Value& value, std::string_view field) const {
    return typed<Value::Object>(value, field, "an object");
  }
  const Value::Array& array(const Value& value, std::string_view field) const {
    return typed<Value::Array>(value, field, "an array");
  }
  std::string string(const Value& value, std::string_view field) const {
    return typed<std::string>(value, field, "a string");
  }
  bool boolean(const Value& value, std::string_view field) const {
    return typed<bool>(value, field, "true or false");
  }
  std::int64_t integer(const Value& value, std::string_view field) const {
    return typed<std::int64_t>(value, field, "an integer");
  }
  // A number, or the strings "nan", "inf", "-inf" the model writes for non-finite ones.
  double number(const Value& value, std::string_view field) const {
    if (const auto* d = value.get<double>()) return *d;
    if (const auto* i = value.get<std::int64_t>()) return static_cast<double>(*i);
    if (const auto* text = value.get<std::string>()) {
      if (*text == "nan") return NAN;
      if (*text == "inf") return INFINITY;
      if (*text == "-inf") return -INFINITY;
    }
    fail(field, "a number");
  }
  std::optional<double> optional_number(const Value& value, std::string_view field) const {
    if (value.is_null()) return std::nullopt;
    return number(value, field);
  }
  Status status(const Value& value, std::string_view field) const {
    const std::string name = string(value, field);
    for (Status s : {Status::kPass, Status::kFail, Status::kSkip, Status::kWarn}) {
      if (status_name(s) == name) return s;
    }
    fail(field, "PASS, FAIL, SKIP or WARN");
  }
  std::map<std::string, std::string> strings(const Value& value, std::string_view field) const {
    std::map<std::string, std::string> out;
    for (const auto& [key, text] : object(value, field)) out[key] = string(text, field);
    return out;
  }
  std::vector<std::string> string_list(const Value& value, std::string_view field) const {
    std::vector<std::string> out;
    for (const Value& text : array(value, field)) out.push_back(string(text, field));
    return out;
  }

  std::optional<TensorSide> side(const Value& value, std::string_view field) const {
    if (value.is_null()) return std::nullopt;
    TensorSide side;
    const std::string dtype = string(value["dtype"], "dtype");
    const auto parsed = formats::parse_dtype(dtype);
    if (!parsed) fail(field, "a tensor with a known dtype");
    side.dtype = *parsed;
    for (const Value& size : array(value["shape"], "shape")) {
      side.shape.push_back(integer(size, "shape"));
    }
    return side;
  }

  Tolerances tolerances(const Value& value) const {
    return {number(value["atol"], "atol"), number(value["rtol"], "rtol")};
  }

  TensorMetrics metrics(const Value& value) const {
    using formats::MetricType;
    TensorMetrics m;
    for (const formats::MetricField& field : formats::kMetricFields) {
      char* at = reinterpret_cast<char*>(&m) + field.offset;
      if (field.name == "worst_eager" || field.name == "worst_compiled") continue;
      if (field.name == "worst_index") {
        const Value& worst = value["worst"];
        m.worst_index = -1;
        if (!worst.is_null()) {
          m.worst_index = integer(worst["flat_index"], "flat_index");
          m.worst_eager = number(worst["eager"], "worst.eager");
          m.worst_compiled = number(worst["compiled"], "worst.compiled");
        }
        continue;
      }
      const Value& v = value[field.name];
      switch (field.type) {
        case MetricType::kFloat64: {
          const double d = number(v, field.name);
          std::memcpy(at, &d, sizeof d);
          break;
        }
        case MetricType::kBool: {
          const bool b = boolean(v, field.name);
          std::memcpy(at, &b, sizeof b);
          break;
        }
        case MetricType::kUInt64: {
          const auto u = static_cast<std::uint64_t>(integer(v, field.name));
          std::memcpy(at, &u, sizeof u);
          break;
        }
        case MetricType::kInt64: {
          const std::int64_t i = integer(v, field.name);
          std::memcpy(at, &i, sizeof i);
          break;
        }
        case MetricType::kHistogram: {
          const Value::Array& bins = array(v, field.name);
          if (bins.size() != m.histogram.size()) fail(field.name, "a histogram of the known bins");
          for (std::size_t i = 0; i < bins.size(); ++i) {
            m.histogram[i] = static_cast<std::uint64_t>(integer(bins[i], field.name));
          }
          break;
        }
      }
    }
    return m;
  }

  Row row(const Value& value) const {
    Row row;
    row.module = string(value["module"], "module");
    row.call = static_cast<std::uint32_t>(integer(value["call"], "call"));
    const std::string check = string(value["check_type"], "check_type");
    if (check != "note") {
      row.kind = formats::parse_kind(check);
      if (!row.kind) fail("check_type", "a check type");
    }
    row.tensor_index = static_cast<std::uint32_t>(integer(value["tensor_index"], "tensor_index"));
    row.label = string(value["label"], "label");
    row.status = status(value["status"], "status");
    row.note = string(value["note"], "note");
    row.reason = string(value["reason"], "reason");
    row.sequence = static_cast<std::uint64_t>(integer(value["sequence"], "sequence"));
    row.eager = side(value["eager"], "eager");
    row.compiled = side(value["compiled"], "compiled");
    if (!value["tolerances"].is_null()) row.tolerances = tolerances(value["tolerances"]);
    const Value& reference = value["reference"];
    if (!reference.is_null()) {
      row.reference_verdict = string(reference["verdict"], "reference.verdict");
      row.reference_dtype = string(reference["dtype"], "reference.dtype");
      if (!reference["tolerance_status"].is_null()) {
        row.tolerance_status = status(reference["tolerance_status"], "tolerance_status");
      }
      TensorMetrics eager, compiled;
      eager.rmse = number(reference["eager_rmse"], "eager_rmse");
      eager.max_abs = number(reference["eager_max_abs"], "eager_max_abs");
      compiled.rmse = number(reference["compiled_rmse"], "compiled_rmse");
      compiled.max_abs = number(reference["compiled_max_abs"], "compiled_max_abs");
      eager.rms_eager = number(reference["reference_rms"], "reference_rms");
      row.noise_units = optional_number(reference["noise_units"], "noise_units");
      row.reference_eager = eager;
      row.reference_compiled = compiled;
    }
    row.beyond_screen = optional_number(value["fp32_screen"], "fp32_screen");
    if (row.beyond_screen) row.tolerance_status = Status::kPass;
    if (!value["metrics"].is_null()) row.metrics = metrics(value["metrics"]);
    return row;
  }

  std::optional<Finding> finding(const Value& value, const StepReport& step) const {
    if (value.is_null()) return std::nullopt;
    const std::string module = string(value["module"], "module");
    const auto call = integer(value["call"], "call");
    const auto kind = formats::parse_kind(string(value["check_type"], "check_type"));
    const auto index = integer(value["tensor_index"], "tensor_index");
    for (std::size_t i = 0; i < step.rows.size(); ++i) {
      const Row& row = step.rows[i];
      if (row.module == module && row.call == call && row.kind == kind &&
          row.tensor_index == index) {
        return Finding{i, string(value["origin"], "origin"), string(value["evidence"], "evidence")};
      }
    }
    fail("root_cause", "a finding that names one of the step's rows");
  }

  OpsDump ops(const Value& value) const {
    OpsDump ops;
    ops.module = string(value["module"], "ops.module");
    ops.call = static_cast<std::uint32_t>(integer(value["call"], "ops.call"));
    ops.backend = string(value["backend"], "ops.backend");
    ops.dump = string(value["dump"], "ops.dump");
    if (!value["error"].is_null()) ops.error = string(value["error"], "ops.error");
    for (const Value& g : array(value["graphs"], "ops.graphs")) {
      OpsGraph graph;
      graph.graph = string(g["graph"], "graph");
      graph.ops = static_cast<std::size_t>(integer(g["ops"], "ops"));
      graph.failing = static_cast<std::size_t>(integer(g["failing"], "failing"));
      const Value& first = g["first_failing"];
      if (!first.is_null()) {
        graph.first_failing =
            OpFailure{string(first["node"], "node"),         string(first["op"], "op"),
                      string(first["source"], "source"),     number(first["max_abs"], "max_abs"),
                      number(first["mean_abs"], "mean_abs"), status(first["status"], "status")};
      }
      ops.graphs.push_back(std::move(graph));
    }
    return ops;
  }

  StepReport step(const Value& value) const {
    StepReport step;
    step.step = integer(value["step"], "step");
    step.single_pass = boolean(value["single_pass"], "single_pass");
    step.capture_input = boolean(value["capture_input"], "capture_input");
    step.cast_dtype = string(value["cast_dtype"], "cast_dtype");
    step.autocast = string(value["autocast"], "autocast");
    step.reference_decides = boolean(value["reference_decides"], "reference_decides");
    step.not_stored = string(value["not_stored"], "not_stored");
    step.tolerances = tolerances(value["tolerances"]);
    step.loss_eager = optional_number(value["loss"]["eager"], "loss.eager");
    step.loss_compiled = optional_number(value["loss"]["compiled"], "loss.compiled");
    step.no_reference_calls = static_cast<std::size_t>(
        integer(value["result"]["no_reference_calls"], "result.no_reference_calls"));
    for (const auto& [module, attributes] : object(value["modules"], "modules")) {
      step.modules[module] = strings(attributes, "modules");
    }
    for (const Value& row : array(value["rows"], "rows")) step.rows.push_back(this->row(row));
    const Value& cause = value["root_cause"];
    if (!cause.is_null()) {
      step.root_cause.forward = finding(cause["forward"], step);
      step.root_cause.backward = finding(cause["backward"], step);
      step.root_cause.next = string(cause["next"], "root_cause.next");
    }
    for (const Value& ops : array(value["ops"], "ops")) step.ops.push_back(this->ops(ops));
    return step;
  }

  RankComparison rank(const Value& value) const {
    RankComparison rank;
    rank.rank = static_cast<int>(integer(value["rank"], "rank"));
    rank.scenario = string(value["scenario"], "scenario");
    rank.path = string(value["path"], "path");
    rank.compiled_path = string(value["compiled_path"], "compiled_path");
    Comparison& c = rank.comparison;
    c.eager_provenance = strings(value["provenance"]["eager"], "provenance.eager");
    c.compiled_provenance = strings(value["provenance"]["compiled"], "provenance.compiled");
    c.separate_dumps = boolean(value["separate_dumps"], "separate_dumps");
    c.compiled_baseline = boolean(value["compiled_baseline"], "compiled_baseline");
    for (const Value& d : array(value["provenance_differences"], "provenance_differences")) {
      c.provenance_differences.push_back({string(d["key"], "key"), string(d["eager"], "eager"),
                                          string(d["compiled"], "compiled")});
    }
    c.warnings = string_list(value["warnings"], "warnings");
    for (const Value& step : array(value["steps"], "steps")) c.steps.push_back(this->step(step));
    return rank;
  }

 private:
  std::string name_;
};

}  // namespace

std::vector<RankComparison> read_json_reports(const std::vector<JsonReport>& reports) {
  std::map<int, RankComparison> ranks;
  std::map<std::pair<int, std::int64_t>, std::string> seen;  // (rank, step) -> the report
  for (const JsonReport& report : reports) {
    const Value document = Parser(report.text, report.name).document();
    const Reader reader(report.name);
    for (const Value& value : reader.array(document["ranks"], "ranks")) {
      RankComparison rank = reader.rank(value);
      for (const StepReport& step : rank.comparison.steps) {
        const auto [at, added] = seen.emplace(std::pair{rank.rank, step.step}, report.name);
        if (!added) {
          throw UsageError("rank " + std::to_string(rank.rank) + " step " +
                           std::to_string(step.step) + " is in both " + at->second + " and " +
                           report.name + "; merge reports of different ranks or steps");
        }
      }
      auto [kept, first] = ranks.emplace(rank.rank, rank);
      if (first) continue;
      Comparison& into = kept->second.comparison;
      for (StepReport& step : rank.comparison.steps) into.steps.push_back(std::move(step));
      std::sort(into.steps.begin(), into.steps.end(),
                [](const StepReport& a, const StepReport& b) { return a.step < b.step; });
      for (std::string& warning : rank.comparison.warnings) {
        if (std::find(into.warnings.begin(), into.warnings.end(), warning) == into.warnings.end()) {
          into.warnings.push_back(std::move(warning));
        }
      }
    }
  }
  std::vector<RankComparison> out;
  for (auto& [rank, comparison] : ranks) out.push_back(std::move(comparison));
  return out;
}

}  // namespace dynaprobe::analyze

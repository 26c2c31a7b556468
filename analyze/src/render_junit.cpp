// The JUnit XML report (docs/report-format.md#junit): what CI systems read. One <testsuite> per
// (rank, step), one <testcase> per module, named as CI lists them ("dynaprobe.rank0.step3" ::
// "layers.1"). A testcase fails exactly when its module makes the step's RESULT line FAILED (a
// FAIL or a WARN row), so a suite has failures exactly when its step FAILED: the loss check and a
// step where nothing was compared are testcases of their own.
#include <cmath>
#include <cstdio>
#include <map>
#include <ostream>
#include <stdexcept>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/root_cause.h"
#include "report_text.h"

namespace dynaprobe::analyze {
namespace {

// Text and attribute values: printable_name() first (valid UTF-8, no control characters, which
// XML 1.0 forbids even as references), then the five characters XML reserves.
std::string xml(const std::string& raw) {
  std::string out;
  for (char c : formats::printable_name(raw)) {
    const char* entity = detail::markup_entity(c);
    if (entity != nullptr) {
      out += entity;
    } else {
      out += c;
    }
  }
  return out;
}

// Text of several lines: each made safe as xml() makes it, the newlines kept.
std::string xml_lines(const std::string& text) {
  std::string out;
  for (std::size_t start = 0; start < text.size();) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out += xml(text.substr(start, end - start));
    if (end < text.size()) out += '\n';
    start = end + 1;
  }
  return out;
}

// One failing row, as the failure text lists it: "FAIL fwd_output[0] max_abs=... shape=(3,)".
std::string row_line(const Row& row) {
  std::string out(status_name(row.status));
  if (!row.kind) return out + " note " + detail::row_note(row);
  out += ' ';
  out += formats::kind_name(*row.kind);
  out += '[';  // appended piece by piece: GCC 12's -Wrestrict misfires on "[" + std::string
  out += std::to_string(row.tensor_index);
  out += ']';
  if (row.metrics || row.shape_mismatch()) {
    const detail::Numbers n = detail::numbers(row);
    out += " max_abs=" + format_float(n.max_abs, "%.3e") +
           " mean_abs=" + format_float(n.mean_abs, "%.3e") +
           " max_rel=" + format_float(n.max_rel, "%.3e");
  }
  out += " shape=" + detail::shape_text(row);
  const std::string note = detail::row_note(row);
  if (!note.empty()) out += " " + note;
  return out;
}

// The step's root cause, as the text report's ROOT CAUSE section has it; empty when nothing FAILs.
std::string root_cause_lines(const StepReport& step) {
  const RootCause& cause = step.root_cause;
  if (cause.empty()) return "";
  std::string out = "root cause of the step:\n";
  if (cause.forward) out += "  forward   " + describe_finding(step, *cause.forward) + "\n";
  if (cause.backward) out += "  backward  " + describe_finding(step, *cause.backward) + "\n";
  out += "  next      " + cause.next + "\n";
  return out;
}

struct Case {
  std::string name;
  std::string failure_type;  // "FAIL" or "WARN"; empty for a pass or a skip
  std::string message;
  std::string text;
  std::string skipped;  // why it was skipped; empty unless every row is a SKIP
  bool skip = false;
};

// The testcases of one step, modules in report order.
std::vector<Case> step_cases(const StepReport& step) {
  std::vector<std::string> order;
  std::map<std::string, std::vector<const Row*>> by_module;
  for (const Row& row : step.rows) {
    if (!by_module.count(row.module)) order.push_back(row.module);
    by_module[row.module].push_back(&row);
  }
  const std::string cause = root_cause_lines(step);
  std::vector<Case> cases;
  for (const std::string& module : order) {
    Case c;
    c.name = module;
    std::size_t fail = 0, warn = 0, pass = 0;
    std::string lines;
    for (const Row* row : by_module[module]) {
      if (row->status == Status::kFail || row->status == Status::kWarn) {
        (row->status == Status::kFail ? fail : warn) += 1;
        lines += row_line(*row) + "\n";
      } else if (row->status == Status::kPass) {
        ++pass;
      } else if (c.skipped.empty()) {
        c.skipped = detail::row_note(*row);
      }
    }
    if (fail + warn > 0) {
      c.failure_type = fail ? "FAIL" : "WARN";
      c.message = std::to_string(fail) + " FAIL, " + std::to_string(warn) +
                  " WARN: " + lines.substr(0, lines.find('\n'));
      c.text = lines + cause;
    } else {
      c.skip = pass == 0;
    }
    cases.push_back(std::move(c));
  }
  const Status loss = step.loss_status();
  if (step.loss_compiled) {  // a loss check, as loss_status() has it
    Case c;
    c.name = "(loss)";
    if (loss == Status::kFail) {
      c.failure_type = "FAIL";
      c.message = "loss eager=" + format_float(step.loss_eager.value_or(NAN), "%.6f") +
                  " compiled=" + format_float(step.loss_compiled.value_or(NAN), "%.6f");
      c.text = c.message + "\n" + cause;
    }
    cases.push_back(std::move(c));
  }
  if (step.counts().nothing_compared()) {
    Case c;
    c.name = "(nothing compared)";
    c.failure_type = "FAIL";
    c.message = "no tensor was compared on both sides: the step is not a pass";
    c.text = c.message + "\n";
    cases.push_back(std::move(c));
  }
  return cases;
}

std::string counts_attributes(std::size_t tests, std::size_t failures, std::size_t skipped) {
  return " tests=\"" + std::to_string(tests) + "\" failures=\"" + std::to_string(failures) +
         "\" errors=\"0\" skipped=\"" + std::to_string(skipped) + "\"";
}

// The <testsuites> element states the run's counts before its suites, so the suites wait in a
// temporary file (never all in memory) until the run ends.
class JunitWriter : public ReportWriter {
 public:
  explicit JunitWriter(std::ostream& out) : out_(out), suites_(std::tmpfile()) {
    if (!suites_) throw std::runtime_error("JUnit report: cannot create a temporary file");
  }
  ~JunitWriter() override { std::fclose(suites_); }
  void add_step(const RankComparison& rank, const StepReport& step) override {
    std::string classname = "dynaprobe.rank" + std::to_string(rank.rank);
    if (!rank.scenario.empty()) classname += "." + rank.scenario;
    classname += ".step" + std::to_string(step.step);
    const std::string name = xml(classname);
    std::size_t suite_failures = 0, suite_skipped = 0;
    std::string body;
    const std::vector<Case> cases = step_cases(step);
    for (const Case& c : cases) {
      body += "    <testcase classname=\"" + name + "\" name=\"" + xml(c.name) + "\"";
      if (!c.failure_type.empty()) {
        ++suite_failures;
        body += ">\n      <failure type=\"" + c.failure_type + "\" message=\"" + xml(c.message) +
                "\">" + xml_lines(c.text) + "</failure>\n    </testcase>\n";
      } else if (c.skip) {
        ++suite_skipped;
        body += ">\n      <skipped message=\"" + xml(c.skipped) + "\"/>\n    </testcase>\n";
      } else {
        body += "/>\n";
      }
    }
    const std::string suite = "  <testsuite name=\"" + name + "\"" +
                              counts_attributes(cases.size(), suite_failures, suite_skipped) +
                              ">\n" + body + "  </testsuite>\n";
    if (std::fwrite(suite.data(), 1, suite.size(), suites_) != suite.size()) {
      throw std::runtime_error("JUnit report: cannot write its temporary file");
    }
    tests_ += cases.size();
    failures_ += suite_failures;
    skipped_ += suite_skipped;
  }
  void end_rank(const RankComparison&, bool) override {}
  void finish(const RunTotals&) override {
    out_ << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"dynaprobe\""
         << counts_attributes(tests_, failures_, skipped_) << ">\n";
    std::rewind(suites_);
    char buffer[1 << 16];
    for (std::size_t n; (n = std::fread(buffer, 1, sizeof(buffer), suites_)) > 0;) {
      out_.write(buffer, static_cast<std::streamsize>(n));
    }
    out_ << "</testsuites>\n";
    out_.flush();
  }

 private:
  std::ostream& out_;
  std::FILE* suites_;
  std::size_t tests_ = 0, failures_ = 0, skipped_ = 0;
};

}  // namespace

std::unique_ptr<ReportWriter> open_junit(std::ostream& out, const RunShape&) {
  return std::make_unique<JunitWriter>(out);
}

}  // namespace dynaprobe::analyze

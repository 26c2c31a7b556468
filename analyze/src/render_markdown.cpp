// The Markdown report (docs/report-format.md#markdown): a GitHub Actions job summary
// ($GITHUB_STEP_SUMMARY), in GitHub-flavoured Markdown. The verdict and counts, a table of the
// failing rows of every (rank, step), and the root cause where it was first seen.
#include <cmath>
#include <optional>
#include <ostream>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/root_cause.h"
#include "report_text.h"

namespace dynaprobe::analyze {
namespace {

// The table lists this many rows at most: a job summary is capped at 1 MiB, and the full reports
// (JSON, HTML) hold every row.
constexpr std::size_t kMaxTableRows = 200;

// Text in a table cell or a list item: printable_name() (one line, valid UTF-8), Markdown's
// punctuation backslash-escaped ("|" would end the cell) and HTML's characters as entities (GitHub
// drops what it reads as a tag).
std::string md(const std::string& raw) {
  std::string out;
  for (char c : formats::printable_name(raw)) {
    if (const char* entity = detail::markup_entity(c)) {
      out += entity;
      continue;
    }
    switch (c) {
      case '|':
      case '\\':
      case '`':
      case '*':
      case '_':
      case '[':
      case ']':
      case '#':
      case '~':
        out += '\\';
        out += c;
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string plural(std::size_t n, const char* word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

// Keeps the first kMaxTableRows failing rows and the root cause of the earliest failing step;
// the verdict and counts come from the run's totals.
class MarkdownWriter : public ReportWriter {
 public:
  explicit MarkdownWriter(std::ostream& out) : out_(out) {}
  void add_step(const RankComparison& rank, const StepReport& step) override {
    const StepCounts counts = step.counts();
    for (const Row& row : step.rows) {
      if (row.status != Status::kFail && row.status != Status::kWarn) continue;
      std::string check = "note";
      if (row.kind) {
        check = std::string(formats::kind_name(*row.kind)) + "[" +
                std::to_string(row.tensor_index) + "]";
      }
      const std::string note = detail::row_note(row);
      if (!note.empty() && !row.metrics) check += " " + note;
      std::string max_abs;
      if (row.metrics || row.shape_mismatch()) {
        max_abs = format_float(detail::numbers(row).max_abs, "%.3e");
      }
      add(rank.rank, step.step, row.module, check, status_name(row.status), max_abs);
    }
    if (counts.loss_failed) {
      std::string diff;
      if (step.loss_eager && step.loss_compiled && !step.single_pass) {
        diff = format_float(std::fabs(*step.loss_eager - *step.loss_compiled), "%.3e");
      }
      add(rank.rank, step.step, "(loss)", "loss", "FAIL", diff);
    }
    if (counts.nothing_compared())
      add(rank.rank, step.step, "(step)", "nothing compared", "FAIL", "");
    const bool earlier =
        !cause_ || step.step < cause_step_ || (step.step == cause_step_ && rank.rank < cause_rank_);
    if (step.root_cause.found() && earlier) {
      const RootCause& root = step.root_cause;
      cause_ = "\n### Root cause (first seen at rank " + std::to_string(rank.rank) + ", step " +
               std::to_string(step.step) + ")\n\n";
      if (root.forward) {
        *cause_ += "- **forward**: " + md(describe_finding(step, *root.forward)) + "\n";
      }
      if (root.backward) {
        *cause_ += "- **backward**: " + md(describe_finding(step, *root.backward)) + "\n";
      }
      *cause_ += "- **next**: " + md(root.next) + "\n";
      cause_rank_ = rank.rank;
      cause_step_ = step.step;
    }
  }
  void end_rank(const RankComparison&, bool) override {}
  void finish(const RunTotals& totals) override {
    out_ << "## dynaprobe: " << verdict_text(totals.all_pass) << "\n\n"
         << totals.failed_steps << " of " << plural(totals.steps, "step") << " failed across "
         << plural(totals.ranks, "rank") << ". Rows: " << totals.fail << " FAIL, " << totals.warn
         << " WARN, " << totals.pass << " PASS, " << totals.skip << " SKIP.\n";
    if (table_rows_) {
      out_ << "\n| rank | step | module | check | status | max_abs |\n"
           << "| ---: | ---: | --- | --- | --- | ---: |\n"
           << table_;
      if (table_rows_ > kMaxTableRows) {
        out_ << "\n"
             << table_rows_ - kMaxTableRows
             << " more failing rows: the JSON and HTML reports list every row.\n";
      }
    }
    if (cause_) out_ << *cause_;
    if (!totals.warnings.empty()) {
      out_ << "\n### Run warnings\n\n";
      for (const std::string& warning : totals.warnings) out_ << "- " << md(warning) << "\n";
    }
    out_.flush();
  }

 private:
  void add(int rank, std::int64_t step, const std::string& module, const std::string& check,
           std::string_view status, const std::string& max_abs) {
    if (++table_rows_ > kMaxTableRows) return;
    table_ += "| " + std::to_string(rank) + " | " + std::to_string(step) + " | " + md(module) +
              " | " + md(check) + " | " + std::string(status) + " | " + max_abs + " |\n";
  }

  std::ostream& out_;
  std::string table_;
  std::size_t table_rows_ = 0;
  std::optional<std::string> cause_;
  int cause_rank_ = 0;
  std::int64_t cause_step_ = 0;
};

}  // namespace

std::unique_ptr<ReportWriter> open_markdown(std::ostream& out, const RunShape&) {
  return std::make_unique<MarkdownWriter>(out);
}

}  // namespace dynaprobe::analyze

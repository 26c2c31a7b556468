// The Markdown report (docs/report-format.md#markdown): a GitHub Actions job summary
// ($GITHUB_STEP_SUMMARY), in GitHub-flavoured Markdown. The verdict and counts, a table of the
// failing rows of every (rank, step), and the root cause where it was first seen.
#include <cmath>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/root_cause.h"
#include "report_common.h"

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

}  // namespace

std::string render_markdown(const std::vector<RankComparison>& ranks) {
  std::size_t steps = 0, failed_steps = 0, fail = 0, warn = 0, pass = 0, skip = 0;
  std::size_t table_rows = 0;
  bool all_pass = !ranks.empty();
  std::string table;
  const RankComparison* cause_rank = nullptr;
  const StepReport* cause_step = nullptr;
  auto add = [&](int rank, std::int64_t step, const std::string& module, const std::string& check,
                 std::string_view status, const std::string& max_abs) {
    if (++table_rows > kMaxTableRows) return;
    table += "| " + std::to_string(rank) + " | " + std::to_string(step) + " | " + md(module) +
             " | " + md(check) + " | " + std::string(status) + " | " + max_abs + " |\n";
  };
  for (const RankComparison& rank : ranks) {
    all_pass = all_pass && rank.comparison.all_pass();
    for (const StepReport& step : rank.comparison.steps) {
      const StepCounts counts = step.counts();
      ++steps;
      failed_steps += counts.all_pass() ? 0 : 1;
      fail += counts.fail;
      warn += counts.warn;
      pass += counts.pass;
      skip += counts.skip;
      if (!cause_step && !step.root_cause.empty()) {
        cause_rank = &rank;
        cause_step = &step;
      }
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
      if (counts.nothing_compared()) {
        add(rank.rank, step.step, "(step)", "nothing compared", "FAIL", "");
      }
    }
  }

  std::string out = "## dynaprobe: " + std::string(all_pass ? "ALL PASS" : "FAILED") + "\n\n";
  out += std::to_string(failed_steps) + " of " + plural(steps, "step") + " failed across " +
         plural(ranks.size(), "rank") + ". Rows: " + std::to_string(fail) + " FAIL, " +
         std::to_string(warn) + " WARN, " + std::to_string(pass) + " PASS, " +
         std::to_string(skip) + " SKIP.\n";
  if (table_rows) {
    out += "\n| rank | step | module | check | status | max_abs |\n";
    out += "| ---: | ---: | --- | --- | --- | ---: |\n";
    out += table;
    if (table_rows > kMaxTableRows) {
      out += "\n" + std::to_string(table_rows - kMaxTableRows) +
             " more failing rows: the JSON and HTML reports list every row.\n";
    }
  }
  if (cause_step) {
    const RootCause& cause = cause_step->root_cause;
    out += "\n### Root cause (first seen at rank " + std::to_string(cause_rank->rank) + ", step " +
           std::to_string(cause_step->step) + ")\n\n";
    if (cause.forward) {
      out += "- **forward**: " + md(describe_finding(*cause_step, *cause.forward)) + "\n";
    }
    if (cause.backward) {
      out += "- **backward**: " + md(describe_finding(*cause_step, *cause.backward)) + "\n";
    }
    out += "- **next**: " + md(cause.next) + "\n";
  }
  return out;
}

}  // namespace dynaprobe::analyze

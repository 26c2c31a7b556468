// The stdout report of a run (run.h, docs/cli.md#dynaprobe-compare): one step of one rank is the
// spec's report; several open with a summary that says what is wrong on the first screen however
// many ranks and steps there are, and follow with the full reports of the first failing steps.
// What it keeps is bounded: the first table lines, the first failing steps' reports, the earliest
// root cause; every step's report (--all-steps) waits in a temporary file.
#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "dynaprobe/analyze/root_cause.h"
#include "dynaprobe/analyze/run.h"
#include "report_text.h"

namespace dynaprobe::analyze {
namespace {

// Lines of the failing-module table and of the run's warnings shown at most.
constexpr std::size_t kTableLines = 20;
constexpr std::size_t kWarningLines = 20;
constexpr std::size_t kModuleWidth = 40;

// A line of the failing table: a module of a failing step, or the step's loss or emptiness.
struct TableLine {
  int rank = 0;
  std::int64_t step = 0;
  std::string module;
  std::size_t fail = 0, warn = 0;
  std::string first_row;  // "fwd_output[0] max_abs=1.234e-01"
  std::string cause;      // "forward root cause, local"
};

// Where a line sorts: earliest step first, then rank, then root-cause order within the step.
using Place = std::tuple<std::int64_t, int, std::size_t>;

std::string check_text(const Row& row) {
  if (!row.kind) return "note " + detail::row_note(row);
  std::string out(formats::kind_name(*row.kind));
  out += '[';
  out += std::to_string(row.tensor_index);
  out += ']';
  if (row.metrics || row.shape_mismatch()) {
    out += " max_abs=" + format_float(detail::numbers(row).max_abs, "%.3e");
  } else if (!row.note.empty()) {
    out += " " + formats::printable_name(row.note);
  }
  return out;
}

// The failing modules of a step in root-cause order: the forward finding's module, the backward
// finding's, then the others as the step ran; then the loss check and an empty step.
std::vector<TableLine> failing_lines(int rank, const StepReport& step) {
  struct Module {
    std::size_t fail = 0, warn = 0;
    const Row* first = nullptr;
    std::string cause;
    std::size_t order = 0;
  };
  std::map<std::string, Module> modules;
  for (const Row& row : step.rows) {
    if (row.status != Status::kFail && row.status != Status::kWarn) continue;
    Module& module = modules[row.module];
    (row.status == Status::kFail ? module.fail : module.warn) += 1;
    if (!module.first || row.sequence < module.first->sequence) module.first = &row;
  }
  for (auto& [name, module] : modules) module.order = 2 + module.first->sequence;
  const auto mark = [&](const std::optional<Finding>& finding, const char* pass,
                        std::size_t order) {
    if (!finding) return;
    const Row& row = step.rows[finding->row];
    auto found = modules.find(row.module);
    if (found == modules.end()) return;
    found->second.order = std::min(found->second.order, order);
    found->second.first = &row;
    if (!found->second.cause.empty()) found->second.cause += "; ";
    found->second.cause += std::string(pass) + " root cause, " + finding->origin;
  };
  mark(step.root_cause.forward, "forward", 0);
  mark(step.root_cause.backward, "backward", 1);
  std::vector<std::pair<std::size_t, TableLine>> ordered;
  for (const auto& [name, module] : modules) {
    ordered.push_back({module.order,
                       {rank, step.step, name, module.fail, module.warn, check_text(*module.first),
                        module.cause}});
  }
  std::stable_sort(ordered.begin(), ordered.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<TableLine> lines;
  for (auto& [order, line] : ordered) lines.push_back(std::move(line));
  const StepCounts counts = step.counts();
  if (counts.loss_failed) {
    lines.push_back({rank, step.step, "(loss)", 1, 0, "loss check", ""});
  }
  if (counts.nothing_compared()) {
    lines.push_back({rank, step.step, "(step)", 1, 0, "nothing compared", ""});
  }
  return lines;
}

std::string plural(std::size_t n, const char* word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

class TextWriter : public ReportWriter {
 public:
  TextWriter(std::ostream& out, const RunShape& shape, TextOptions options)
      : out_(out),
        options_(std::move(options)),
        single_(shape.ranks <= 1 && !shape.several_steps),
        many_ranks_(shape.ranks > 1) {
    if (!single_ && options_.every_step) {
      spool_ = std::tmpfile();
      if (!spool_) throw std::runtime_error("the stdout report: cannot create a temporary file");
    }
  }
  ~TextWriter() override {
    if (spool_) std::fclose(spool_);
  }

  void add_step(const RankComparison& rank, const StepReport& step) override {
    if (single_) {
      out_ << render_provenance(rank.comparison) << render_text(step, options_.only_failing);
      return;
    }
    if (!provenance_) provenance_ = render_provenance(rank.comparison);
    const bool failed = !step.all_pass();
    if (failed) {
      ++failed_steps_;
      std::size_t k = 0;
      for (TableLine& line : failing_lines(rank.rank, step)) {
        keep(table_, Place{step.step, rank.rank, k++}, std::move(line), kTableLines);
        ++table_total_;
      }
    }
    if (step.root_cause.found() &&
        (!cause_ || std::tie(step.step, rank.rank) < std::tie(cause_step_, cause_rank_))) {
      const RootCause& root = step.root_cause;
      const Finding& finding = root.forward ? *root.forward : *root.backward;
      cause_ = "Root cause first seen in " +
               (many_ranks_ ? "rank " + std::to_string(rank.rank) + " " : std::string()) + "step " +
               std::to_string(step.step) + ": " + (root.forward ? "forward " : "backward ") +
               describe_finding(step, finding) + "\n";
      cause_step_ = step.step;
      cause_rank_ = rank.rank;
    }
    if (spool_) {
      const std::string text = step_report(rank, step);
      if (std::fwrite(text.data(), 1, text.size(), spool_) != text.size()) {
        throw std::runtime_error("the stdout report: cannot write its temporary file");
      }
    } else if (failed) {
      keep(reports_, Place{step.step, rank.rank, 0}, step_report(rank, step),
           options_.reports_shown);
    }
  }

  void end_rank(const RankComparison&, bool) override {}

  void finish(const RunTotals& totals) override {
    if (single_) {
      out_ << warnings_text(totals);
      out_.flush();
      return;
    }
    if (provenance_) out_ << *provenance_;
    out_ << "Summary: " << plural(totals.steps, "step")
         << (many_ranks_ ? " on " + plural(totals.ranks, "rank") : std::string()) << ", "
         << totals.steps - totals.failed_steps << " " << kVerdictAllPass;
    if (totals.failed_steps) {
      out_ << ", " << totals.failed_steps << " " << kVerdictFailed << " ("
           << plural(totals.fail, "FAIL row") << ", " << plural(totals.warn, "WARN row") << ")";
    }
    out_ << "\n" << table_text() << (cause_ ? *cause_ : "") << warnings_text(totals);
    if (!options_.full_reports.empty()) out_ << "Full reports: " << options_.full_reports << "\n";
    if (spool_) {
      out_ << "\nEvery step's report follows.\n";
      std::rewind(spool_);
      char buffer[1 << 16];
      for (std::size_t n; (n = std::fread(buffer, 1, sizeof(buffer), spool_)) > 0;) {
        out_.write(buffer, static_cast<std::streamsize>(n));
      }
    } else if (!reports_.empty()) {
      out_ << "\n"
           << (reports_.size() < failed_steps_
                   ? "The reports of the first " + std::to_string(reports_.size()) + " of " +
                         std::to_string(failed_steps_) + " failing steps follow"
                   : std::string("The report of each failing step follows"))
           << " (--all-steps prints every step's).\n";
      for (const auto& [place, text] : reports_) out_ << text;
    }
    out_.flush();
  }

 private:
  // Keeps `value` at `place` in `kept`, the first `limit` places only.
  template <typename T>
  static void keep(std::map<Place, T>& kept, Place place, T value, std::size_t limit) {
    if (limit == 0) return;
    if (kept.size() >= limit && place > std::prev(kept.end())->first) return;
    kept.emplace(place, std::move(value));
    if (kept.size() > limit) kept.erase(std::prev(kept.end()));
  }

  std::string step_report(const RankComparison& rank, const StepReport& step) const {
    std::string head = "\n";
    if (many_ranks_) {
      head +=
          "Rank " + std::to_string(rank.rank) +
          (rank.scenario.empty() ? ""
                                 : " (scenario " + formats::printable_name(rank.scenario) + ")") +
          " step " + std::to_string(step.step) + ": " +
          formats::printable_name(rank.path.string()) + "\n";
    } else {
      head += "Step " + std::to_string(step.step) + "\n";
    }
    return head + render_text(step, options_.only_failing);
  }

  std::string table_text() const {
    if (table_.empty()) return "";
    std::size_t width = 6;
    for (const auto& [place, line] : table_) {
      width = std::max(width, std::min(kModuleWidth, formats::printable_name(line.module).size()));
    }
    std::string out = "Failing modules, root cause first:\n";
    char buffer[64];
    const auto row = [&](const std::string& rank, const std::string& step,
                         const std::string& module, const std::string& fail,
                         const std::string& warn) {
      std::string text = "  ";
      if (many_ranks_) {
        std::snprintf(buffer, sizeof(buffer), "%5s  ", rank.c_str());
        text += buffer;
      }
      std::snprintf(buffer, sizeof(buffer), "%5s  ", step.c_str());
      text += buffer;
      text += module + std::string(width > module.size() ? width - module.size() : 0, ' ');
      std::snprintf(buffer, sizeof(buffer), "  %4s  %4s  ", fail.c_str(), warn.c_str());
      return text + buffer;
    };
    out += row("rank", "step", "module", "FAIL", "WARN") + "first failing row\n";
    for (const auto& [place, line] : table_) {
      std::string text = row(std::to_string(line.rank), std::to_string(line.step),
                             formats::printable_name(line.module), std::to_string(line.fail),
                             std::to_string(line.warn)) +
                         line.first_row;
      if (!line.cause.empty()) text += "  <- " + line.cause;
      out += text + "\n";
    }
    if (table_total_ > table_.size()) {
      out += "  ... and " + std::to_string(table_total_ - table_.size()) +
             " more (the JSON, JUnit and HTML reports list every one)\n";
    }
    return out;
  }

  static std::string warnings_text(const RunTotals& totals) {
    if (totals.warnings.empty()) return "";
    std::string out = "Run warnings (" + std::to_string(totals.warnings.size()) + "):\n";
    for (std::size_t i = 0; i < totals.warnings.size() && i < kWarningLines; ++i) {
      out += "  " + totals.warnings[i] + "\n";
    }
    if (totals.warnings.size() > kWarningLines) {
      out += "  ... and " + std::to_string(totals.warnings.size() - kWarningLines) +
             " more (the JSON report's summary lists them all)\n";
    }
    return out;
  }

  std::ostream& out_;
  TextOptions options_;
  bool single_;
  bool many_ranks_;
  std::FILE* spool_ = nullptr;  // every step's report, with options_.every_step
  std::optional<std::string> provenance_;
  std::map<Place, TableLine> table_;
  std::size_t table_total_ = 0;
  std::map<Place, std::string> reports_;  // the first failing steps' reports
  std::size_t failed_steps_ = 0;
  std::optional<std::string> cause_;
  std::int64_t cause_step_ = 0;
  int cause_rank_ = 0;
};

}  // namespace

std::unique_ptr<ReportWriter> open_text_report(std::ostream& out, const RunShape& shape,
                                               const TextOptions& options) {
  return std::make_unique<TextWriter>(out, shape, options);
}

}  // namespace dynaprobe::analyze

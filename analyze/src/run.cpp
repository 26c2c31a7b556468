// A whole run analysed a step at a time (run.h): the plan (ranks and steps from folder and file
// names), the loop that compares and hands each step to the writers, the run's totals and its
// consistency.
#include "dynaprobe/analyze/run.h"

#include <algorithm>
#include <charconv>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "dynaprobe/analyze/run_folders.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::analyze {
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------- IndexSet

IndexSet IndexSet::parse(const std::string& text, std::string_view option) {
  IndexSet set;
  const auto fail = [&]() -> IndexSet {
    throw UsageError(std::string(option) + ": expected " + std::string(kExpected) +
                     ", but received '" + formats::printable_name(text) + "'");
  };
  const auto number = [&](std::string_view digits) {
    std::int64_t value = -1;
    const auto parsed = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (digits.empty() || parsed.ec != std::errc() || parsed.ptr != digits.data() + digits.size() ||
        value < 0) {
      fail();
    }
    return value;
  };
  std::string_view rest = text;
  if (rest.empty()) return fail();
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const std::size_t dash = item.find('-');
    const std::int64_t first = number(item.substr(0, dash));
    const std::int64_t last =
        dash == std::string_view::npos ? first : number(item.substr(dash + 1));
    if (last < first) return fail();
    set.ranges_.emplace_back(first, last);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  std::sort(set.ranges_.begin(), set.ranges_.end());
  return set;
}

IndexSet IndexSet::of(std::vector<std::int64_t> indices) {
  std::sort(indices.begin(), indices.end());
  IndexSet set;
  for (std::int64_t index : indices) {
    if (!set.ranges_.empty() && index <= set.ranges_.back().second + 1) {
      set.ranges_.back().second = std::max(set.ranges_.back().second, index);
    } else {
      set.ranges_.emplace_back(index, index);
    }
  }
  return set;
}

bool IndexSet::contains(std::int64_t index) const {
  if (ranges_.empty()) return true;
  return std::any_of(ranges_.begin(), ranges_.end(), [&](const auto& range) {
    return range.first <= index && index <= range.second;
  });
}

std::string IndexSet::text() const {
  if (ranges_.empty()) return "all";
  std::string out;
  for (const auto& [first, last] : ranges_) {
    if (!out.empty()) out += ',';
    out += std::to_string(first);
    if (last > first) out += (last == first + 1 ? "," : "-") + std::to_string(last);
  }
  return out;
}

namespace {

// ------------------------------------------------------------------------------ consistency

namespace provenance = formats::vocabulary::provenance;

// What the ranks of a run must agree on: which run, what was captured, how, and how it is judged.
constexpr std::string_view kAgreedKeys[] = {provenance::kRun,
                                            provenance::kWorldSize,
                                            provenance::kTorchVersion,
                                            provenance::kBackend,
                                            provenance::kCompileScope,
                                            provenance::kMode,
                                            provenance::kAtol,
                                            provenance::kRtol,
                                            provenance::kToleranceRules,
                                            provenance::kDtypeAwareTolerances,
                                            provenance::kReference,
                                            provenance::kVerdict,
                                            provenance::kCastDtype,
                                            provenance::kCaptureInput,
                                            provenance::kAutocast};

// What the consistency checks keep of a rank: its folder, what its files say (its rank and the
// agreed keys), and its steps as ranges, small however long the run.
struct RankSeen {
  int rank = 0;
  fs::path path;
  std::map<std::string, std::string> provenance;
  IndexSet steps;
};

// The warnings listed for one kind of inconsistency at most; the rest are counted.
constexpr std::size_t kListed = 10;

// "ranks 0-6", "rank 7".
std::string ranks_text(const std::vector<std::int64_t>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + IndexSet::of(ranks).text();
}

// A rank folder as a warning names it: "rank5/".
std::string folder_text(const RankSeen& rank) {
  const std::string name = rank.path.filename().string();
  return formats::printable_name(name.empty() ? rank.path.string() : name) + "/";
}

// A folder named rank<R> whose files say another rank: copied or misplaced.
void check_folder_names(const std::vector<RankSeen>& ranks, std::vector<std::string>& warnings) {
  const std::string prefix(formats::schema::kRankDirPrefix);
  for (const RankSeen& rank : ranks) {
    const auto said = rank.provenance.find(std::string(provenance::kRank));
    const bool named = rank.path.filename().string() == prefix + std::to_string(rank.rank);
    if (named && said != rank.provenance.end() && said->second != std::to_string(rank.rank)) {
      const std::string other = formats::printable_name(said->second);
      warnings.push_back(folder_text(rank) + " holds the files of rank " + other +
                         " (provenance rank=" + other +
                         "): a copied or misplaced folder; its rows are reported as rank " +
                         std::to_string(rank.rank) + "'s");
    }
  }
}

// Keys the ranks disagree on, each value with the ranks that have it, the most common first.
// Returns the world size they agree on, empty if none.
std::string check_agreement(const std::vector<RankSeen>& ranks,
                            std::vector<std::string>& warnings) {
  std::string world_size;
  for (std::string_view key : kAgreedKeys) {
    std::map<std::string, std::vector<std::int64_t>> by_value;  // a rank without it: "(none)"
    bool said = false;
    for (const RankSeen& rank : ranks) said = said || rank.provenance.count(std::string(key));
    for (const RankSeen& rank : ranks) {
      const auto value = rank.provenance.find(std::string(key));
      if (said)
        by_value[value != rank.provenance.end() ? value->second : "(none)"].push_back(rank.rank);
    }
    if (by_value.size() == 1 && key == provenance::kWorldSize) world_size = by_value.begin()->first;
    if (by_value.size() < 2) continue;
    std::vector<std::pair<std::string, std::vector<std::int64_t>>> values(by_value.begin(),
                                                                          by_value.end());
    std::stable_sort(values.begin(), values.end(), [](const auto& a, const auto& b) {
      return a.second.size() > b.second.size();
    });
    std::string text = std::string(key) + " differs between ranks: ";
    for (std::size_t i = 0; i < values.size(); ++i) {
      text += (i ? ", " : "") + formats::printable_name(values[i].first) + " on " +
              ranks_text(values[i].second);
    }
    warnings.push_back(text);
  }
  return world_size;
}

// Ranks the world size has that the run lacks (within the selected ranks), and ranks beyond it.
void check_world(const std::vector<RankSeen>& ranks, const std::string& world_size,
                 const IndexSet& selected, std::vector<std::string>& warnings) {
  std::int64_t world = 0;
  const char* end = world_size.data() + world_size.size();
  const auto parsed = std::from_chars(world_size.data(), end, world);
  if (world_size.empty() || parsed.ec != std::errc() || parsed.ptr != end || world <= 0) return;
  std::set<std::int64_t> present;
  for (const RankSeen& rank : ranks) present.insert(rank.rank);
  std::vector<std::int64_t> missing, beyond;
  for (std::int64_t r = 0; r < world && r < (std::int64_t{1} << 24); ++r) {
    if (selected.contains(r) && !present.count(r)) missing.push_back(r);
  }
  for (std::int64_t r : present) {
    if (r >= world) beyond.push_back(r);
  }
  if (!missing.empty()) {
    warnings.push_back("missing " + ranks_text(missing) + " of world_size " + world_size +
                       ": no rank folder, or no selected step in it");
  }
  if (!beyond.empty()) warnings.push_back(ranks_text(beyond) + " beyond world_size " + world_size);
}

// Steps that only some ranks have, grouped by the ranks that lack them.
void check_steps(const std::vector<RankSeen>& ranks, std::vector<std::string>& warnings) {
  if (ranks.size() < 2) return;
  std::set<std::int64_t> steps;
  for (const RankSeen& rank : ranks) {
    for (const auto& [first, last] : rank.steps.ranges()) {
      for (std::int64_t step = first; step <= last && steps.size() < (1u << 20); ++step) {
        steps.insert(step);
      }
    }
  }
  std::map<std::vector<std::int64_t>, std::vector<std::int64_t>> steps_by_missing;
  for (std::int64_t step : steps) {
    std::vector<std::int64_t> missing;
    for (const RankSeen& rank : ranks) {
      if (!rank.steps.contains(step)) missing.push_back(rank.rank);
    }
    if (!missing.empty()) steps_by_missing[missing].push_back(step);
  }
  std::size_t listed = 0;
  for (const auto& [missing, group] : steps_by_missing) {
    if (++listed > kListed) {
      warnings.push_back("and " + std::to_string(steps_by_missing.size() - kListed) +
                         " more groups of steps that some ranks lack");
      break;
    }
    warnings.push_back(std::string(group.size() == 1 ? "step " : "steps ") +
                       IndexSet::of(group).text() + " only on " +
                       std::to_string(ranks.size() - missing.size()) + " of " +
                       std::to_string(ranks.size()) + " ranks: missing on " + ranks_text(missing));
  }
}

std::vector<std::string> consistency_warnings(const std::vector<RankSeen>& ranks,
                                              const IndexSet& selected) {
  std::vector<std::string> warnings;
  check_folder_names(ranks, warnings);
  const std::string world_size = check_agreement(ranks, warnings);
  check_world(ranks, world_size, selected, warnings);
  check_steps(ranks, warnings);
  return warnings;
}

// ---------------------------------------------------------------------------------- the tally

// The run's totals, kept as the steps arrive.
class RunTally {
 public:
  explicit RunTally(IndexSet selected) : selected_(std::move(selected)) {}

  void add_step(const RankComparison& rank, const StepReport& step) {
    const StepCounts counts = step.counts();
    ++totals_.steps;
    totals_.failed_steps += counts.all_pass() ? 0 : 1;
    totals_.loss_fail += counts.loss_failed ? 1 : 0;
    totals_.nothing_compared_steps += counts.nothing_compared() ? 1 : 0;
    totals_.compared += counts.compared;
    totals_.pass += counts.pass;
    totals_.fail += counts.fail;
    totals_.warn += counts.warn;
    totals_.skip += counts.skip;
    totals_.rows += step.rows.size();
    auto& first = totals_.root_cause_first_seen;
    if (step.root_cause.found() && (!first || step.step < first->step ||
                                    (step.step == first->step && rank.rank < first->rank))) {
      first = RunTotals::Place{rank.rank, step.step};
    }
    rank_steps_.push_back(step.step);
  }

  void end_rank(const RankComparison& rank, bool all_pass) {
    ++totals_.ranks;
    all_pass_ = all_pass_ && all_pass;
    RankSeen seen{rank.rank, rank.path, {}, IndexSet::of(std::move(rank_steps_))};
    rank_steps_ = {};
    const formats::Provenance& said = rank.comparison.compiled_provenance;
    for (std::string_view key : kAgreedKeys) {
      const auto value = said.find(std::string(key));
      if (value != said.end()) seen.provenance.insert(*value);
    }
    const auto rank_said = said.find(std::string(provenance::kRank));
    if (rank_said != said.end()) seen.provenance.insert(*rank_said);
    ranks_.push_back(std::move(seen));
  }

  RunTotals totals() const {
    RunTotals totals = totals_;
    totals.all_pass = all_pass_ && totals.ranks > 0;
    totals.warnings = consistency_warnings(ranks_, selected_);
    return totals;
  }

 private:
  IndexSet selected_;
  RunTotals totals_;
  bool all_pass_ = true;
  std::vector<std::int64_t> rank_steps_;  // of the rank being given
  std::vector<RankSeen> ranks_;
};

// A rank passes when it has a step and every step passes.
bool rank_passes(const std::vector<bool>& steps_pass) {
  return !steps_pass.empty() &&
         std::all_of(steps_pass.begin(), steps_pass.end(), [](bool pass) { return pass; });
}

// The steps a dump's committed files hold, from their names (a file renamed by hand is opened).
std::vector<std::int64_t> dump_steps(const fs::path& dump) {
  const formats::DumpFiles files = formats::list_dump(dump);
  require_committed_steps(dump, files);
  std::set<std::int64_t> steps;
  for (const fs::path& file : files.steps) {
    const auto step = formats::step_of_file_name(file);
    steps.insert(step ? *step : formats::StepReader(file).step());
  }
  return {steps.begin(), steps.end()};
}

}  // namespace

// --------------------------------------------------------------------------------- the run

RunPlan plan_run(const fs::path& eager_run, const fs::path& compiled_run,
                 const RunOptions& options) {
  RunPlan plan;
  std::error_code error;
  plan.same = fs::equivalent(eager_run, compiled_run, error);
  const std::vector<RankDump> eager = find_rank_dumps(eager_run);
  const std::vector<RankDump> compiled = plan.same ? eager : find_rank_dumps(compiled_run);
  if (compiled.size() != eager.size()) {
    throw UsageError(eager_run.string() + " has " + std::to_string(eager.size()) + " rank(s) but " +
                     compiled_run.string() + " has " + std::to_string(compiled.size()) +
                     "; compare runs with the same ranks, or name one rank folder each");
  }
  plan.selected_ranks = options.ranks;
  std::vector<std::int64_t> all_ranks, all_steps;
  for (std::size_t i = 0; i < eager.size(); ++i) {
    all_ranks.push_back(eager[i].rank);
    if (!options.ranks.contains(eager[i].rank)) continue;
    std::vector<std::int64_t> steps = dump_steps(eager[i].path);
    if (!plan.same) {
      const std::vector<std::int64_t> more = dump_steps(compiled[i].path);
      std::vector<std::int64_t> both;
      std::set_union(steps.begin(), steps.end(), more.begin(), more.end(),
                     std::back_inserter(both));
      steps = std::move(both);
    }
    all_steps.insert(all_steps.end(), steps.begin(), steps.end());
    std::erase_if(steps, [&](std::int64_t step) { return !options.steps.contains(step); });
    if (steps.empty()) continue;
    plan.shape.several_steps = plan.shape.several_steps || steps.size() > 1;
    plan.ranks.push_back({eager[i].rank, eager[i].path, compiled[i].path, std::move(steps)});
  }
  if (plan.ranks.empty()) {
    const bool no_rank = std::none_of(all_ranks.begin(), all_ranks.end(),
                                      [&](std::int64_t r) { return options.ranks.contains(r); });
    if (no_rank) {
      throw UsageError("--ranks " + options.ranks.text() + " matches no rank of " +
                       eager_run.string() + "; its ranks are " + IndexSet::of(all_ranks).text());
    }
    throw UsageError("--steps " + options.steps.text() + " matches no step of " +
                     eager_run.string() + "; its steps are " + IndexSet::of(all_steps).text() +
                     ": give some of them, or leave --steps out to compare every step");
  }
  plan.shape.ranks = plan.ranks.size();
  // A --module that matches nothing is a typo: said before anything is compared, naming the
  // modules of the first rank (the ranks are tried in turn until one has a match).
  const std::string& glob = options.compare.module_glob;
  for (std::size_t i = 0; !glob.empty() && i < plan.ranks.size(); ++i) {
    try {
      check_module_glob(plan.ranks[i].eager, plan.ranks[i].compiled, glob);
      break;
    } catch (const UsageError&) {
      if (i + 1 == plan.ranks.size()) throw;
    }
  }
  return plan;
}

RunTotals analyze_run(const RunPlan& plan, const RunOptions& options,
                      const std::vector<ReportWriter*>& writers) {
  RunTally tally(plan.selected_ranks);
  CompareOptions step_options = options.compare;
  step_options.require_module_match = false;
  for (const RunPlan::Rank& planned : plan.ranks) {
    RankComparison rank;
    rank.rank = planned.rank;
    rank.path = planned.eager;
    rank.compiled_path = planned.compiled;
    if (options.read_graphs) rank.graphs = read_graphs(planned.compiled);
    std::set<std::string> warned;
    std::vector<bool> steps_pass;
    const formats::DumpFiles eager_files = formats::list_dump(planned.eager);
    const formats::DumpFiles compiled_files =
        plan.same ? formats::DumpFiles{} : formats::list_dump(planned.compiled);
    for (std::int64_t step : planned.steps) {
      step_options.step = step;
      Comparison comparison = compare_listed(planned.eager, eager_files, planned.compiled,
                                             compiled_files, plan.same, step_options);
      if (steps_pass.empty()) {  // the rank's provenance, from its first step
        rank.comparison.eager_provenance = comparison.eager_provenance;
        rank.comparison.compiled_provenance = comparison.compiled_provenance;
        rank.comparison.separate_dumps = comparison.separate_dumps;
        rank.comparison.compiled_baseline = comparison.compiled_baseline;
        rank.comparison.provenance_differences = comparison.provenance_differences;
        rank.scenario =
            formats::provenance_value(comparison.compiled_provenance, provenance::kScenario);
      }
      for (std::string& warning : comparison.warnings) {
        if (!warned.insert(warning).second) continue;
        if (options.warn) options.warn(warning);
        rank.comparison.warnings.push_back(std::move(warning));
      }
      for (const StepReport& report : comparison.steps) {
        steps_pass.push_back(report.all_pass());
        tally.add_step(rank, report);
        for (ReportWriter* writer : writers) writer->add_step(rank, report);
      }
    }
    const bool all_pass = rank_passes(steps_pass);
    tally.end_rank(rank, all_pass);
    for (ReportWriter* writer : writers) writer->end_rank(rank, all_pass);
  }
  const RunTotals totals = tally.totals();
  for (ReportWriter* writer : writers) writer->finish(totals);
  return totals;
}

RunTotals write_run(const std::vector<RankComparison>& ranks,
                    const std::vector<ReportWriter*>& writers) {
  RunTally tally{IndexSet()};
  for (const RankComparison& rank : ranks) {
    RankComparison header = rank;
    header.comparison.steps.clear();
    for (const StepReport& step : rank.comparison.steps) {
      tally.add_step(header, step);
      for (ReportWriter* writer : writers) writer->add_step(header, step);
    }
    const bool all_pass = rank.comparison.all_pass();
    tally.end_rank(header, all_pass);
    for (ReportWriter* writer : writers) writer->end_rank(header, all_pass);
  }
  const RunTotals totals = tally.totals();
  for (ReportWriter* writer : writers) writer->finish(totals);
  return totals;
}

// A report format's rendering of comparisons already made (report.h): here, because it runs
// the run's writer loop (write_run).
std::string ReportFormat::render(const std::vector<RankComparison>& ranks) const {
  std::ostringstream out;
  const std::unique_ptr<ReportWriter> writer = open(out, RunShape::of(ranks));
  write_run(ranks, {writer.get()});
  return std::move(out).str();
}

std::string render_merged_csv(const std::vector<RankComparison>& ranks) {
  return report_format("merged-csv").render(ranks);
}
std::string render_json(const std::vector<RankComparison>& ranks) {
  return report_format("json").render(ranks);
}
std::string render_html(const std::vector<RankComparison>& ranks) {
  return report_format("html").render(ranks);
}
std::string render_junit(const std::vector<RankComparison>& ranks) {
  return report_format("junit").render(ranks);
}
std::string render_markdown(const std::vector<RankComparison>& ranks) {
  return report_format("markdown").render(ranks);
}

}  // namespace dynaprobe::analyze

#include "dynaprobe/analyze/run_folders.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <string>
#include <utility>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/record.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::analyze {
namespace fs = std::filesystem;
using formats::StepReader;
namespace vocabulary = formats::vocabulary;

std::vector<RankDump> find_rank_dumps(const fs::path& path) {
  std::error_code error;
  if (!fs::exists(path, error)) {
    throw IoError(path.string() +
                  ": no such file or folder (expected a run folder, a dump folder or a step file)");
  }
  std::vector<RankDump> ranks;
  if (fs::is_directory(path, error)) {
    const std::string prefix(formats::schema::kRankDirPrefix);
    for (const auto& entry : fs::directory_iterator(path, error)) {
      const std::string name = entry.path().filename().string();
      int rank = 0;
      if (entry.is_directory() && name.starts_with(prefix) &&
          std::from_chars(name.data() + prefix.size(), name.data() + name.size(), rank).ec ==
              std::errc()) {
        ranks.push_back({rank, entry.path()});
      }
    }
  }
  if (ranks.empty()) {
    // A dump itself: its rank comes from the provenance of its files.
    int rank = 0;
    const auto files = formats::list_dump(path);
    if (!files.steps.empty()) {
      StepReader reader(files.steps.front());
      auto value = reader.provenance().find(std::string(vocabulary::provenance::kRank));
      if (value != reader.provenance().end()) rank = std::atoi(value->second.c_str());
    }
    ranks.push_back({rank, path});
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const RankDump& a, const RankDump& b) { return a.rank < b.rank; });
  return ranks;
}

namespace {

// Whether `folder` holds a run or a dump: rank<R>/ folders or step files.
bool holds_dump(const fs::path& folder) {
  std::error_code error;
  const std::string prefix(formats::schema::kRankDirPrefix);
  for (const auto& entry : fs::directory_iterator(folder, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory(error) && name.starts_with(prefix)) return true;
  }
  const auto files = formats::list_dump(folder);
  return !files.steps.empty() || !files.unfinished.empty();
}

}  // namespace

fs::file_time_type last_written(const fs::path& run) {
  std::error_code error;
  fs::file_time_type newest = fs::last_write_time(run, error);
  for (const auto& entry : fs::recursive_directory_iterator(run, error)) {
    const auto time = entry.last_write_time(error);
    if (!error && time > newest) newest = time;
  }
  return newest;
}

NewestRun newest_run(const fs::path& path) {
  std::error_code error;
  if (!fs::is_directory(path, error) || holds_dump(path)) return {path, {}};
  std::vector<std::pair<fs::file_time_type, fs::path>> runs;
  for (const auto& entry : fs::directory_iterator(path, error)) {
    if (entry.is_directory(error) && holds_dump(entry.path())) {
      runs.emplace_back(last_written(entry.path()), entry.path());
    }
  }
  if (runs.empty()) return {path, {}};
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second > b.second;
  });
  NewestRun result{runs.front().second, {}};
  for (const auto& [time, run] : runs) result.runs.push_back(run);
  return result;
}

ChosenRun choose_run(std::string_view command, const fs::path& path) {
  NewestRun newest = newest_run(path);
  if (newest.runs.empty()) return {path, ""};
  constexpr std::size_t kShown = 4;
  const std::string name(command);
  std::string said = "dynaprobe: " + path.string() + " holds " +
                     std::to_string(newest.runs.size()) + " run(s); " + name +
                     " reads the newest, " + newest.path.string();
  for (std::size_t i = 1; i < newest.runs.size() && i <= kShown; ++i) {
    said += (i > 1 ? ", " : "; the others: ") + newest.runs[i].filename().string();
  }
  if (newest.runs.size() > kShown + 1) said += ", ...";
  if (newest.runs.size() > 1) {
    said += " (name one to read it: dynaprobe " + name + " " +
            (path / newest.runs[1].filename()).string() + ")";
  }
  return {std::move(newest.path), formats::printable_name(said)};
}

}  // namespace dynaprobe::analyze

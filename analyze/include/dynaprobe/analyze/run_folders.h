// Where the dumps of a run are: the rank folders of a run folder, the newest run of a folder of
// runs (dynaprobe_runs/), when a run was last written. Finds paths and reads no tensor; the run
// analysis (run.h) and the CLI use it.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dynaprobe::analyze {

// The rank dumps of a run folder ("rank<R>/" sub-folders), or the path itself when it is a dump.
struct RankDump {
  int rank = 0;
  std::filesystem::path path;
};
std::vector<RankDump> find_rank_dumps(const std::filesystem::path& path);

// A folder of runs (dynaprobe_runs/, where PrecisionChecker puts one timestamped run per
// process) stands for its newest run, the one most recently written: `path` is that run and
// `runs` every run it holds, newest first. Any other path (a run, a dump, a step file) is itself,
// with `runs` empty.
struct NewestRun {
  std::filesystem::path path;
  std::vector<std::filesystem::path> runs;
};
NewestRun newest_run(const std::filesystem::path& path);

// The run `command` (a dynaprobe command: "compare", "bundle") reads for `path`: the newest run of
// a folder of runs, else `path` itself; and, when it chose among runs, what it says of its choice
// on stderr ("dynaprobe: dynaprobe_runs holds 3 run(s); compare reads the newest, ..."), else "".
struct ChosenRun {
  std::filesystem::path path;
  std::string said;
};
ChosenRun choose_run(std::string_view command, const std::filesystem::path& path);

// When a run (or any folder) was last written: its newest file or folder, the folder included.
std::filesystem::file_time_type last_written(const std::filesystem::path& run);

}  // namespace dynaprobe::analyze

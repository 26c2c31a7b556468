// What the dynaprobe command line's files share: exit codes, the errors that carry them, a
// parsed command ready to run, and the writing of report files. One file per subcommand
// (compare.cpp, ls.cpp, graphs.cpp), each with an options struct, setup_x(CLI::App&, ...) and
// run_x(const XOptions&), as CLI11's own examples split them; main.cpp parses and dispatches, and
// contain.cpp runs the command in a child process (dumps are untrusted input).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dynaprobe/analyze/report.h"

namespace dynaprobe::cli {

// docs/cli.md#exit-codes.
enum ExitCode : int {
  kExitPass = 0,      // success; compare: every step of every rank is ALL PASS
  kExitMismatch = 1,  // compare: not all pass
  kExitUsage = 2,     // the command line, or what it asks for, cannot work
  kExitIo = 3,        // a path, file or dump that cannot be read or written; a reader that crashed
};

// An error of the command line itself, with the exit code it means.
class CliError : public std::runtime_error {
 public:
  CliError(ExitCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ExitCode exit_code() const { return code_; }

 private:
  ExitCode code_;
};

// An error as the user sees it: the message (without the "dynaprobe: error: " prefix) and the
// exit code. Maps dynaprobe's exception hierarchy in one place: UsageError is 2, FormatError and
// IoError are 3, std::bad_alloc is "out of memory" (3, as a reader past --memory-limit), anything
// else is an internal error (3) that asks to be reported.
struct Failure {
  ExitCode code;
  std::string message;
};
Failure failure_of(std::exception_ptr error, const std::string& reading);

// A parsed subcommand, ready to run: the dumps it reads (for messages about a reader that
// crashed) and the command itself, which returns its exit code and throws on errors.
struct Command {
  std::string reads;
  std::function<int()> run;
};

// Writes a report or a graph file, creating its folder. Refuses a symbolic link at the name
// (O_NOFOLLOW), so nothing is written outside the folder given. Throws IoError.
void write_text_file(const std::filesystem::path& path, const std::string& text);

// A report file written as it is made (a run's streamed reports), opened as write_text_file
// opens its file. close() throws IoError when any of it could not be written.
class OutputFile {
 public:
  explicit OutputFile(std::filesystem::path path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  std::ostream& stream();
  void close();
  const std::filesystem::path& path() const { return path_; }

 private:
  struct Open;
  std::filesystem::path path_;
  std::unique_ptr<Open> open_;
};

// A name from a dump, printable on one line (formats::printable_name); valid until the next
// call on this thread, so use it once per printf.
const char* printable(const std::string& name);

// The dump a command reads: `path`, or for a folder of runs its newest run, said on stderr with
// the others and how to pick one (analyze::choose_run).
std::string chosen_dump(const std::string& command, const std::string& path);

// The subcommands. setup_x adds the subcommand to `app`; when it is the one parsed, `selected`
// is set to run it with the parsed options.
// What compare and merge write: the stdout report and the report files asked for.
struct ReportOptions {
  std::string csv;  // the 9-column CSV, one file per rank
  std::map<std::string, std::string>
      reports;             // report format name (analyze::report_formats()) -> PATH
  bool all_steps = false;  // every step's full report after a run's summary
  bool failing = false;    // each report's FAIL and WARN rows alone
};
// Writes the stdout report and the report files of a run: `run` gives the writers the run (and
// reads the compiled side's graphs when `read_graphs`). Returns the exit code of its verdict.
int write_reports(const analyze::RunShape& shape, const ReportOptions& options,
                  const std::function<analyze::RunTotals(
                      const std::vector<analyze::ReportWriter*>& writers, bool read_graphs)>& run);
// Adds --csv, --all-steps and an option per registered report format to `sub`.
void add_report_options(CLI::App& sub, ReportOptions& options);

struct CompareOptions : ReportOptions {
  std::string dump, dump2;
  std::optional<double> atol, rtol;
  std::vector<std::string> tolerance_rules;  // PATTERN=ATOL,RTOL
  bool fixed_tolerances = false;             // no dtype-aware rtol floor
  std::string verdict;                       // "reference", "tolerances", empty: the dump's
  bool recompute = false;                    // metrics from the tensors, not the capture's
  std::string steps, ranks;                  // IndexSet lists; empty: all
  std::string module;
  int threads = 0;
};
void setup_compare(CLI::App& app, Command& selected);
int run_compare(const CompareOptions& options);

// dynaprobe merge: partial JSON reports of one run joined into the report of the whole.
struct MergeOptions : ReportOptions {
  std::vector<std::string> reports_in;
};
void setup_merge(CLI::App& app, Command& selected);
int run_merge(const MergeOptions& options);

struct LsOptions {
  std::string dump;
  bool json = false;  // one JSON object per step file, module attributes as stored
};
void setup_ls(CLI::App& app, Command& selected);
int run_ls(const LsOptions& options);

struct RunsOptions {
  std::string folder;               // a folder of runs (dynaprobe_runs)
  std::optional<std::size_t> keep;  // remove all but the newest N runs
};
void setup_runs(CLI::App& app, Command& selected);
int run_runs(const RunsOptions& options);

struct GraphsOptions {
  std::string dump;
  std::string output;
};
void setup_graphs(CLI::App& app, Command& selected);
int run_graphs(const GraphsOptions& options);

// repro and bisect need torch: they run in place of this process as python -m dynaprobe.<tool>
// with the arguments after the command word (python_tools.cpp). setup_python_tools lists them
// in --help; run_python_tool returns only when Python cannot be run (exit 2).
void setup_python_tools(CLI::App& app);
bool is_python_tool(const std::string& word);
int run_python_tool(const std::string& tool, const std::vector<std::string>& args);

// Containment (contain.cpp): the limits of the process that reads the dumps.
struct Limits {
  double seconds = 3600;         // 0: no time limit
  std::uint64_t memory_mib = 0;  // 0: the machine's physical memory
  bool isolate = true;           // false: run in this process (DYNAPROBE_NO_ISOLATION=1)
};
void add_limit_options(CLI::App& app, Limits& limits);

// Runs `command` in a child process under `limits` and returns its exit code; errors it throws
// are printed as "dynaprobe: error: ..." with their exit code. A child that dies by a signal or
// runs past the time limit is exit 3, naming the file it was reading.
int run_contained(const Limits& limits, const Command& command);

}  // namespace dynaprobe::cli

namespace dynaprobe::cli {

// A validator for a number >= 0 that is finite (a tolerance, a limit, a thread count): the
// message names what was received and gives an example, instead of CLI11's range of doubles.
CLI::Validator non_negative(const std::string& example, bool integer = false);

}  // namespace dynaprobe::cli

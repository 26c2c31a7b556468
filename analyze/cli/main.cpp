// The dynaprobe command line: compare dumps, list them, extract their graphs (docs/cli.md).
// This file parses the command line and dispatches; each subcommand lives in its own file
// (compare.cpp, ls.cpp, graphs.cpp) and runs contained in a child process (contain.cpp).
// Exit codes (cli.h): 0 all pass, 1 mismatches found, 2 usage error, 3 I/O or format error.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "cli.h"
#include "dynaprobe/formats/schema.h"

namespace cli = dynaprobe::cli;
namespace schema = dynaprobe::formats::schema;

namespace {

constexpr const char* kCommands[] = {"compare", "merge",  "ls",     "graphs", "runs",
                                     "repro",   "bisect", "remedy", "bundle"};

// "compare, ls, ... and bundle".
std::string command_list() {
  std::string out;
  const std::size_t n = std::size(kCommands);
  for (std::size_t i = 0; i < n; ++i) {
    out += (i == 0 ? "" : i + 1 == n ? " and " : ", ") + std::string(kCommands[i]);
  }
  return out;
}

// "dynaprobe 0.1.0" and the dump format versions this build reads and writes.
std::string version_text() {
  const std::string format =
      std::to_string(schema::kFormatMajor) + "." + std::to_string(schema::kFormatMinor);
  return std::string("dynaprobe ") + DYNAPROBE_VERSION + "\ndump format " + format + ": writes " +
         format + "; reads 1.0 to " + format + ", and a newer " +
         std::to_string(schema::kFormatMajor) + ".x with a warning (what it adds is skipped)\n";
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "; did you mean 'compare'?" for the closest candidate within two edits, else "".
std::string suggestion(const std::string& given, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_distance = 3;
  for (const auto& candidate : candidates) {
    const std::size_t distance = edit_distance(given, candidate);
    if (distance < best_distance) best = candidate, best_distance = distance;
  }
  return best.empty() ? "" : "; did you mean '" + best + "'?";
}

// Words other tools use for a command or an option, by what they mean here. The suggestion for a
// mistake starts from meaning, then from spelling (suggestion()).
struct Meaning {
  const char* command;  // the command the option was given to; "" for a command word
  const char* given;
  const char* means;
};
constexpr const char* kReportFiles = "--csv PATH, --json PATH or --html PATH (a file per format)";
constexpr Meaning kMeanings[] = {
    {"", "report", "compare"},
    {"", "diff", "compare"},
    {"", "check", "compare"},
    {"", "analyze", "compare"},
    {"", "analyse", "compare"},
    {"", "list", "ls"},
    {"", "show", "ls"},
    {"", "info", "ls"},
    {"", "inspect", "ls"},
    {"", "graph", "graphs"},
    {"", "reproduce", "repro"},
    {"", "minify", "repro"},
    {"compare", "-o", kReportFiles},
    {"compare", "--output", kReportFiles},
    {"compare", "--out", kReportFiles},
    {"compare", "--report", kReportFiles},
    {"compare", "--save", kReportFiles},
    {"compare", "--threshold", "--atol X (and --rtol X)"},
    {"compare", "--tol", "--atol X and --rtol X, or --tolerance PATTERN=ATOL,RTOL"},
    {"compare", "--steps", "--step N"},
    {"compare", "--modules", "--module GLOB"},
    {"compare", "--filter", "--module GLOB"},
    {"compare", "-j", "--threads N"},
    {"compare", "--jobs", "--threads N"},
    {"compare", "--workers", "--threads N"},
    {"graphs", "--out", "--output DIR (-o DIR)"},
    {"graphs", "--dir", "--output DIR (-o DIR)"},
};

// "; did you mean X?" for a word another tool uses for X, else "".
std::string meaning(const std::string& command, const std::string& given) {
  for (const Meaning& m : kMeanings) {
    if (command == m.command && given == m.given) {
      return std::string("; did you mean ") + (command.empty() ? "'" : "") + m.means +
             (command.empty() ? "'" : "") + "?";
    }
  }
  return "";
}

// The long and short option names of `app` ("--atol", "-o") and of its parent.
std::vector<std::string> option_names(const CLI::App* app) {
  std::vector<std::string> names;
  for (; app != nullptr; app = app->get_parent()) {
    for (const CLI::Option* option : app->get_options()) {
      for (const auto& name : option->get_lnames()) names.push_back("--" + name);
      for (const auto& name : option->get_snames()) names.push_back("-" + name);
    }
  }
  return names;
}

// The arguments, with "help [COMMAND]" spelled "[COMMAND] --help" as CLI11 understands it.
std::vector<std::string> arguments(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0] == "help") {
    args.erase(args.begin());
    args.insert(args.begin() + std::min<std::ptrdiff_t>(1, std::ssize(args)), "--help");
  }
  return args;
}

// The first argument that is not an option or an option's value: the command word, or "".
std::string command_word(const std::vector<std::string>& args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--time-limit" || arg == "--memory-limit") {
      ++i;  // its value
    } else if (!arg.starts_with("-")) {
      return arg;
    }
  }
  return "";
}

int usage_error(const std::string& message) {
  std::cerr << "dynaprobe: error: " << message << "\n";
  return cli::kExitUsage;
}

// A CLI11 parse error as dynaprobe's messages read: prefixed, naming the command, with a
// suggestion for a mistyped option and where to find the valid ones.
int parse_error(const CLI::App& app, const std::string& command, const CLI::ParseError& error,
                const std::vector<std::string>& args) {
  const CLI::App* sub = command.empty() ? nullptr : app.get_subcommand(command);
  const std::string help =
      command.empty() ? "dynaprobe --help" : "dynaprobe " + command + " --help";
  const std::string where = command.empty() ? "" : command + ": ";
  if (command.empty()) {
    return usage_error(
        "a command is required: compare, ls or graphs (e.g. dynaprobe compare "
        "DUMP); run 'dynaprobe --help' for what each does");
  }
  // An unknown option is the mistake to name first: CLI11 may report a missing required option
  // instead when the mistyped one was meant to give it ("--ouput x").
  const auto known = option_names(sub);
  for (const std::string& arg : args) {
    const bool option = arg.size() > 1 && arg[0] == '-' && arg != "--" &&
                        !(std::isdigit(static_cast<unsigned char>(arg[1])) || arg[1] == '.');
    if (!option) continue;  // a value, or a negative number
    const std::string name = arg.substr(0, arg.find('='));
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    std::string guess = meaning(command, name);
    for (const CLI::App* other : app.get_subcommands({})) {
      if (!guess.empty() || other == sub) continue;
      const auto theirs = option_names(other);
      if (std::find(theirs.begin(), theirs.end(), name) != theirs.end()) {
        guess = "; " + name + " is an option of 'dynaprobe " + other->get_name() + "'";
      }
    }
    if (guess.empty()) guess = suggestion(name, known);
    return usage_error(where + "unknown option " + name + guess + " ('" + help +
                       "' lists the options)");
  }
  if (dynamic_cast<const CLI::ExtrasError*>(&error) != nullptr) {
    return usage_error(where + "too many arguments: " + error.what() + "; '" + help +
                       "' says what it takes");
  }
  if (dynamic_cast<const CLI::RequiredError*>(&error) != nullptr &&
      std::string(error.what()).starts_with("DUMP is required")) {
    return usage_error(where +
                       "DUMP is required: give a run folder, a dump folder or a step "
                       "file, e.g. dynaprobe " +
                       command + " " + std::string(schema::kRunsDir) + "/<run>" +
                       (command == "graphs" ? " -o graphs" : "") + " ('" + help + "' says more)");
  }
  return usage_error(where + error.what() + " ('" + help + "' lists the options)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "dynaprobe: find where torch.compile changes a PyTorch model's numbers.\n"
      "Analyses the dumps dynaprobe.PrecisionChecker writes: compares their eager and compiled\n"
      "sides module by module, lists them, extracts their graphs. No PyTorch needed.",
      "dynaprobe");
  app.footer(
      "Run 'dynaprobe COMMAND --help' (or 'dynaprobe help COMMAND') for a command's options and\n"
      "examples, 'dynaprobe --version' for the version and the dump format it reads; docs/cli.md\n"
      "has the full reference.\n"
      "\n"
      "Exit codes: 0 all pass, 1 differences found (compare: a FAIL or WARN row, or the loss),\n"
      "2 usage error, 3 I/O or format error (missing, unreadable or corrupt dump).");
  app.require_subcommand(1);
  bool version = false;  // answered before parsing (below); declared for --help
  app.add_flag("-V,--version", version,
               "Print the version and the dump format it reads and writes, exit");
  cli::Limits limits;
  cli::add_limit_options(app, limits);
  cli::Command command;
  cli::setup_compare(app, command);
  cli::setup_merge(app, command);
  cli::setup_ls(app, command);
  cli::setup_graphs(app, command);
  cli::setup_runs(app, command);
  cli::setup_python_tools(app);

  std::vector<std::string> args = arguments(argc, argv);
  const std::string word = command_word(args);
  const bool asks_version =
      word == "version" || (word.empty() && std::any_of(args.begin(), args.end(), [](auto& a) {
                              return a == "--version" || a == "-V";
                            }));
  if (asks_version) {
    std::cout << version_text();
    return cli::kExitPass;
  }
  if (!word.empty() &&
      std::find(std::begin(kCommands), std::end(kCommands), word) == std::end(kCommands)) {
    std::string guess = meaning("", word);
    if (guess.empty()) {
      std::vector<std::string> words(std::begin(kCommands), std::end(kCommands));
      words.insert(words.end(), {"version", "help"});
      guess = suggestion(word, words);
    }
    return usage_error("unknown command '" + word + "'" + (guess.empty() ? ";" : guess) +
                       " the commands are " + command_list() +
                       " (dynaprobe --help says what each does)");
  }
  if (cli::is_python_tool(word)) {
    const auto at = std::find(args.begin(), args.end(), word);
    return cli::run_python_tool(word, std::vector<std::string>(at + 1, args.end()));
  }
  try {
    std::vector<std::string> reversed(args.rbegin(),
                                      args.rend());  // CLI11 consumes it from the back
    app.parse(reversed);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return parse_error(app, word, e, args);
  }
  // DYNAPROBE_NO_ISOLATION=1 runs in this process, e.g. under a debugger.
  const char* no_isolation = std::getenv("DYNAPROBE_NO_ISOLATION");
  limits.isolate = !(no_isolation && std::string(no_isolation) == "1");
  return cli::run_contained(limits, command);
}

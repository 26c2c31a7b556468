// dynaprobe repro, bisect, remedy and bundle: replaying a call needs torch, so these run the
// Python entry points of the dynaprobe package (python -m dynaprobe.repro, ...) with the same
// arguments, in place of this process (docs/cli.md, Replaying a call).
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "cli.h"

namespace dynaprobe::cli {

namespace {

// Runs the tool's main(), or says what is missing when dynaprobe cannot be imported (exit 2).
constexpr const char* kLauncher =
    "import sys\n"
    "tool = sys.argv.pop(1)\n"
    "try:\n"
    "    module = __import__('dynaprobe.' + tool, fromlist=['main'])\n"
    "except ImportError as error:\n"
    "    print(f'dynaprobe {tool}: this Python ({sys.executable}) cannot import dynaprobe.{tool} "
    "({error}); install dynaprobe and torch into it, or point DYNAPROBE_PYTHON at a Python that "
    "has them', file=sys.stderr)\n"
    "    sys.exit(2)\n"
    "sys.exit(module.main(sys.argv[1:]))\n";

// DYNAPROBE_PYTHON, else the python3 installed next to this program (a virtual environment's
// bin/), else python3 from PATH.
std::string python_interpreter() {
  if (const char* chosen = std::getenv("DYNAPROBE_PYTHON"); chosen && *chosen) return chosen;
  std::error_code error;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    const auto sibling = self.parent_path() / "python3";
    if (::access(sibling.c_str(), X_OK) == 0) return sibling.string();
  }
  return "python3";
}

}  // namespace

void setup_python_tools(CLI::App& app) {
  for (const auto& [name, what] : std::initializer_list<std::pair<const char*, const char*>>{
           {"repro",
            "Write a standalone repro folder of a stored call (runs python -m "
            "dynaprobe.repro; needs torch)"},
           {"bisect",
            "Replay a stored call through torch.compile's stages (runs python -m "
            "dynaprobe.bisect; needs torch)"},
           {"remedy",
            "Replay each failing module's stored call under candidate changes and print the "
            "cheapest that passes, as code to paste (runs python -m dynaprobe.remedy; needs "
            "torch)"},
           {"bundle",
            "Write one archive to attach to a bug report: reports, environment, graphs and "
            "repros that run with torch alone (runs python -m dynaprobe.bundle; needs torch)"}}) {
    app.add_subcommand(name, what)->allow_extras()->prefix_command();
  }
}

bool is_python_tool(const std::string& word) {
  return word == "repro" || word == "bisect" || word == "remedy" || word == "bundle";
}

int run_python_tool(const std::string& tool, const std::vector<std::string>& args) {
  const std::string python = python_interpreter();
  std::vector<std::string> owned = {python, "-c", kLauncher, tool};
  owned.insert(owned.end(), args.begin(), args.end());
  // The tool itself reads the newest run of a folder of runs (analyze::choose_run, bound).
  std::vector<char*> argv;
  for (auto& arg : owned) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::cout.flush();
  ::execvp(python.c_str(), argv.data());
  std::cerr << "dynaprobe: error: " << tool << " runs 'python -m dynaprobe." << tool << "', but "
            << python << " cannot be run (" << std::strerror(errno)
            << "): install Python with torch and dynaprobe, or set DYNAPROBE_PYTHON to one\n";
  return kExitUsage;
}

}  // namespace dynaprobe::cli

// dynaprobe graphs: writes the graphs stored in a dump as .py files
// (docs/cli.md#dynaprobe-graphs).
#include <cstdio>
#include <map>
#include <memory>

#include "cli.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/run_folders.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::cli {
namespace fs = std::filesystem;

namespace {

// Graph names come from the file: keep them to a safe alphabet so nothing is written outside
// the output folder.
std::string safe_file_name(const std::string& name) {
  std::string safe;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    safe += ok ? c : '_';
  }
  if (safe.empty() || safe.front() == '.') safe = "_" + safe;
  // File names are limited to 255 bytes: a longer name keeps its first 200 characters and gets a
  // hash of the whole name, so different long names stay different files.
  constexpr std::size_t kMaxStem = 200;
  if (safe.size() > kMaxStem) {
    char hash[20];
    std::snprintf(hash, sizeof(hash), ".%016llx",
                  static_cast<unsigned long long>(std::hash<std::string>{}(name)));
    safe = safe.substr(0, kMaxStem) + hash;
  }
  return safe;
}

}  // namespace

void setup_graphs(CLI::App& app, Command& selected) {
  auto options = std::make_shared<GraphsOptions>();
  auto* sub = app.add_subcommand(
      "graphs", "Write the Dynamo and AOTAutograd graphs stored in a dump as .py files");
  sub->fallthrough();
  sub->footer(
      "Files are named as PyTorch names them, one per graph:\n"
      "  __compiled_fn_<n>.Captured_Graph.<hash>.py   what Dynamo traced\n"
      "  __compiled_fn_<n>.Forward_Graph.<hash>.py    AOTAutograd's forward (or inference) graph\n"
      "  __compiled_fn_<n>.Backward_Graph.<hash>.py   AOTAutograd's backward graph\n"
      "A run folder of several ranks gets one folder per rank, OUTPUT/rank<R>/. Every dump stores\n"
      "its graphs, whether or not it was captured with dump_graphs=True.\n"
      "\n"
      "Example:\n"
      "  dynaprobe graphs dynaprobe_runs/20250101-120000-4242-0 -o graphs/");
  sub->add_option("DUMP", options->dump, "Run folder, dump folder or step file")
      ->type_name("")
      ->required();
  sub->add_option("-o,--output", options->output,
                  "Folder to write the graphs to (created if needed)")
      ->type_name("OUTPUT")
      ->required();
  sub->final_callback([options, &selected] {
    selected = {options->dump, [options] { return run_graphs(*options); }};
  });
}

int run_graphs(const GraphsOptions& cmd) {
  const auto ranks = analyze::find_rank_dumps(chosen_dump("graphs", cmd.dump));
  std::size_t written = 0;
  for (const auto& rank : ranks) {
    const fs::path folder = ranks.size() > 1
                                ? fs::path(cmd.output) / ("rank" + std::to_string(rank.rank))
                                : fs::path(cmd.output);
    std::map<std::string, std::string> texts;
    const auto files = formats::list_dump(rank.path);
    analyze::require_committed_steps(rank.path, files);
    for (const auto& file : files.steps) {
      formats::StepReader reader(file);
      for (const auto& graph : reader.graphs()) {
        std::string name = safe_file_name(graph.name);
        auto existing = texts.find(name);
        if (existing != texts.end() && existing->second == graph.text) continue;
        if (existing != texts.end()) name += ".step" + std::to_string(reader.step());
        texts[name] = graph.text;
        const fs::path path = folder / (name + ".py");
        write_text_file(path, graph.text);
        std::printf("%s\n", path.c_str());
        ++written;
      }
    }
  }
  if (written == 0) {
    std::fprintf(stderr,
                 "dynaprobe: warning: no graphs in %s, nothing written (graphs are stored in the "
                 "step that compiled the wrapped modules; eager-only captures and dumps of other "
                 "tools have none: give the compiled side's dump)\n",
                 cmd.dump.c_str());
  }
  return kExitPass;
}

}  // namespace dynaprobe::cli

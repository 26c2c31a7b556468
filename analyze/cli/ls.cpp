// dynaprobe ls: lists what a dump holds, from each step file's index (docs/cli.md#dynaprobe-ls).
#include <cstdio>
#include <memory>

#include "cli.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/number_text.h"
#include "dynaprobe/analyze/report_model.h"
#include "dynaprobe/analyze/run_folders.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::cli {

namespace {

// An attribute as the listing shows it: key=value, with a JSON value (a call's replay
// description runs to hundreds of characters) as its size, which --json shows whole.
std::string attribute_text(const std::string& key, const std::string& value) {
  const bool json = !value.empty() && (value.front() == '{' || value.front() == '[');
  return formats::printable_name(key) + "=" +
         (json ? "<JSON, " + std::to_string(value.size()) + " characters: ls --json shows it>"
               : formats::printable_name(value));
}

// A step file's listing as JSON: what the text shows, module attributes as stored.
analyze::Value step_file_model(const std::string& file, const formats::StepReader& reader) {
  using analyze::Value;
  Value::Object provenance, modules;
  for (const auto& [key, value] : reader.provenance()) provenance.emplace_back(key, value);
  for (const auto& module : reader.modules()) {
    Value::Object attributes;
    for (const auto& [key, value] : module.attributes) attributes.emplace_back(key, value);
    modules.emplace_back(module.module, std::move(attributes));
  }
  Value::Array records, graphs;
  for (const auto& record : reader.records()) {
    Value::Array shape;
    for (auto extent : record.shape) shape.emplace_back(extent);
    records.push_back(Value::Object{{"module", record.key.module},
                                    {"call", record.key.call},
                                    {"kind", formats::kind_name(record.key.kind)},
                                    {"tensor_index", record.key.tensor_index},
                                    {"side", formats::side_name(record.key.side)},
                                    {"label", record.label},
                                    {"dtype", formats::dtype_name(record.dtype)},
                                    {"shape", std::move(shape)},
                                    {"bytes", record.nbytes()},
                                    {"stored", record.stored},
                                    {"stored_bytes", record.stored_bytes}});
  }
  for (const auto& graph : reader.graphs()) {
    graphs.push_back(
        Value::Object{{"name", graph.name}, {"kind", graph.kind}, {"bytes", graph.text.size()}});
  }
  return Value::Object{{"file", file},
                       {"step", reader.step()},
                       {"format_version", reader.format_version()},
                       {"provenance", std::move(provenance)},
                       {"modules", std::move(modules)},
                       {"records", std::move(records)},
                       {"graphs", std::move(graphs)}};
}

}  // namespace

void setup_ls(CLI::App& app, Command& selected) {
  auto options = std::make_shared<LsOptions>();
  auto* sub = app.add_subcommand(
      "ls", "List a dump's steps, provenance, modules, records and graphs (no tensor data read)");
  sub->fallthrough();
  sub->footer(
      "For each step file: its provenance (torch version, backend, mode, tolerances, host, ...),\n"
      "the modules the capture knew of (role, calls, compiled functions, graph breaks, notes),\n"
      "every record (module, call, kind, tensor index, side, dtype, shape, bytes, stored bytes,\n"
      "compression ratio) and the graphs. Steps a crash left unfinished are listed as such.\n"
      "\n"
      "Example:\n"
      "  dynaprobe ls dynaprobe_runs/20250101-120000-4242-0");
  sub->add_option("DUMP", options->dump, "Run folder, dump folder or step file")
      ->type_name("")
      ->required();
  sub->add_flag("--json", options->json,
                "Print one JSON object per step file (provenance, modules with their attributes "
                "as stored, records, graphs)");
  sub->final_callback([options, &selected] {
    selected = {options->dump, [options] { return run_ls(*options); }};
  });
}

int run_ls(const LsOptions& cmd) {
  for (const auto& rank : analyze::find_rank_dumps(chosen_dump("ls", cmd.dump))) {
    const auto files = formats::list_dump(rank.path);
    for (const auto& file : files.steps) {
      formats::StepReader reader(file);
      if (cmd.json) {
        std::printf("%s\n", analyze::to_json(step_file_model(file.string(), reader)).c_str());
        continue;
      }
      std::printf("%s  (step %lld, format %s)\n", file.c_str(),
                  static_cast<long long>(reader.step()), printable(reader.format_version()));
      for (const auto& [key, value] : reader.provenance()) {
        std::printf("  %-16s %s\n", (formats::printable_name(key) + ":").c_str(), printable(value));
      }
      const auto modules = reader.modules();
      if (!modules.empty()) {
        std::printf("  modules:\n");
        for (const auto& module : modules) {
          std::string attributes;
          for (const auto& [key, value] : module.attributes) {
            attributes += (attributes.empty() ? "" : ", ") + attribute_text(key, value);
          }
          std::printf("    %-40s %s\n", printable(module.module), attributes.c_str());
        }
      }
      std::printf("  %-32s %4s %-11s %5s %-9s %-15s %-20s %10s %10s %6s\n", "module", "call",
                  "kind", "index", "side", "dtype", "shape", "bytes", "stored", "ratio");
      std::uint64_t total = 0, stored = 0;
      std::size_t not_stored = 0;
      for (const auto& record : reader.records()) {
        total += record.nbytes();
        stored += record.stored_bytes;
        not_stored += !record.stored;
        std::printf(
            "  %-32s %4u %-11s %5u %-9s %-15s %-20s %10s %10s %6.2f\n",
            printable(record.key.module), record.key.call,
            std::string(formats::kind_name(record.key.kind)).c_str(), record.key.tensor_index,
            std::string(formats::side_name(record.key.side)).c_str(),
            std::string(formats::dtype_name(record.dtype)).c_str(),
            formats::shape_string(record.shape).c_str(),
            analyze::format_bytes(record.nbytes()).c_str(),
            record.stored ? analyze::format_bytes(record.stored_bytes).c_str() : "not stored",
            record.stored_bytes
                ? static_cast<double>(record.nbytes()) / static_cast<double>(record.stored_bytes)
                : 0.0);
      }
      std::printf("  %zu records, %s of tensors stored in %s\n", reader.records().size(),
                  analyze::format_bytes(total).c_str(), analyze::format_bytes(stored).c_str());
      if (!reader.stored_metrics().empty() || not_stored > 0) {
        std::printf(
            "  %zu compared pairs judged at capture (their metrics are in the file); %zu records "
            "without their tensor (dump='failing' or 'stats'): other tolerances need those\n",
            reader.stored_metrics().size(), not_stored);
      }
      for (const auto& graph : reader.graphs()) {
        std::printf("  graph %s (%s, %zu bytes)\n", formats::printable_name(graph.name).c_str(),
                    formats::printable_name(graph.kind).c_str(), graph.text.size());
      }
    }
    for (const auto& file : files.unfinished) {
      if (cmd.json) continue;
      std::printf("%s  (unfinished: the writer stopped during this step; it is skipped)\n",
                  file.c_str());
    }
    // As compare does: a dump without a committed step is an error, not an empty listing.
    std::fflush(stdout);
    analyze::require_committed_steps(rank.path, files);
  }
  return kExitPass;
}

}  // namespace dynaprobe::cli

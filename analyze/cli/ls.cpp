// dynaprobe ls: lists what a dump holds, from each step file's index (docs/cli.md#dynaprobe-ls).
#include <cstdio>
#include <memory>

#include "cli.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::cli {

namespace {

std::string human_bytes(std::uint64_t bytes) {
  char buffer[32];
  if (bytes < 1024) {
    std::snprintf(buffer, sizeof(buffer), "%llu B", static_cast<unsigned long long>(bytes));
  } else if (bytes < (1u << 20)) {
    std::snprintf(buffer, sizeof(buffer), "%.1f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes < (1u << 30)) {
    std::snprintf(buffer, sizeof(buffer), "%.1f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return buffer;
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
  sub->final_callback([options, &selected] {
    selected = {options->dump, [options] { return run_ls(*options); }};
  });
}

int run_ls(const LsOptions& cmd) {
  for (const auto& rank : analyze::find_rank_dumps(chosen_dump("ls", cmd.dump))) {
    const auto files = formats::list_dump(rank.path);
    for (const auto& file : files.steps) {
      formats::StepReader reader(file);
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
            attributes += (attributes.empty() ? "" : ", ") + formats::printable_name(key) + "=" +
                          formats::printable_name(value);
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
            formats::shape_string(record.shape).c_str(), human_bytes(record.nbytes()).c_str(),
            record.stored ? human_bytes(record.stored_bytes).c_str() : "not stored",
            record.stored_bytes
                ? static_cast<double>(record.nbytes()) / static_cast<double>(record.stored_bytes)
                : 0.0);
      }
      std::printf("  %zu records, %s of tensors stored in %s\n", reader.records().size(),
                  human_bytes(total).c_str(), human_bytes(stored).c_str());
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

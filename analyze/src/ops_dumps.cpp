// The op localisations beside a dump (ops_dumps.h): each ops dump is an ordinary one-step dump
// (capture/python/dynaprobe/_offline/ops.py writes it), compared here like any other and summed up
// per aten graph for the reports (docs/report-format.md#op-localisation).
#include "ops_dumps.h"

#include <fnmatch.h>

#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"

namespace dynaprobe::analyze::detail {
namespace {

namespace fs = std::filesystem;
namespace schema = formats::schema;
namespace vocabulary = formats::vocabulary;

// What an ops dump's folder name says: "<module>.call<C>.step<S>" (the module as a file name:
// characters other than letters, digits, '_', '.' and '-' are '_').
struct FolderName {
  std::string module;
  std::uint32_t call = 0;
  std::int64_t step = 0;
};

template <typename T>
bool parse_number(std::string_view text, T& value) {
  const auto parsed = std::from_chars(text.data(), text.data() + text.size(), value);
  return !text.empty() && parsed.ec == std::errc() && parsed.ptr == text.data() + text.size();
}

std::optional<FolderName> parse_folder_name(const std::string& name) {
  const std::size_t step_at = name.rfind(schema::kOpsStepInfix);
  if (step_at == std::string::npos) return std::nullopt;
  const std::size_t call_at = name.rfind(schema::kOpsCallInfix, step_at);
  if (call_at == std::string::npos) return std::nullopt;
  FolderName parsed;
  parsed.module = name.substr(0, call_at);
  const std::string_view view(name);
  const std::size_t call_start = call_at + schema::kOpsCallInfix.size();
  if (!parse_number(view.substr(call_start, step_at - call_start), parsed.call) ||
      !parse_number(view.substr(step_at + schema::kOpsStepInfix.size()), parsed.step)) {
    return std::nullopt;
  }
  return parsed;
}

// The folder holding a dump's step files: the dump itself, or a step file's folder.
fs::path dump_folder(const fs::path& dump) {
  std::error_code error;
  return fs::is_directory(dump, error) ? dump : dump.parent_path();
}

// Every ops dump folder beside `dumps`, by path (each once), with what its name says.
std::map<fs::path, FolderName> list_ops_folders(const std::vector<fs::path>& dumps) {
  std::map<fs::path, FolderName> folders;
  for (const fs::path& dump : dumps) {
    const fs::path ops = dump_folder(dump) / schema::kOpsDir;
    std::error_code error;
    if (!fs::is_directory(ops, error)) continue;
    for (const auto& entry : fs::directory_iterator(ops, error)) {
      if (!entry.is_directory(error)) continue;
      auto name = parse_folder_name(entry.path().filename().string());
      if (name) folders.emplace(entry.path().lexically_normal(), std::move(*name));
    }
  }
  return folders;
}

std::string attribute(const StepReport& report, const std::string& module, std::string_view key) {
  const auto attributes = report.modules.find(module);
  if (attributes == report.modules.end()) return "";
  const auto value = attributes->second.find(std::string(key));
  return value == attributes->second.end() ? "" : value->second;
}

// The ops dump in `folder`, compared; its error when it cannot be.
OpsDump read_ops_dump(const fs::path& folder, const FolderName& name, const CompareOptions& options,
                      const CompareDump& compare_dump) {
  OpsDump dump;
  dump.module = name.module;
  dump.call = name.call;
  dump.dump = folder;
  CompareOptions own;  // the ops dump's own tolerances and verdict, as bisect --ops judged it
  own.step = name.step;
  own.threads = options.threads;
  own.read_ops = false;
  try {
    const Comparison comparison = compare_dump(folder, own);
    if (comparison.steps.empty()) {
      throw FormatError(folder.string() + ": no step " + std::to_string(name.step));
    }
    const formats::Provenance& provenance = comparison.compiled_provenance;
    const std::string module =
        formats::provenance_value(provenance, vocabulary::provenance::kOpsModule);
    std::uint32_t call = 0;
    if (!module.empty()) dump.module = module;
    if (parse_number(formats::provenance_value(provenance, vocabulary::provenance::kOpsCall),
                     call)) {
      dump.call = call;
    }
    dump.backend = formats::provenance_value(provenance, vocabulary::provenance::kOpsBackend);
    dump.graphs = ops_graphs(comparison.steps.front());
  } catch (const std::exception& error) {
    dump.error = error.what();
    if (dump.error.empty()) dump.error = "unknown error";
  }
  return dump;
}

}  // namespace

std::vector<OpsGraph> ops_graphs(const StepReport& report) {
  std::vector<OpsGraph> graphs;
  std::map<std::string, std::size_t> index;  // graph -> its place in graphs
  std::set<std::string> counted, failed;     // modules (ops)
  for (const Row& row : report.rows) {
    if (!row.kind || *row.kind != formats::Kind::kFwdOutput) continue;
    std::string graph = attribute(report, row.module, vocabulary::module_attribute::kGraph);
    if (graph.empty()) graph = row.module.substr(0, row.module.find('.'));
    auto [at, added] = index.emplace(graph, graphs.size());
    if (added) graphs.emplace_back().graph = graph;
    OpsGraph& ops = graphs[at->second];
    if (counted.insert(row.module).second) ++ops.ops;
    if (row.status != Status::kFail || !failed.insert(row.module).second) continue;
    ++ops.failing;
    if (ops.first_failing) continue;
    OpFailure failure;
    failure.node =
        row.module.starts_with(graph + ".") ? row.module.substr(graph.size() + 1) : row.module;
    failure.op = attribute(report, row.module, vocabulary::module_attribute::kOp);
    failure.source = attribute(report, row.module, vocabulary::module_attribute::kSource);
    if (row.metrics) {
      failure.max_abs = row.metrics->max_abs;
      failure.mean_abs = row.metrics->mean_abs;
    } else if (row.shape_mismatch()) {
      failure.max_abs = failure.mean_abs = INFINITY;
    }
    failure.status = row.status;
    ops.first_failing = std::move(failure);
  }
  return graphs;
}

void attach_ops_dumps(std::vector<StepReport>& steps, const std::vector<fs::path>& dumps,
                      const CompareOptions& options, const CompareDump& compare_dump) {
  if (!options.read_ops || steps.empty()) return;
  const std::map<fs::path, FolderName> folders = list_ops_folders(dumps);
  for (StepReport& report : steps) {
    for (const auto& [folder, name] : folders) {
      if (name.step != report.step) continue;
      OpsDump dump = read_ops_dump(folder, name, options, compare_dump);
      if (!options.module_glob.empty() &&
          fnmatch(options.module_glob.c_str(), dump.module.c_str(), 0) != 0) {
        continue;
      }
      report.ops.push_back(std::move(dump));
    }
  }
}

}  // namespace dynaprobe::analyze::detail

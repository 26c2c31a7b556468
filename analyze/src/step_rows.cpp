#include "step_rows.h"

#include <algorithm>
#include <charconv>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::analyze {
using formats::Kind;
using formats::RecordInfo;
using formats::Side;
using formats::StepReader;
namespace vocabulary = formats::vocabulary;

namespace {

const std::string* find_attribute(const std::map<std::string, std::string>& attributes,
                                  std::string_view key) {
  auto found = attributes.find(std::string(key));
  return found == attributes.end() ? nullptr : &found->second;
}

// `module` is a submodule of `prefix` ("layers.0.mlp" of "layers.0").
bool under(const std::string& module, const std::string& prefix) {
  return module.size() > prefix.size() && module.compare(0, prefix.size(), prefix) == 0 &&
         module[prefix.size()] == '.';
}

bool contains(const std::vector<std::string>& modules, const std::string& module) {
  return std::find(modules.begin(), modules.end(), module) != modules.end();
}

}  // namespace

void apply_provenance(const formats::Provenance& provenance, StepReport& report) {
  const auto value = [&](std::string_view key) {
    return formats::provenance_value(provenance, key);
  };
  report.single_pass = value(vocabulary::provenance::kMode) == vocabulary::mode::kSinglePass;
  report.capture_input = value(vocabulary::provenance::kCaptureInput) != "false";
  const std::string cast = value(vocabulary::provenance::kCastDtype);
  report.cast_dtype = cast == "None" ? "" : cast;
  report.autocast = value(vocabulary::provenance::kAutocast);
}

ModuleAttributes merge_module_attributes(const StepReader* eager, const StepReader* compiled) {
  ModuleAttributes modules;
  for (const StepReader* reader : {eager, compiled}) {
    if (!reader) continue;
    for (const auto& info : reader->modules()) {
      auto& attributes = modules[info.module];
      for (const auto& [key, value] : info.attributes) attributes.emplace(key, value);
    }
  }
  return modules;
}

void add_listed_modules(const StepReader* eager, const StepReader* compiled, ModuleOrder& order) {
  std::vector<std::string> listed;
  std::set<std::string> seen;
  for (const StepReader* reader : {eager, compiled}) {
    if (!reader) continue;
    for (const auto& info : reader->modules()) {
      if (seen.insert(info.module).second) listed.push_back(info.module);
    }
  }
  order.place_listed(listed);
}

Pairs pair_records(const StepReader* eager, const StepReader* compiled, ModuleOrder& order,
                   Side eager_side) {
  Pairs pairs;
  const auto collect = [&](const StepReader* reader, Side side, const RecordInfo* Pair::*into) {
    if (!reader) return;
    for (const RecordInfo& info : reader->records()) {
      if (info.key.side != side || info.key.kind == Kind::kLoss ||
          !formats::is_compared(info.key.kind)) {
        continue;
      }
      order.add(info.key.module);
      pairs[{info.key.module, info.key.call, info.key.kind, info.key.tensor_index}].*into = &info;
    }
  };
  collect(compiled, Side::kCompiled, &Pair::compiled);
  collect(eager, eager_side, &Pair::eager);
  const StepReader* reference_reader = compiled ? compiled : eager;
  if (reference_reader) {
    for (const RecordInfo& info : reference_reader->records()) {
      if (info.key.side != Side::kReference) continue;
      auto found =
          pairs.find({info.key.module, info.key.call, info.key.kind, info.key.tensor_index});
      if (found != pairs.end()) found->second.reference = &info;
    }
  }
  return pairs;
}

Pair compared_pair(const TensorKey& key, Pair pair, bool single_pass) {
  if (recorded_once(key.kind, single_pass)) {
    if (!pair.eager) pair.eager = pair.compiled;
    if (!pair.compiled) pair.compiled = pair.eager;
  }
  return pair;
}

Row tensor_row(const TensorKey& key, const Pair& pair, const StepReader* eager,
               const StepReader* compiled) {
  Row row;
  row.module = key.module;
  row.call = key.call;
  row.kind = key.kind;
  row.tensor_index = key.tensor_index;
  if (pair.compiled && compiled) {
    row.sequence = static_cast<std::uint64_t>(pair.compiled - compiled->records().data());
  } else if (pair.eager && eager) {
    row.sequence = static_cast<std::uint64_t>(pair.eager - eager->records().data());
  }
  if (pair.eager) {
    row.eager = TensorSide{pair.eager->dtype, pair.eager->shape};
    row.label = pair.eager->label;
  }
  if (pair.compiled) {
    row.compiled = TensorSide{pair.compiled->dtype, pair.compiled->shape};
    if (row.label.empty()) row.label = pair.compiled->label;
  }
  if (pair.reference) {
    const formats::DType dtype = pair.reference->dtype;
    row.reference_dtype =
        dtype == formats::DType::kFloat32 || dtype == formats::DType::kComplex64 ? "fp32" : "fp64";
  }
  return row;
}

CallsRun calls_run(const Pairs& pairs) {
  CallsRun run;
  for (const auto& [key, pair] : pairs) {
    if (!is_forward(key.kind)) continue;
    if (pair.compiled) run.compiled.insert({key.module, key.call});
    if (pair.eager) run.eager[key.module].insert(key.call);
  }
  return run;
}

ModuleRoles::ModuleRoles(const ModuleAttributes& modules) {
  for (const auto& [module, attributes] : modules) {
    const std::string* role = find_attribute(attributes, module_attributes::kRole);
    if (!role) continue;
    if (*role == vocabulary::role::kWrapped) wrapped_.push_back(module);
    if (*role == vocabulary::role::kIgnored) ignored_.push_back(module);
  }
}

bool ModuleRoles::wrapped(const std::string& module) const { return contains(wrapped_, module); }

bool ModuleRoles::inside_wrapped(const std::string& module) const {
  return std::any_of(wrapped_.begin(), wrapped_.end(),
                     [&](const std::string& w) { return under(module, w); });
}

bool ModuleRoles::ignored(const std::string& module) const { return contains(ignored_, module); }

bool ModuleRoles::ignored_or_under(const std::string& module) const {
  return std::any_of(ignored_.begin(), ignored_.end(), [&](const std::string& prefix) {
    return module == prefix || under(module, prefix);
  });
}

std::optional<Row> module_note_row(const std::string& module,
                                   const std::map<std::string, std::string>& attributes,
                                   bool single_pass, std::size_t eager_calls) {
  const std::string* note = find_attribute(attributes, module_attributes::kNote);
  if (!note || note->empty()) return std::nullopt;
  Row row;
  row.module = module;
  row.note = *note;
  row.status = note_status(*note);
  if (const std::string* reason = find_attribute(attributes, module_attributes::kReason)) {
    row.reason = *reason;
  }
  // The capture counts the calls of the compiled copy only: a module it saw no call of may still
  // have run eagerly, and then "not called" would be wrong.
  if (row.note == notes::kNotRun && !single_pass && eager_calls > 0) {
    row.reason = "the compiled model did not call it in this step, but the eager model did (" +
                 std::to_string(eager_calls) +
                 " call(s)): the two copies took different paths; look for control flow "
                 "that depends on compilation (torch.compiler.is_compiling(), "
                 "graph-break fallbacks) or on state the compiled copy does not share";
  }
  return row;
}

std::optional<NoReference> no_reference_row(const std::string& module,
                                            const std::map<std::string, std::string>& attributes) {
  const std::string* missing = find_attribute(attributes, module_attributes::kReferenceMissing);
  std::size_t calls = 0;
  if (!missing ||
      std::from_chars(missing->data(), missing->data() + missing->size(), calls).ec !=
          std::errc() ||
      calls == 0) {
    return std::nullopt;
  }
  NoReference result;
  result.calls = calls;
  result.row.module = module;
  result.row.note = notes::kNoReference;
  result.row.status = note_status(result.row.note);
  const std::string* error = find_attribute(attributes, module_attributes::kReferenceError);
  result.row.reason = std::to_string(calls) +
                      " call(s) without a reference, so judged by the "
                      "tolerances alone: " +
                      (error ? *error : std::string("no reason recorded")) +
                      " (reference=\"fp32\" where float64 has no kernel; reference=None turns "
                      "it off)";
  return result;
}

Row ignored_row(const std::string& module) {
  Row row;
  row.module = module;
  row.note = notes::kIgnored;
  row.status = note_status(row.note);
  return row;
}

namespace {

// Why a tensor of one side has no counterpart in the `missing` run (MISSING_*), when nothing
// more specific is known.
std::string missing_reason(std::string_view missing, bool forward) {
  const std::string side(missing);
  if (forward) {
    return "the " + side +
           " run recorded no such tensor: it called the module fewer times, or the module took "
           "or returned fewer tensors there";
  }
  return "no gradient reached it in the " + side + " backward: the " + side +
         " run took another path";
}

}  // namespace

Verdict one_sided_verdict(const OneSidedCase& row) {
  Verdict verdict;
  const bool forward = is_forward(row.kind);
  if (row.held == Side::kCompiled) {
    verdict.note = forward ? notes::kMissingFwdInEager : notes::kMissingBwdInEager;
    verdict.reason = missing_reason("eager", forward);
  } else if (forward) {
    verdict.note = row.inside_wrapped ? notes::kInsideCompiled : notes::kMissingFwdInCompiled;
    if (row.wrapped && !row.compiled_ran) {
      verdict.reason = "the compiled model did not run this call";
    } else if (!row.inside_wrapped) {
      verdict.reason = missing_reason("compiled", forward);
    }
  } else if (row.wrapped && !row.compiled_ran) {
    verdict.note = notes::kMissingBwdInCompiled;
    verdict.reason = "the compiled model did not run this call, so it has no gradients";
  } else if (row.wrapped) {
    verdict.note = notes::kCompiledWrapper;
  } else {
    verdict.note = row.inside_wrapped ? notes::kInsideCompiled : notes::kMissingBwdInCompiled;
    if (!row.inside_wrapped) verdict.reason = missing_reason("compiled", forward);
  }
  verdict.status = note_status(verdict.note);
  return verdict;
}

bool all_zeros(const StepReader& reader, const RecordInfo& record) {
  if (!record.stored) return false;
  const std::size_t part = formats::dtype_size(formats::complex_part(record.dtype));
  bool zero = true;
  formats::stream_chunks(
      reader.open(record), [&](formats::ChunkExtent extent, const std::byte* data) {
        const std::size_t bytes = extent.element_count * formats::dtype_size(record.dtype);
        // Little-endian values: each one's sign bit is the top bit of its last byte.
        for (std::size_t i = 0; zero && i < bytes; ++i) {
          const auto mask = (i % part == part - 1) ? std::byte{0x7f} : std::byte{0xff};
          zero = (data[i] & mask) == std::byte{0};
        }
      });
  return zero;
}

}  // namespace dynaprobe::analyze

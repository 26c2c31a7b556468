// Record keys and tensor views: what a dump stores, independent of HDF5.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dynaprobe/formats/dtype.h"

namespace dynaprobe::formats {

// What a tensor is, relative to its module (the spec's check types, plus param_grad and loss,
// and replay: what a replay of a failing call needs, never compared).
// A new kind is an enumerator here and a row of kKinds in record.cpp (its name, pass and whether
// it is compared): the analyzer pairs, judges and reports every compared kind by those.
enum class Kind : std::uint8_t {
  kFwdInput,
  kFwdOutput,
  kGradInput,
  kGradOutput,
  kParamGrad,
  kLoss,
  kReplay  // since format 1.4: a call's inputs, grad_output, state and RNG (docs/dump-format.md)
};
// Which execution produced it.
enum class Side : std::uint8_t { kEager, kCompiled, kReference };

std::string_view kind_name(Kind kind);  // "fwd_input", ...
std::optional<Kind> parse_kind(std::string_view name);
// "fwd_input, fwd_output, ...": every kind's name, for messages that list them.
std::string kind_names();
// Whether the kind is recorded in the forward pass (fwd_input, fwd_output): one side missing it
// is MISSING_fwd_*, and the text report lists it in a FORWARD section. Every other kind is of the
// backward pass.
bool is_forward(Kind kind);
// The kind's pass in words: vocabulary::pass::kForward ("forward") or kBackward ("backward"), as
// the report model's "pass" has it.
std::string_view pass_name(Kind kind);
// Whether records of the kind are paired and judged (every kind but replay, which the capture
// stores whole for replaying a call and the analyzer leaves out of reports).
bool is_compared(Kind kind);
std::string_view side_name(Side side);  // "eager", ...
std::optional<Side> parse_side(std::string_view name);

// Module path of the whole-network loss records (module paths are the user's names otherwise).
inline constexpr std::string_view kLossModule = "LOSS";

// A record is keyed by (step, module path, call index, kind, tensor index, side). The step is the
// step file the record lives in.
struct RecordKey {
  std::int64_t step = 0;
  std::string module;      // "layers.0.mlp"; never "_orig_mod"; no '/'
  std::uint32_t call = 0;  // n-th call of the module within the step
  Kind kind = Kind::kFwdOutput;
  std::uint32_t tensor_index = 0;
  Side side = Side::kEager;

  auto operator<=>(const RecordKey&) const = default;
};

std::string to_string(const RecordKey& key);  // "step 3 layers.0 call 0 fwd_output[1] (eager)"

// A name read from a file (module, label, provenance, graph), safe to print on one line of a
// report or a message: valid UTF-8 other than control characters is kept as it is; control
// characters (C0, DEL, C1) and bytes that are not valid UTF-8 become "\xNN". Names dynaprobe
// writes are unchanged. Reports of every format use it, so text, CSV and JSON agree.
std::string printable_name(std::string_view name);
// printable_name in single quotes, for messages: 'layers.0'.
std::string quoted_name(std::string_view name);

// Throws UsageError unless `module` can name an HDF5 group (non-empty, no '/', not "." or "..").
void validate_module_path(std::string_view module);

// A contiguous, C-ordered host tensor owned by the caller. `data` may be null when numel is 0.
struct TensorView {
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;  // empty: a 0-d tensor
  const void* data = nullptr;

  std::uint64_t numel() const;
  std::uint64_t nbytes() const { return numel() * dtype_size(dtype); }
};

struct Record {
  RecordKey key;
  std::string label;  // free text: a parameter name, an output's pytree path; may be empty
  TensorView tensor;
};

// Provenance of a step file: torch version, backend, mode, rank, world size, scenario, host, ...
using Provenance = std::map<std::string, std::string>;
// The value of a provenance key; empty when the key is absent.
std::string provenance_value(const Provenance& provenance, std::string_view key);

// What the capture knew about a module in this step, as string attributes: its role ("wrapped",
// "ignored"), a note when it could not be compared (e.g. "NOT_COMPILED"), its compiled
// functions, graph breaks, ... Modules are listed in the order they were written (model order).
struct ModuleInfo {
  std::string module;
  std::map<std::string, std::string> attributes;
};

// A Dynamo/AOTAutograd graph, as source text.
struct Graph {
  std::string name;  // "__compiled_fn_1.Forward_Graph.1a2b3c4d"
  std::string kind;  // "captured", "forward", "backward"
  std::string text;
  std::map<std::string, std::string> attributes;  // e.g. the modules it was compiled for
};

// Naming rules of a dump, defined once (docs/dump-format.md).
std::string dataset_path(const RecordKey& key);  // "/tensors/layers.0/fwd_output.eager.0.1"
std::filesystem::path step_file_name(std::int64_t step);  // "step_00000042.h5"
// The step a committed step file's name says (step_file_name's inverse); none for another name.
std::optional<std::int64_t> step_of_file_name(const std::filesystem::path& file);
std::string shape_string(const std::vector<std::int64_t>& shape);   // "(2, 128, 4096)", "()"
std::uint64_t shape_numel(const std::vector<std::int64_t>& shape);  // 1 for a scalar's ()

}  // namespace dynaprobe::formats

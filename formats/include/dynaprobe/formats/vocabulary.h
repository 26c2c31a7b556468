// The names the capture writes into a dump and the analyzer reads back: provenance keys and
// values, /modules attributes and roles, notes. Defined once, here next to the schema, and
// exported to Python as dynaprobe._C.vocabulary (capture/bindings/formats_bindings.cpp), which
// the Python package uses instead of literals: the two sides cannot spell a name differently.
// docs/dump-format.md describes what each means.
#pragma once

#include <string_view>
#include <utility>

namespace dynaprobe::formats::vocabulary {

// Root attribute "provenance" of a step file: keys, and the values of "mode".
namespace provenance {
inline constexpr std::string_view kMode = "mode";
inline constexpr std::string_view kCaptureInput = "capture_input";
inline constexpr std::string_view kCastDtype = "cast_dtype";
inline constexpr std::string_view kScenario = "scenario";
inline constexpr std::string_view kRank = "rank";
inline constexpr std::string_view kAtol = "atol";
inline constexpr std::string_view kRtol = "rtol";
inline constexpr std::string_view kToleranceRules = "tolerance_rules";  // "<atol> <rtol> <glob>\n"
inline constexpr std::string_view kDtypeAwareTolerances = "dtype_aware_tolerances";
inline constexpr std::string_view kCreated = "created";
// PrecisionChecker(reference=...): "auto", "fp64", "fp32", "failing" or "None".
inline constexpr std::string_view kReference = "reference";
// What decides a row that has a reference verdict: "reference" (default) or "tolerances".
inline constexpr std::string_view kVerdict = "verdict";
// The user's own torch.autocast dtype around the checked modules ("torch.bfloat16"), if any.
inline constexpr std::string_view kAutocast = "autocast";
// An ops dump (dynaprobe bisect --ops, schema::kOpsDir): the module whose call it localises, the
// call, and the backend in words.
inline constexpr std::string_view kOpsModule = "ops_module";
inline constexpr std::string_view kOpsCall = "ops_call";
inline constexpr std::string_view kOpsBackend = "ops_backend";
// Where and with what the step was captured (docs/dump-format.md#provenance): the ranks of a run
// must agree on run, world_size, torch_version, backend and compile_scope (analyze/src/run.cpp).
inline constexpr std::string_view kProducer = "producer";
inline constexpr std::string_view kTorchVersion = "torch_version";
inline constexpr std::string_view kBackend = "backend";
inline constexpr std::string_view kCompileScope = "compile_scope";
inline constexpr std::string_view kWorldSize = "world_size";
inline constexpr std::string_view kRun = "run";  // the run folder's name
inline constexpr std::string_view kHost = "host";
inline constexpr std::string_view kDevice = "device";
inline constexpr std::string_view kParamDtypes = "param_dtypes";
inline constexpr std::string_view kPythonVersion = "python_version";
inline constexpr std::string_view kOs = "os";
inline constexpr std::string_view kCpu = "cpu";
inline constexpr std::string_view kCudaVersion = "cuda_version";
inline constexpr std::string_view kGpu = "gpu";
inline constexpr std::string_view kGpuDriver = "gpu_driver";
}  // namespace provenance
namespace mode {
inline constexpr std::string_view kSinglePass = "single_pass";
inline constexpr std::string_view kTwoPass = "two_pass";
inline constexpr std::string_view kEagerOnly = "eager_only";  // capture(side="eager")
inline constexpr std::string_view kCompiledOnly = "compiled_only";
}  // namespace mode

// The pass a record kind belongs to (formats::pass_name), as the report model's rows say it.
namespace pass {
inline constexpr std::string_view kForward = "forward";
inline constexpr std::string_view kBackward = "backward";
}  // namespace pass

// Attributes of /modules/<module>.
namespace module_attribute {
inline constexpr std::string_view kRole = "role";  // role::*
inline constexpr std::string_view kNote = "note";  // note::*: the module is a SKIP or a WARN
inline constexpr std::string_view kReason = "reason";
inline constexpr std::string_view kCalls = "calls";
inline constexpr std::string_view kCompiledFunctions = "compiled_functions";
inline constexpr std::string_view kGraphBreaks = "graph_breaks";
inline constexpr std::string_view kGraphBreakReasons = "graph_break_reasons";
inline constexpr std::string_view kCompileErrors = "compile_errors";
inline constexpr std::string_view kSharedArguments = "shared_arguments";
inline constexpr std::string_view kReferenceError = "reference_error";
// How many calls of the module got no reference although one was asked for (reference_error
// says why): the report's NO_REFERENCE row.
inline constexpr std::string_view kReferenceMissing = "reference_missing";
inline constexpr std::string_view kNestedFullyShard = "nested_fully_shard";
// The generators ("cpu", "cuda:0", ...) a compiled call drew random numbers from where the backend
// draws its own (inductor without fallback_random): the eager side drew other numbers.
inline constexpr std::string_view kRandomDraws = "random_draws";
// JSON: what replaying the module's calls needs besides its "replay" records (class path,
// backend, each recorded call's argument structure; docs/dump-format.md#replay-records).
inline constexpr std::string_view kReplay = "replay";
// Of an op in an ops dump (module "<graph>.<node>"): the aten op ("aten.rsqrt.default"), its graph
// ("forward", "backward", "inference") and its source line ("/path/file.py:162  code").
inline constexpr std::string_view kOp = "op";
inline constexpr std::string_view kGraph = "graph";
inline constexpr std::string_view kSource = "source";
}  // namespace module_attribute
namespace role {
inline constexpr std::string_view kWrapped = "wrapped";
inline constexpr std::string_view kIgnored = "ignored";
}  // namespace role

// Notes: the spec's report markers (常见标记说明) and the ones dynaprobe adds. Whether a note is a
// SKIP or a WARN is analyze's decision (its note table), not the name's spelling.
namespace note {
inline constexpr std::string_view kIgnored = "IGNORED";
inline constexpr std::string_view kCompiledWrapper = "SKIP_compiled_wrapper";
inline constexpr std::string_view kInsideCompiled = "SKIP_inside_compiled";
inline constexpr std::string_view kMissingFwdInCompiled = "MISSING_fwd_in_compiled";
inline constexpr std::string_view kMissingFwdInEager = "MISSING_fwd_in_eager";
inline constexpr std::string_view kMissingBwdInCompiled = "MISSING_bwd_in_compiled";
inline constexpr std::string_view kMissingBwdInEager = "MISSING_bwd_in_eager";
// Capture notes (module attribute "note").
inline constexpr std::string_view kNotRun = "NOT_RUN";            // the compiled copy never ran
inline constexpr std::string_view kNotCompiled = "NOT_COMPILED";  // Dynamo compiled no graph
inline constexpr std::string_view kHookError = "HOOK_ERROR";      // the eager re-run failed
// A reference was asked for (or on by default in low precision) but could not be computed.
inline constexpr std::string_view kNoReference = "NO_REFERENCE";
}  // namespace note

// What Python sees: dynaprobe._C.vocabulary.<NAME>.
inline constexpr std::pair<std::string_view, std::string_view> kExported[] = {
    {"PROVENANCE_MODE", provenance::kMode},
    {"PROVENANCE_CAPTURE_INPUT", provenance::kCaptureInput},
    {"PROVENANCE_CAST_DTYPE", provenance::kCastDtype},
    {"PROVENANCE_SCENARIO", provenance::kScenario},
    {"PROVENANCE_RANK", provenance::kRank},
    {"PROVENANCE_ATOL", provenance::kAtol},
    {"PROVENANCE_RTOL", provenance::kRtol},
    {"PROVENANCE_TOLERANCE_RULES", provenance::kToleranceRules},
    {"PROVENANCE_DTYPE_AWARE_TOLERANCES", provenance::kDtypeAwareTolerances},
    {"PROVENANCE_CREATED", provenance::kCreated},
    {"PROVENANCE_REFERENCE", provenance::kReference},
    {"PROVENANCE_VERDICT", provenance::kVerdict},
    {"PROVENANCE_AUTOCAST", provenance::kAutocast},
    {"PROVENANCE_OPS_MODULE", provenance::kOpsModule},
    {"PROVENANCE_OPS_CALL", provenance::kOpsCall},
    {"PROVENANCE_OPS_BACKEND", provenance::kOpsBackend},
    {"PROVENANCE_PRODUCER", provenance::kProducer},
    {"PROVENANCE_TORCH_VERSION", provenance::kTorchVersion},
    {"PROVENANCE_BACKEND", provenance::kBackend},
    {"PROVENANCE_COMPILE_SCOPE", provenance::kCompileScope},
    {"PROVENANCE_WORLD_SIZE", provenance::kWorldSize},
    {"PROVENANCE_RUN", provenance::kRun},
    {"PROVENANCE_HOST", provenance::kHost},
    {"PROVENANCE_DEVICE", provenance::kDevice},
    {"PROVENANCE_PARAM_DTYPES", provenance::kParamDtypes},
    {"PROVENANCE_PYTHON_VERSION", provenance::kPythonVersion},
    {"PROVENANCE_OS", provenance::kOs},
    {"PROVENANCE_CPU", provenance::kCpu},
    {"PROVENANCE_CUDA_VERSION", provenance::kCudaVersion},
    {"PROVENANCE_GPU", provenance::kGpu},
    {"PROVENANCE_GPU_DRIVER", provenance::kGpuDriver},
    {"MODE_SINGLE_PASS", mode::kSinglePass},
    {"MODE_TWO_PASS", mode::kTwoPass},
    {"MODE_EAGER_ONLY", mode::kEagerOnly},
    {"MODE_COMPILED_ONLY", mode::kCompiledOnly},
    {"PASS_FORWARD", pass::kForward},
    {"PASS_BACKWARD", pass::kBackward},
    {"ATTRIBUTE_ROLE", module_attribute::kRole},
    {"ATTRIBUTE_NOTE", module_attribute::kNote},
    {"ATTRIBUTE_REASON", module_attribute::kReason},
    {"ATTRIBUTE_CALLS", module_attribute::kCalls},
    {"ATTRIBUTE_COMPILED_FUNCTIONS", module_attribute::kCompiledFunctions},
    {"ATTRIBUTE_GRAPH_BREAKS", module_attribute::kGraphBreaks},
    {"ATTRIBUTE_GRAPH_BREAK_REASONS", module_attribute::kGraphBreakReasons},
    {"ATTRIBUTE_COMPILE_ERRORS", module_attribute::kCompileErrors},
    {"ATTRIBUTE_SHARED_ARGUMENTS", module_attribute::kSharedArguments},
    {"ATTRIBUTE_REFERENCE_ERROR", module_attribute::kReferenceError},
    {"ATTRIBUTE_REFERENCE_MISSING", module_attribute::kReferenceMissing},
    {"ATTRIBUTE_NESTED_FULLY_SHARD", module_attribute::kNestedFullyShard},
    {"ATTRIBUTE_RANDOM_DRAWS", module_attribute::kRandomDraws},
    {"ATTRIBUTE_REPLAY", module_attribute::kReplay},
    {"ATTRIBUTE_OP", module_attribute::kOp},
    {"ATTRIBUTE_GRAPH", module_attribute::kGraph},
    {"ATTRIBUTE_SOURCE", module_attribute::kSource},
    {"ROLE_WRAPPED", role::kWrapped},
    {"ROLE_IGNORED", role::kIgnored},
    {"NOTE_IGNORED", note::kIgnored},
    {"NOTE_COMPILED_WRAPPER", note::kCompiledWrapper},
    {"NOTE_INSIDE_COMPILED", note::kInsideCompiled},
    {"NOTE_MISSING_FWD_IN_COMPILED", note::kMissingFwdInCompiled},
    {"NOTE_MISSING_FWD_IN_EAGER", note::kMissingFwdInEager},
    {"NOTE_MISSING_BWD_IN_COMPILED", note::kMissingBwdInCompiled},
    {"NOTE_MISSING_BWD_IN_EAGER", note::kMissingBwdInEager},
    {"NOTE_NOT_RUN", note::kNotRun},
    {"NOTE_NOT_COMPILED", note::kNotCompiled},
    {"NOTE_HOOK_ERROR", note::kHookError},
    {"NOTE_NO_REFERENCE", note::kNoReference},
};

}  // namespace dynaprobe::formats::vocabulary

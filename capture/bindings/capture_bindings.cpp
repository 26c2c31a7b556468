// Python access to the capture library: dynaprobe._C.Recorder. The one TU of the extension that
// sees torch's Python headers (torch/csrc/utils/pybind.h gives the at::Tensor <-> torch.Tensor
// caster; it is the lightest header that does).
#include <torch/csrc/utils/pybind.h>
// torch/csrc/utils/pybind.h brings pybind11/pybind11.h and pybind11/stl.h.
#include <pybind11/stl/filesystem.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/capture/recorder.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/writer.h"

namespace py = pybind11;
namespace fmt = dynaprobe::formats;
using dynaprobe::capture::Recorder;

fmt::Kind kind_arg(const std::string& kind) {
  auto parsed = fmt::parse_kind(kind);
  if (!parsed) {
    throw dynaprobe::UsageError("unknown record kind '" + kind + "'; expected one of " +
                                fmt::kind_names());
  }
  return *parsed;
}

// Keep in sync with formats::side_name.
fmt::Side side_arg(const std::string& side) {
  auto parsed = fmt::parse_side(side);
  if (!parsed) {
    throw dynaprobe::UsageError("unknown side '" + side +
                                "'; expected one of eager, compiled, reference");
  }
  return *parsed;
}

namespace {

// Whether every row of one module in one pass passes as the engine judges them
// (analyze/judging.h): each pair's tolerances raised to the dtype-aware floor, then the last
// matching rule, then allclose over the verdict's metrics (MetricSet::kVerdict); and a float32 pair
// the tolerances pass must be within fp32 noise (the screen) unless it is at the rounding level
// of the rows given, as the engine judges a module's rows of one pass. reference="failing" asks
// this, so that it decides with the report's rules, never with a judge of its own. With the
// step's `recorder`, parameter gradient rows are judged through it (Recorder::judge_pair: every
// metric, kept for when collect() records the same sums, or taken from its background thread).
bool rows_pass(const std::string& module,
               const std::vector<std::tuple<std::string, at::Tensor, at::Tensor>>& rows,
               const dynaprobe::analyze::Judging& judging,
               std::optional<std::reference_wrapper<Recorder>> recorder) {
  struct Judged {
    fmt::Kind kind;
    fmt::DType eager, compiled;
    fmt::TensorMetrics metrics;
  };
  std::vector<Judged> judged;
  double magnitude = 0.0;
  for (const auto& [kind_word, eager, compiled] : rows) {
    if (eager.numel() != compiled.numel()) {
      throw dynaprobe::UsageError("rows_pass: the tensors of a " + kind_word +
                                  " row must have as many elements, but received " +
                                  std::to_string(eager.numel()) + " and " +
                                  std::to_string(compiled.numel()));
    }
    const fmt::Kind kind = kind_arg(kind_word);
    const fmt::DType eager_dtype = dynaprobe::capture::dtype_of(eager);
    const fmt::DType compiled_dtype = dynaprobe::capture::dtype_of(compiled);
    const auto tolerances = judging.row_tolerances(module, kind, eager_dtype, compiled_dtype);
    fmt::TensorMetrics metrics;
    {
      py::gil_scoped_release release;
      if (recorder && kind == fmt::Kind::kParamGrad) {
        metrics = recorder->get().judge_pair(eager, compiled, tolerances);
      } else {
        const at::Tensor e = dynaprobe::capture::host_values(eager);
        const at::Tensor c = dynaprobe::capture::host_values(compiled);
        metrics = dynaprobe::analyze::compare_in_memory(
            dynaprobe::capture::view_of(e), dynaprobe::capture::view_of(c), tolerances,
            fmt::WriterOptions{}.chunk_bytes, dynaprobe::analyze::MetricSet::kVerdict);
      }
    }
    if (!metrics.allclose) return false;
    if (std::isfinite(metrics.rms_eager)) magnitude = std::max(magnitude, metrics.rms_eager);
    judged.push_back({kind, eager_dtype, compiled_dtype, metrics});
  }
  return std::none_of(judged.begin(), judged.end(), [&](const Judged& row) {
    return judging.beyond_screen(module, row.kind, row.eager, row.compiled, row.metrics, magnitude);
  });
}

// A Recorder as Python opens it: `store` named by its word (PrecisionChecker(dump=...)).
std::unique_ptr<Recorder> open_recorder(const std::filesystem::path& dump_dir,
                                        fmt::Provenance provenance, std::size_t memory_budget_bytes,
                                        int zstd_level, std::size_t chunk_bytes,
                                        const std::string& store, bool strict_io,
                                        std::optional<dynaprobe::analyze::Judging> judging) {
  using dynaprobe::capture::StoreMode;
  dynaprobe::capture::RecorderOptions options;
  options.memory_budget_bytes = memory_budget_bytes;
  options.writer.zstd_level = zstd_level;
  options.writer.chunk_bytes = chunk_bytes;
  options.strict_io = strict_io;
  options.judging = std::move(judging);
  const auto& words = dynaprobe::capture::kStoreModeWords;
  const auto word = std::find(words.begin(), words.end(), store);
  if (word == words.end()) {
    std::string known;
    for (const std::string_view name : words) {
      known += (known.empty() ? "'" : ", '") + std::string(name) + "'";
    }
    throw dynaprobe::UsageError("store must be one of " + known + ", not '" + store + "'");
  }
  options.store = static_cast<StoreMode>(word - words.begin());
  return std::make_unique<Recorder>(dump_dir, std::move(provenance), options);
}

// What a step holds: tensors (record(), copy() to hand one over later), graphs and modules.
void bind_recording(py::class_<Recorder>& recorder) {
  recorder
      .def(
          "record",
          [](Recorder& self, std::string module, std::uint32_t call, const std::string& kind,
             std::uint32_t tensor_index, const std::string& side, const at::Tensor& tensor,
             std::string label, bool handed_over) {
            fmt::RecordKey key;
            key.module = std::move(module);
            key.call = call;
            key.kind = kind_arg(kind);
            key.tensor_index = tensor_index;
            key.side = side_arg(side);
            // Waiting for the budget must not stop other Python threads.
            py::gil_scoped_release release;
            self.record(std::move(key), tensor, std::move(label), handed_over);
          },
          py::arg("module"), py::arg("call"), py::arg("kind"), py::arg("tensor_index"),
          py::arg("side"), py::arg("tensor"), py::arg("label") = "", py::arg("handed_over") = false,
          R"doc(Snapshots `tensor` (any dtype, device, strides) and queues it.

Args:
  module: the module path, e.g. "layers.0.mlp" ("LOSS" for the loss).
  call: n-th call of the module within the step.
  kind: fwd_input, fwd_output, grad_input, grad_output, param_grad, loss or replay (stored
    whole, never compared: what a replay of the call needs).
  tensor_index: position of the tensor among the module's tensors of this kind.
  side: eager or compiled.
  tensor: the tensor; it may be changed in place as soon as record() returns.
  label: free text, e.g. a parameter name.
  handed_over: the caller gives the tensor up (a private copy nobody changes or reuses): a
    contiguous CPU tensor is then kept as it is, without a snapshot copy.
)doc")
      .def(
          "judge_later",
          [](Recorder& self, const std::string& module, const at::Tensor& eager,
             const at::Tensor& compiled, const std::optional<at::Tensor>& reference) {
            py::gil_scoped_release release;
            self.judge_later(module, eager, compiled, reference.value_or(at::Tensor()));
          },
          py::arg("module"), py::arg("eager"), py::arg("compiled"),
          py::arg("reference") = py::none(),
          "Queues the pair of `module`'s parameter gradient (and each side against `reference`) "
          "to be judged now, in the background; when the same tensors are recorded unchanged "
          "(handed over) as that row, its metrics are taken, not computed again, and a side judged "
          "in a copy (a device tensor, a strided one) is recorded from that copy; returns at once.")
      .def("hold_for_reference", &Recorder::hold_for_reference, py::arg("module"), py::arg("call"),
           py::call_guard<py::gil_scoped_release>(),
           "Single-pass: the pairs of `module`'s call `call` (parameter gradients aside) wait "
           "for a reference decided later, each judged in the background as soon as both sides "
           "are in; call it before the call's first record.")
      .def("settle_reference", &Recorder::settle_reference, py::arg("module"), py::arg("call"),
           py::call_guard<py::gil_scoped_release>(),
           "The reference of a call held by hold_for_reference() is recorded, or none will be: "
           "its pairs still waiting are judged without one.")
      .def("fails_before_reference", &Recorder::fails_before_reference, py::arg("module"),
           py::arg("call"), py::call_guard<py::gil_scoped_release>(),
           "Whether a pair of a call held by hold_for_reference(), queued so far, fails without "
           "the reference, as the report would judge it; waits until every record queued so far "
           "is judged.")
      .def("copy", &Recorder::copy, py::arg("tensor"), py::call_guard<py::gil_scoped_release>(),
           "A private contiguous copy of `tensor` to hand over later (record(..., "
           "handed_over=True)): a CPU tensor goes into the recorder's recycled snapshot memory, "
           "a device tensor is cloned on its device.")
      .def(
          "record_graph",
          [](Recorder& self, std::string name, std::string kind, std::string text,
             std::map<std::string, std::string> attributes) {
            fmt::Graph graph{std::move(name), std::move(kind), std::move(text),
                             std::move(attributes)};
            py::gil_scoped_release release;
            self.record_graph(std::move(graph));
          },
          py::arg("name"), py::arg("kind"), py::arg("text"),
          py::arg("attributes") = std::map<std::string, std::string>{},
          "Queues a graph (captured, forward or backward) of the current step.")
      .def(
          "record_module",
          [](Recorder& self, std::string module, std::map<std::string, std::string> attributes) {
            fmt::ModuleInfo info{std::move(module), std::move(attributes)};
            py::gil_scoped_release release;
            self.record_module(std::move(info));
          },
          py::arg("module"), py::arg("attributes") = std::map<std::string, std::string>{},
          "Queues what the capture knew about a module in this step (model order).");
}

// Every method releases the GIL before it touches the recorder: a call waiting for the
// recorder (another thread's record() under back-pressure) must not hold the GIL.
void bind_recorder(py::module_& m) {
  py::class_<Recorder> recorder(m, "Recorder", R"doc(
Records tensors of one dump (one process, one rank) into step files.

record() only snapshots the tensor into host memory and returns; compression and HDF5 writes run
on a background thread, under a host-memory budget: record() waits (with the GIL released) while
more than memory_budget_bytes of snapshots are queued. An error of the background thread (disk
full, ...) is raised by the next record*() call once and by end_step(); that step is lost,
earlier steps are intact, and the next begin_step() works normally. With strict_io=False only the
file is lost: the step is judged in memory, finish_step() gives it and its wait_committed() raises
why it was not stored; a folder whose lock another writer holds is never written. Calls from
several threads take turns.

Pairs are judged in memory with `judging` (a Judging), which the recorder writes into the
provenance (atol, rtol, tolerance_rules, dtype_aware_tolerances; the provenance given must not
hold them); without it, with the tolerances the provenance names, as a dump's reader takes them.
)doc");
  recorder
      .def(py::init(&open_recorder), py::arg("dump_dir"), py::arg("provenance"),
           py::arg("memory_budget_bytes") = std::size_t{1} << 30,
           py::arg("zstd_level") = fmt::kDefaultZstdLevel,
           py::arg("chunk_bytes") = std::size_t{1} << 20, py::arg("store") = "full",
           py::arg("strict_io") = true, py::arg("judging") = py::none())
      .def("begin_step", &Recorder::begin_step, py::arg("step"),
           py::call_guard<py::gil_scoped_release>(),
           "Starts a step; records until end_step() go into its file.")
      .def("failing_calls", &Recorder::failing_calls, py::call_guard<py::gil_scoped_release>(),
           "The (module, call) pairs of the current step with a pair judged in memory that "
           "fails its tolerances, as the report judges it (also pairs spilled beyond half the "
           "budget); waits until every record queued so far is judged, not written.")
      .def("finish_step", &Recorder::finish_step, py::call_guard<py::gil_scoped_release>(),
           "Ends the step once every record is judged and returns it as a PendingStep "
           "(compare_pending(), wait_committed()) while its file is still being written.")
      .def(
          "end_step",
          [](Recorder& self) {
            std::filesystem::path path;
            {
              py::gil_scoped_release release;
              path = self.end_step();
            }
            return path.string();
          },
          "Waits until the step is written, commits it and returns the step file's path.")
      .def_property_readonly("dump_dir",
                             [](const Recorder& self) { return self.dump_dir().string(); })
      .def_property_readonly("queued_bytes", &Recorder::queued_bytes,
                             "Bytes of snapshots not yet written or judged.")
      .def_property_readonly("held_bytes", &Recorder::held_bytes,
                             "Bytes of snapshots waiting for their twin to be judged.");
  bind_recording(recorder);
}

}  // namespace

void bind_capture(py::module_& m) {
  bind_recorder(m);
  // After the Recorder: its type names the argument in the signature.
  m.def("rows_pass", &rows_pass, py::arg("module"), py::arg("rows"), py::arg("judging"),
        py::arg("recorder") = py::none(),
        "Whether every row of `module` in one pass, `rows` as (kind, eager, compiled), passes as "
        "the engine judges it with `judging` (a Judging): its atol/rtol raised to the "
        "dtype-aware floor of either side's dtype, then the last rule matching module or kind, "
        "then allclose; and, for a float32 pair without a reference, within fp32 noise relative "
        "to eager's magnitude (the screen), unless at the rounding level of the rows given. "
        "With the step's `recorder`, param_grad rows are judged through it, with every metric, "
        "which it reuses when the same tensors are recorded (handed over) as that pair; a pair "
        "it judges in the background already (judge_later) is taken from there, waited for.");
  // The words of PrecisionChecker(dump=...), as the Recorder's `store` takes them: STORE_MODES,
  // and STORE_FULL = "full", STORE_FAILING, STORE_STATS.
  auto vocabulary = m.attr("vocabulary").cast<py::module_>();
  py::tuple store_modes(dynaprobe::capture::kStoreModeWords.size());
  for (std::size_t i = 0; i < store_modes.size(); ++i) {
    const std::string word(dynaprobe::capture::kStoreModeWords[i]);
    std::string name = "STORE_" + word;
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
    vocabulary.attr(name.c_str()) = word;
    store_modes[i] = word;
  }
  vocabulary.attr("STORE_MODES") = store_modes;
}

// Python access to the dump format: write and read step files (tests, tools, interop).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cctype>
#include <cstring>

#include "bindings.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/vocabulary.h"
#include "dynaprobe/formats/writer.h"

namespace py = pybind11;
namespace fmt = dynaprobe::formats;

namespace {

fmt::DType dtype_arg(const std::string& name) {
  auto dtype = fmt::parse_dtype(name);
  if (!dtype)
    throw dynaprobe::UsageError("unknown dtype '" + name + "'; expected a torch dtype name");
  return *dtype;
}

fmt::RecordKey key_arg(std::int64_t step, const std::string& module, std::uint32_t call,
                       const std::string& kind, std::uint32_t tensor_index,
                       const std::string& side) {
  return {step, module, call, kind_arg(kind), tensor_index, side_arg(side)};
}

py::dict record_dict(const fmt::RecordInfo& info) {
  py::dict d;
  d["step"] = info.key.step;
  d["module"] = info.key.module;
  d["call"] = info.key.call;
  d["kind"] = std::string(fmt::kind_name(info.key.kind));
  d["tensor_index"] = info.key.tensor_index;
  d["side"] = std::string(fmt::side_name(info.key.side));
  d["label"] = info.label;
  d["dtype"] = std::string(fmt::dtype_name(info.dtype));
  d["shape"] = py::tuple(py::cast(info.shape));
  d["stored_bytes"] = info.stored_bytes;
  d["stored"] = info.stored;
  return d;
}

// (dtype name, shape, bytes) of a whole tensor.
py::tuple tensor_tuple(fmt::DType dtype, const std::vector<std::int64_t>& shape,
                       const std::vector<std::byte>& data) {
  return py::make_tuple(std::string(fmt::dtype_name(dtype)), py::tuple(py::cast(shape)),
                        py::bytes(reinterpret_cast<const char*>(data.data()), data.size()));
}

// Writes one step. `records`: (module, call, kind, tensor_index, side, label, dtype, array) where
// array is any C-contiguous buffer (bfloat16 and float8 as their raw integer bits). `graphs`:
// (name, kind, text, attributes). `modules`: (module path, attributes) in model order, written
// as /modules/<module> (e.g. role=wrapped|ignored, note, reason).
std::filesystem::path write_step(const std::filesystem::path& dump_dir, std::int64_t step,
                                 const fmt::Provenance& provenance, const py::list& records,
                                 const py::list& graphs, int zstd_level, std::size_t chunk_bytes,
                                 const py::list& modules) {
  std::vector<fmt::Record> converted;
  std::vector<py::buffer_info> buffers;  // keep the Python buffers alive during the write
  buffers.reserve(records.size());
  for (const auto& item : records) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 8)
      throw dynaprobe::UsageError(
          "a record is an 8-tuple (module, call, kind, tensor_index, side, label, dtype, array)");
    fmt::Record record;
    record.key =
        key_arg(step, t[0].cast<std::string>(), t[1].cast<std::uint32_t>(),
                t[2].cast<std::string>(), t[3].cast<std::uint32_t>(), t[4].cast<std::string>());
    record.label = t[5].cast<std::string>();
    record.tensor.dtype = dtype_arg(t[6].cast<std::string>());
    buffers.push_back(t[7].cast<py::buffer>().request());
    const py::buffer_info& info = buffers.back();
    if (static_cast<std::size_t>(info.itemsize) != fmt::dtype_size(record.tensor.dtype)) {
      throw dynaprobe::UsageError(
          "record " + fmt::to_string(record.key) + ": dtype " + t[6].cast<std::string>() + " has " +
          std::to_string(fmt::dtype_size(record.tensor.dtype)) +
          "-byte elements, but the array has " + std::to_string(info.itemsize) + "-byte elements");
    }
    py::ssize_t expected_stride = info.itemsize;
    for (auto i = info.ndim; i-- > 0;) {
      if (info.shape[i] > 1 && info.strides[i] != expected_stride) {
        throw dynaprobe::UsageError(
            "record " + fmt::to_string(record.key) +
            ": the array must be C-contiguous (use numpy.ascontiguousarray)");
      }
      expected_stride *= info.shape[i];
    }
    record.tensor.shape.assign(info.shape.begin(), info.shape.end());
    record.tensor.data = info.ptr;
    converted.push_back(std::move(record));
  }
  fmt::WriterOptions options;
  options.zstd_level = zstd_level;
  options.chunk_bytes = chunk_bytes;
  py::gil_scoped_release release;
  fmt::StepWriter writer(dump_dir, step, provenance, options);
  writer.write(converted);
  {
    py::gil_scoped_acquire acquire;
    for (const auto& item : graphs) {
      auto t = item.cast<py::tuple>();
      fmt::Graph graph{t[0].cast<std::string>(), t[1].cast<std::string>(), t[2].cast<std::string>(),
                       t[3].cast<std::map<std::string, std::string>>()};
      py::gil_scoped_release again;
      writer.write_graph(graph);
    }
    for (const auto& item : modules) {
      auto t = item.cast<py::tuple>();
      if (t.size() != 2) throw dynaprobe::UsageError("a module is a 2-tuple (module, attributes)");
      fmt::ModuleInfo module{t[0].cast<std::string>(),
                             t[1].cast<std::map<std::string, std::string>>()};
      py::gil_scoped_release again;
      writer.write_module(module);
    }
  }
  return writer.commit();
}

py::dict read_step(const std::filesystem::path& path) {
  fmt::StepReader reader(path);
  py::dict d;
  d["step"] = reader.step();
  d["format_version"] = reader.format_version();
  d["provenance"] = reader.provenance();
  py::list records;
  for (const auto& info : reader.records()) records.append(record_dict(info));
  d["records"] = records;
  py::list metrics;  // judged at capture (format 1.3): the key of each pair, its tolerances
  for (const auto& stored : reader.stored_metrics()) {
    py::dict m;
    m["module"] = stored.key.module;
    m["call"] = stored.key.call;
    m["kind"] = std::string(fmt::kind_name(stored.key.kind));
    m["tensor_index"] = stored.key.tensor_index;
    m["atol"] = stored.tolerances.atol;
    m["rtol"] = stored.tolerances.rtol;
    m["allclose"] = stored.metrics.allclose;
    m["max_abs"] = stored.metrics.max_abs;
    metrics.append(m);
  }
  d["metrics"] = metrics;
  py::list graphs;
  for (const auto& graph : reader.graphs()) {
    graphs.append(py::make_tuple(graph.name, graph.kind, graph.text, graph.attributes));
  }
  d["graphs"] = graphs;
  py::list modules;  // /modules, in model order: (module, attributes)
  for (const auto& info : reader.modules())
    modules.append(py::make_tuple(info.module, info.attributes));
  d["modules"] = modules;
  return d;
}

py::tuple read_record(const std::filesystem::path& path, const std::string& module,
                      std::uint32_t call, const std::string& kind, std::uint32_t tensor_index,
                      const std::string& side) {
  fmt::StepReader reader(path);
  const auto key = key_arg(reader.step(), module, call, kind, tensor_index, side);
  const fmt::RecordInfo* info = reader.find(key);
  if (!info) {
    throw dynaprobe::FormatError(path.string() + ": no record " + fmt::to_string(key));
  }
  std::vector<std::byte> data;
  {
    py::gil_scoped_release release;
    data = reader.read(*info);
  }
  return tensor_tuple(info->dtype, info->shape, data);
}

py::tuple read_dataset(const std::filesystem::path& path, const std::string& dataset) {
  fmt::TensorStream stream = fmt::open_dataset(path, dataset);
  std::vector<std::byte> data(fmt::dtype_size(stream.dtype()) * [&] {
    std::size_t n = 1;
    for (auto d : stream.shape()) n *= static_cast<std::size_t>(d);
    return n;
  }());
  {
    py::gil_scoped_release release;
    const std::size_t element_size = fmt::dtype_size(stream.dtype());
    fmt::stream_chunks(stream, [&](fmt::ChunkExtent extent, const std::byte* chunk) {
      std::memcpy(data.data() + extent.first_element * element_size, chunk,
                  extent.element_count * element_size);
    });
  }
  return tensor_tuple(stream.dtype(), stream.shape(), data);
}

// What Recorder.finish_step() gives: registered before compare_pending() and the Recorder, which
// name it in their signatures.
void bind_pending_step(py::module_& m) {
  py::class_<fmt::PendingStep>(m, "PendingStep", R"doc(
A step the recorder has judged and is still writing (Recorder.finish_step()).
)doc")
      .def_property_readonly(
          "file", [](const fmt::PendingStep& self) { return self.file.string(); },
          "Where the step is being committed.")
      .def_readonly("step", &fmt::PendingStep::step)
      .def(
          "wait_committed",
          [](const fmt::PendingStep& self) {
            py::gil_scoped_release release;
            self.wait_committed();
          },
          "Waits until the step's file is committed; raises the error that lost it.");
}

}  // namespace

void bind_formats(py::module_& m) {
  // The names capture writes and the analyzer reads, defined once in formats/vocabulary.h.
  py::module_ vocabulary = m.def_submodule(
      "vocabulary", "Provenance keys and values, /modules attributes and roles, notes");
  for (const auto& [name, value] : fmt::vocabulary::kExported) {
    vocabulary.attr(std::string(name).c_str()) = std::string(value);
  }
  // Record kinds and sides (formats/record.h): KIND_FWD_INPUT = "fwd_input", ..., SIDE_EAGER =
  // "eager", ..., and KINDS: {kind: its pass} for every compared kind, in enumerator order.
  const auto upper = [](std::string_view name) {
    std::string out(name);
    for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return out;
  };
  py::dict kinds;
  for (int i = 0; i <= static_cast<int>(fmt::Kind::kReplay); ++i) {
    const auto kind = static_cast<fmt::Kind>(i);
    const std::string name(fmt::kind_name(kind));
    vocabulary.attr(("KIND_" + upper(name)).c_str()) = name;
    if (fmt::is_compared(kind)) kinds[py::str(name)] = std::string(fmt::pass_name(kind));
  }
  vocabulary.attr("KINDS") = kinds;
  for (const fmt::Side side : {fmt::Side::kEager, fmt::Side::kCompiled, fmt::Side::kReference}) {
    const std::string name(fmt::side_name(side));
    vocabulary.attr(("SIDE_" + upper(name)).c_str()) = name;
  }
  vocabulary.attr("LOSS_MODULE") = std::string(fmt::kLossModule);
  // The folder layout (schema.h): rank<R>/ folders of a run, the default folder of runs.
  vocabulary.attr("RANK_DIR_PREFIX") = std::string(fmt::schema::kRankDirPrefix);
  vocabulary.attr("RUNS_DIR") = std::string(fmt::schema::kRunsDir);
  m.def("format_version", [] {
    return std::to_string(fmt::schema::kFormatMajor) + "." +
           std::to_string(fmt::schema::kFormatMinor);
  });
  m.def("write_step", &write_step, py::arg("dump_dir"), py::arg("step"), py::arg("provenance"),
        py::arg("records"), py::arg("graphs") = py::list(),
        py::arg("zstd_level") = fmt::kDefaultZstdLevel,
        py::arg("chunk_bytes") = std::size_t{1} << 20, py::arg("modules") = py::list());
  m.def("step_of_file_name", &fmt::step_of_file_name, py::arg("file"),
        "The step a committed step file's name says (\"step_00000042.h5\": 42), None for "
        "another name.");
  m.def(
      "list_dump",
      [](const std::filesystem::path& dump) {
        const fmt::DumpFiles files = fmt::list_dump(dump);
        const auto strings = [](const std::vector<std::filesystem::path>& paths) {
          std::vector<std::string> out;
          for (const auto& path : paths) out.push_back(path.string());
          return out;
        };
        return std::pair{strings(files.steps), strings(files.unfinished)};
      },
      py::arg("dump"),
      "(committed, unfinished) step files of one dump (a rank folder, or a step file itself): "
      "the committed ones in step order, the unfinished ones (.partial: steps in progress at a "
      "crash) by name. Raises when the path does not exist.");
  m.def("read_step", &read_step, py::arg("path"));
  m.def("read_record", &read_record, py::arg("path"), py::arg("module"), py::arg("call"),
        py::arg("kind"), py::arg("tensor_index"), py::arg("side"));
  m.def("read_dataset", &read_dataset, py::arg("path"), py::arg("dataset"));
  bind_pending_step(m);
}

// Records a few libtorch tensors into a dump with the capture library, reads them back with the
// formats reader and prints them: how a C++ program (a custom training loop, an inference server)
// writes dumps that `dynaprobe compare` analyses.
//
//   record_tensors [DUMP_DIR]          (default: dynaprobe_runs/record_tensors)
//   dynaprobe compare DUMP_DIR         then compares its eager side with its compiled side
//
// The "compiled" side here is a stand-in: the same layer computed in bfloat16, so the comparison
// has a difference to find: bf16 rounding, within bf16's tolerance floor by default, a FAIL with
// `dynaprobe compare DUMP_DIR --fixed-tolerances` (the spec's tolerances as they are).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: fast to compile
#include <ATen/core/Tensor.h>
#include <ATen/ops/linspace.h>

#include <cstdio>
#include <filesystem>
#include <vector>

#include "dynaprobe/capture/recorder.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"

namespace capture = dynaprobe::capture;
namespace fmt = dynaprobe::formats;
using fmt::Kind, fmt::Side;

int main(int argc, char** argv) {
  const std::filesystem::path dump = argc > 1 ? argv[1] : "dynaprobe_runs/record_tensors";
  try {
    // A layer's input, weight and output, computed twice: in float32 ("eager") and in bfloat16.
    const at::Tensor x = at::linspace(-2.0, 2.0, 32).reshape({4, 8});
    const at::Tensor w = at::linspace(-1.0, 1.0, 64).reshape({8, 8}).sin();
    const at::Tensor eager_out = x.matmul(w).relu();
    const at::Tensor compiled_out = x.to(at::kBFloat16).matmul(w.to(at::kBFloat16)).relu();

    // Provenance travels in the dump; atol/rtol become the analyzer's default tolerances.
    capture::Recorder recorder(dump, {{"producer", "examples/record_tensors"},
                                      {"mode", "two_pass"},
                                      {"atol", "0.0001"},
                                      {"rtol", "0.001"}});
    std::int64_t step = 0;  // a committed step is never overwritten: take the next free number
    while (std::filesystem::exists(dump / fmt::step_file_name(step))) ++step;
    recorder.begin_step(step);
    recorder.record_module({"layer", {{"role", "wrapped"}}});
    // Keys: (step, module, call, kind, tensor index, side); record() sets the step. Each call
    // only snapshots the tensor; compression and writing run on a background thread.
    recorder.record({0, "layer", 0, Kind::kFwdInput, 0, Side::kEager}, x, "x");
    recorder.record({0, "layer", 0, Kind::kFwdInput, 0, Side::kCompiled}, x, "x");
    recorder.record({0, "layer", 0, Kind::kFwdOutput, 0, Side::kEager}, eager_out);
    recorder.record({0, "layer", 0, Kind::kFwdOutput, 0, Side::kCompiled}, compiled_out);
    recorder.record({0, std::string(fmt::kLossModule), 0, Kind::kLoss, 0, Side::kEager},
                    eager_out.mean());
    recorder.record({0, std::string(fmt::kLossModule), 0, Kind::kLoss, 0, Side::kCompiled},
                    compiled_out.mean());
    const std::filesystem::path file = recorder.end_step();  // waits, commits, returns the file

    // Read back with the formats library alone (no torch needed for this part).
    fmt::StepReader reader(file);
    std::printf("wrote %s (format %s, step %lld)\n", file.c_str(), reader.format_version().c_str(),
                static_cast<long long>(reader.step()));
    for (const fmt::RecordInfo& info : reader.records()) {
      const std::vector<std::byte> bytes = reader.read(info);
      std::vector<float> values(info.numel());
      fmt::convert_to_float32(info.dtype, bytes.data(), values.size(), values.data());
      std::printf("  %-6s %-10s %-9s %-9s %-7s", info.key.module.c_str(),
                  std::string(fmt::kind_name(info.key.kind)).c_str(),
                  std::string(fmt::side_name(info.key.side)).c_str(),
                  std::string(fmt::dtype_name(info.dtype)).c_str(),
                  fmt::shape_string(info.shape).c_str());
      for (std::size_t i = 0; i < values.size() && i < 4; ++i) std::printf(" %9.5f", values[i]);
      std::printf("%s\n", values.size() > 4 ? " ..." : "");
    }
    std::printf("compare the two sides: dynaprobe compare %s\n", dump.c_str());
    return 0;
  } catch (const dynaprobe::Error& error) {
    std::fprintf(stderr, "record_tensors: %s\n", error.what());
    return 3;
  }
}

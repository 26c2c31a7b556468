// Writes a sample set of tensors as one dump step, reads it back, checks every byte and prints
// what was written: the smallest end-to-end use of dynaprobe's dump format.
//
//   format_roundtrip [DUMP_DIR]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/writer.h"

namespace fmt = dynaprobe::formats;

int main(int argc, char** argv) {
  const std::filesystem::path dump = argc > 1 ? argv[1] : "dynaprobe_runs/format_roundtrip";
  try {
    // Activations of a small MLP, rounded to bfloat16 precision as in mixed-precision training.
    std::vector<float> activations(64 * 1024);
    for (std::size_t i = 0; i < activations.size(); ++i) {
      float value = std::sin(static_cast<float>(i) * 0.01f) * 3.0f;
      std::uint32_t bits;
      std::memcpy(&bits, &value, 4);
      bits &= 0xffff0000u;
      std::memcpy(&value, &bits, 4);
      activations[i] = value;
    }
    std::vector<std::uint16_t> bf16(activations.size());
    for (std::size_t i = 0; i < bf16.size(); ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &activations[i], 4);
      bf16[i] = static_cast<std::uint16_t>(bits >> 16);
    }
    const float loss = 0.333408f;
    using fmt::Kind, fmt::Side, fmt::DType;
    const auto make_record = [](std::string module, Kind kind, Side side, fmt::TensorView tensor) {
      fmt::Record r;
      r.key = {0, std::move(module), 0, kind, 0, side};
      r.tensor = std::move(tensor);
      return r;
    };
    std::vector<fmt::Record> records;
    records.push_back(make_record("layers.0", Kind::kFwdInput, Side::kEager,
                                  {DType::kFloat32, {64, 1024}, activations.data()}));
    records.push_back(make_record("layers.0", Kind::kFwdOutput, Side::kEager,
                                  {DType::kBFloat16, {64, 1024}, bf16.data()}));
    records.push_back(make_record("layers.0", Kind::kFwdOutput, Side::kCompiled,
                                  {DType::kBFloat16, {64, 1024}, bf16.data()}));
    records.push_back(make_record(std::string(fmt::kLossModule), Kind::kLoss, Side::kCompiled,
                                  {DType::kFloat32, {}, &loss}));
    std::filesystem::create_directories(dump);
    std::int64_t step = 0;
    while (std::filesystem::exists(dump / fmt::step_file_name(step))) ++step;
    for (auto& record : records) record.key.step = step;

    const auto start = std::chrono::steady_clock::now();
    // The records are laid out as a single-pass capture writes them (the input once, both
    // outputs, the compiled loss): saying so lets `dynaprobe compare` pair them as such.
    fmt::StepWriter writer(dump, step,
                           {{"producer", "examples/format_roundtrip"}, {"mode", "single_pass"}});
    writer.write(records);
    writer.write_graph({"__compiled_fn_0.Captured_Graph.00000000",
                        "captured",
                        "def forward(self, x):\n    return (x,)\n",
                        {{"modules", "layers.0"}}});
    const auto path = writer.commit();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    fmt::StepReader reader(path);
    std::printf("wrote %s (format %s, step %lld) in %.1f ms\n", path.c_str(),
                reader.format_version().c_str(), static_cast<long long>(reader.step()),
                seconds * 1e3);
    std::printf("  %-10s %-10s %-9s %-5s %-9s %-12s %10s %10s  %s\n", "module", "kind", "side",
                "index", "dtype", "shape", "bytes", "stored", "round trip");
    bool all_equal = true;
    for (std::size_t i = 0; i < reader.records().size(); ++i) {
      const auto& info = reader.records()[i];
      const auto data = reader.read(info);
      const bool equal = data.size() == records[i].tensor.nbytes() &&
                         std::memcmp(data.data(), records[i].tensor.data, data.size()) == 0;
      all_equal = all_equal && equal;
      std::printf(
          "  %-10s %-10s %-9s %-5u %-9s %-12s %10llu %10llu  %s\n", info.key.module.c_str(),
          std::string(fmt::kind_name(info.key.kind)).c_str(),
          std::string(fmt::side_name(info.key.side)).c_str(), info.key.tensor_index,
          std::string(fmt::dtype_name(info.dtype)).c_str(), fmt::shape_string(info.shape).c_str(),
          static_cast<unsigned long long>(info.nbytes()),
          static_cast<unsigned long long>(info.stored_bytes), equal ? "identical" : "DIFFERENT");
    }
    for (const auto& graph : reader.graphs()) {
      std::printf("  graph %s (%s, %zu bytes)\n", graph.name.c_str(), graph.kind.c_str(),
                  graph.text.size());
    }
    std::printf("%s\n", all_equal ? "round trip: every byte identical" : "round trip: MISMATCH");
    return all_equal ? 0 : 1;
  } catch (const dynaprobe::Error& error) {
    std::fprintf(stderr, "format_roundtrip: %s\n", error.what());
    return 3;
  }
}

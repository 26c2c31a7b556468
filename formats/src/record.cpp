#include "dynaprobe/formats/record.h"

#include <array>

#include "dynaprobe/formats/error.h"

namespace dynaprobe::formats {
namespace {

constexpr std::array<std::string_view, 6> kKindNames = {"fwd_input",   "fwd_output", "grad_input",
                                                        "grad_output", "param_grad", "loss"};
constexpr std::array<std::string_view, 3> kSideNames = {"eager", "compiled", "reference"};

template <typename Enum, std::size_t N>
std::optional<Enum> parse_name(const std::array<std::string_view, N>& names,
                               std::string_view name) {
  for (std::size_t i = 0; i < N; ++i) {
    if (names[i] == name) return static_cast<Enum>(i);
  }
  return std::nullopt;
}

}  // namespace

std::string_view kind_name(Kind kind) { return kKindNames[static_cast<std::size_t>(kind)]; }
std::optional<Kind> parse_kind(std::string_view name) { return parse_name<Kind>(kKindNames, name); }
std::string_view side_name(Side side) { return kSideNames[static_cast<std::size_t>(side)]; }
std::optional<Side> parse_side(std::string_view name) { return parse_name<Side>(kSideNames, name); }

std::string to_string(const RecordKey& key) {
  return "step " + std::to_string(key.step) + " " + key.module + " call " +
         std::to_string(key.call) + " " + std::string(kind_name(key.kind)) + "[" +
         std::to_string(key.tensor_index) + "] (" + std::string(side_name(key.side)) + ")";
}

void validate_module_path(std::string_view module) {
  if (module.empty() || module == "." || module == ".." ||
      module.find('/') != std::string_view::npos) {
    throw UsageError("invalid module path '" + std::string(module) +
                     "': expected a non-empty name without '/' (e.g. 'layers.0.mlp')");
  }
}

std::uint64_t TensorView::numel() const {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

}  // namespace dynaprobe::formats

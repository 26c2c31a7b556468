#include "dynaprobe/formats/record.h"

#include <array>
#include <charconv>
#include <cstdio>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::formats {
namespace {

struct KindInfo {
  Kind kind;
  std::string_view name;
  bool forward;          // recorded in the forward pass (is_forward)
  bool compared = true;  // paired and judged (is_compared)
};
constexpr KindInfo kKinds[] = {
    {Kind::kFwdInput, "fwd_input", true},    {Kind::kFwdOutput, "fwd_output", true},
    {Kind::kGradInput, "grad_input", false}, {Kind::kGradOutput, "grad_output", false},
    {Kind::kParamGrad, "param_grad", false}, {Kind::kLoss, "loss", false},
    {Kind::kReplay, "replay", false, false},
};
constexpr std::array<std::string_view, 3> kSideNames = {"eager", "compiled", "reference"};

// kKinds is indexed by the enumerator: each entry must stand at its own kind's position.
constexpr bool kinds_in_enumerator_order() {
  for (std::size_t i = 0; i < std::size(kKinds); ++i) {
    if (static_cast<std::size_t>(kKinds[i].kind) != i) return false;
  }
  return std::size(kKinds) == static_cast<std::size_t>(Kind::kReplay) + 1;
}
static_assert(kinds_in_enumerator_order(), "kKinds must list every Kind in enumerator order");
static_assert(kSideNames.size() == static_cast<std::size_t>(Side::kReference) + 1);

template <typename Enum, std::size_t N>
std::optional<Enum> parse_name(const std::array<std::string_view, N>& names,
                               std::string_view name) {
  for (std::size_t i = 0; i < N; ++i) {
    if (names[i] == name) return static_cast<Enum>(i);
  }
  return std::nullopt;
}

const KindInfo& kind_info(Kind kind) { return kKinds[static_cast<std::size_t>(kind)]; }

}  // namespace

std::string_view kind_name(Kind kind) { return kind_info(kind).name; }
std::optional<Kind> parse_kind(std::string_view name) {
  for (const KindInfo& info : kKinds) {
    if (info.name == name) return info.kind;
  }
  return std::nullopt;
}
std::string kind_names() {
  std::string names;
  for (const KindInfo& info : kKinds) names += (names.empty() ? "" : ", ") + std::string(info.name);
  return names;
}
bool is_forward(Kind kind) { return kind_info(kind).forward; }
bool is_compared(Kind kind) { return kind_info(kind).compared; }
std::string_view pass_name(Kind kind) {
  return is_forward(kind) ? vocabulary::pass::kForward : vocabulary::pass::kBackward;
}
std::string_view side_name(Side side) { return kSideNames[static_cast<std::size_t>(side)]; }
std::optional<Side> parse_side(std::string_view name) { return parse_name<Side>(kSideNames, name); }

std::string to_string(const RecordKey& key) {
  return "step " + std::to_string(key.step) + " " + key.module + " call " +
         std::to_string(key.call) + " " + std::string(kind_name(key.kind)) + "[" +
         std::to_string(key.tensor_index) + "] (" + std::string(side_name(key.side)) + ")";
}

namespace {

// Length of the valid UTF-8 sequence starting at text[i] (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), 0 when it is not one.
std::size_t utf8_length(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  std::size_t length = 0;
  unsigned char low = 0x80, high = 0xbf;  // range of the second byte
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    if (lead == 0xe0) low = 0xa0;
    if (lead == 0xed) high = 0x9f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    if (lead == 0xf0) low = 0x90;
    if (lead == 0xf4) high = 0x8f;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  if (byte(i + 1) < low || byte(i + 1) > high) return 0;
  for (std::size_t k = 2; k < length; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xbf) return 0;
  }
  return length;
}

void append_hex(std::string& out, unsigned char c) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  out += "\\x";
  out += kDigits[c >> 4];
  out += kDigits[c & 15];
}

}  // namespace

std::string printable_name(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  for (std::size_t i = 0; i < name.size();) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) {
        append_hex(out, c);
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    const std::size_t length = utf8_length(name, i);
    if (length == 0) {
      append_hex(out, c);
      ++i;
    } else if (c == 0xc2 && static_cast<unsigned char>(name[i + 1]) < 0xa0) {  // C1 controls
      append_hex(out, c);
      append_hex(out, static_cast<unsigned char>(name[i + 1]));
      i += 2;
    } else {
      out.append(name.substr(i, length));
      i += length;
    }
  }
  return out;
}

std::string quoted_name(std::string_view name) {
  std::string quoted(1, '\'');
  quoted += printable_name(name);
  quoted += '\'';
  return quoted;
}

void validate_module_path(std::string_view module) {
  if (module.empty() || module == "." || module == ".." ||
      module.find('/') != std::string_view::npos) {
    throw UsageError("invalid module path '" + std::string(module) +
                     "': expected a non-empty name without '/' (e.g. 'layers.0.mlp')");
  }
}

std::uint64_t TensorView::numel() const { return shape_numel(shape); }

std::uint64_t shape_numel(const std::vector<std::int64_t>& shape) {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

std::string dataset_path(const RecordKey& key) {
  return "/" + std::string(schema::kTensorsGroup) + "/" + key.module + "/" +
         std::string(kind_name(key.kind)) + "." + std::string(side_name(key.side)) + "." +
         std::to_string(key.call) + "." + std::to_string(key.tensor_index);
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string text = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  if (shape.size() == 1) text += ",";
  return text + ")";
}
std::filesystem::path step_file_name(std::int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "%.*s%08lld%.*s",
                static_cast<int>(schema::kStepFilePrefix.size()), schema::kStepFilePrefix.data(),
                static_cast<long long>(step), static_cast<int>(schema::kStepFileSuffix.size()),
                schema::kStepFileSuffix.data());
  return name;
}

std::optional<std::int64_t> step_of_file_name(const std::filesystem::path& file) {
  const std::string name = file.filename().string();
  const std::string_view prefix = schema::kStepFilePrefix, suffix = schema::kStepFileSuffix;
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix)) {
    return std::nullopt;
  }
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size() - suffix.size();
  std::int64_t step = 0;
  const auto parsed = std::from_chars(first, last, step);
  if (parsed.ec != std::errc() || parsed.ptr != last || step < 0) return std::nullopt;
  return step;
}

std::string provenance_value(const Provenance& provenance, std::string_view key) {
  const auto found = provenance.find(std::string(key));
  return found == provenance.end() ? std::string() : found->second;
}

}  // namespace dynaprobe::formats

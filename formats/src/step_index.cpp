// The phases of opening a step file that do not touch HDF5 (step_index.h).
#include "step_index.h"

#include <charconv>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"

namespace dynaprobe::formats {

bool FormatVersion::newer() const {
  return major > schema::kFormatMajor ||
         (major == schema::kFormatMajor && minor > schema::kFormatMinor);
}

FormatVersion parse_format_version(const std::string& text, const std::string& where) {
  FormatVersion version{text, -1, 0};
  const char* first = text.data();
  const char* last = text.data() + text.size();
  const auto malformed = [&] {
    return FormatError(where + ": format version '" + text +
                       "' is not of the form <major>.<minor>");
  };
  const auto parsed = std::from_chars(first, last, version.major);
  if (parsed.ec != std::errc() || version.major < 0) throw malformed();
  if (parsed.ptr < last && *parsed.ptr == '.') {
    if (std::from_chars(parsed.ptr + 1, last, version.minor).ec != std::errc() ||
        version.minor < 0) {
      throw malformed();
    }
  }
  if (version.major > schema::kFormatMajor) {
    throw FormatError(where + ": written in dump format " + text +
                      ", but this dynaprobe reads format " + std::to_string(schema::kFormatMajor) +
                      ".x; upgrade dynaprobe to read it");
  }
  return version;
}

std::int64_t parse_step(const std::string& text, const std::string& where) {
  std::int64_t step = 0;
  if (std::from_chars(text.data(), text.data() + text.size(), step).ec != std::errc()) {
    throw FormatError(where + ": step attribute '" + text + "' is not an integer");
  }
  return step;
}

std::optional<RecordInfo> record_of_row(const IndexRow& row, std::size_t i, std::int64_t step,
                                        const std::vector<std::uint64_t>& chunk_hashes,
                                        const std::string& where, std::string& unknown) {
  RecordInfo info;
  info.key.step = step;
  info.key.module = row.module ? row.module : "";
  info.key.call = row.call;
  info.key.tensor_index = row.tensor_index;
  const auto kind = parse_kind(row.kind ? row.kind : "");
  const auto side = parse_side(row.side ? row.side : "");
  const auto dtype = parse_dtype(row.dtype ? row.dtype : "");
  if (!kind || !side || !dtype) {
    unknown = "index row " + std::to_string(i) + " (module " + quoted_name(info.key.module) +
              "): unknown " +
              (!kind   ? "kind " + quoted_name(row.kind ? row.kind : "")
               : !side ? "side " + quoted_name(row.side ? row.side : "")
                       : "dtype " + quoted_name(row.dtype ? row.dtype : ""));
    return std::nullopt;
  }
  info.key.kind = *kind;
  info.key.side = *side;
  info.dtype = *dtype;
  info.label = row.label ? row.label : "";
  const auto* dims = static_cast<const std::int64_t*>(row.shape.p);
  info.shape.assign(dims, dims + row.shape.len);
  info.stored_bytes = row.stored_bytes;
  info.chunk_offset = row.chunk_offset;
  info.chunk_filter_mask = row.chunk_filter_mask;
  info.chunk_hash = row.chunk_hash;
  if (row.chunk_count > 0) {
    if (row.chunk_hashes_first > chunk_hashes.size() ||
        row.chunk_count > chunk_hashes.size() - row.chunk_hashes_first) {
      throw FormatError(where + ": damaged /index: row " + std::to_string(i) +
                        " points past the end of /chunk_hashes");
    }
    const auto first = chunk_hashes.begin() + static_cast<std::ptrdiff_t>(row.chunk_hashes_first);
    info.chunk_hashes.assign(first, first + static_cast<std::ptrdiff_t>(row.chunk_count));
  }
  return info;
}

}  // namespace dynaprobe::formats

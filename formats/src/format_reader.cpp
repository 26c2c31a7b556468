// What every dump format generation stores alike, and which generation reads a file
// (format_reader.h).
#include "format_reader.h"

#include <cstring>

#include "dynaprobe/formats/schema.h"

namespace dynaprobe::formats {

const FormatReader& format_reader(const FormatVersion& version) {
  return version.major >= 2 ? format_2_reader() : format_1_reader();
}

std::string hash_name(HashAlgorithm hash) {
  return hash == HashAlgorithm::kXxh3 ? "XXH3" : "XXH64";
}

std::uint64_t file_size(hid_t file) {
  hsize_t size = 0;
  return H5Fget_filesize(file, &size) < 0 ? 0 : size;
}

FormatError corrupt_chunk(const std::string& where, std::size_t chunk, const std::string& what) {
  return FormatError(where + ": chunk " + std::to_string(chunk) + " is corrupt: " + what);
}

h5::Handle open_index(hid_t file, const std::string& where) {
  const std::string index_name = root_path(schema::kIndexDataset);
  if (H5Lexists(file, index_name.c_str(), H5P_DEFAULT) <= 0) {
    throw FormatError(where + ": no " + index_name +
                      " table: not a complete dynaprobe step file (was it committed?)");
  }
  return h5::dataset_handle(H5Dopen2(file, index_name.c_str(), H5P_DEFAULT), "opening the index",
                            where);
}

std::vector<std::uint64_t> read_chunk_hashes(hid_t file, const std::string& where) {
  const std::string name = root_path(schema::kChunkHashesDataset);
  if (H5Lexists(file, name.c_str(), H5P_DEFAULT) <= 0) {
    throw FormatError(where + ": damaged: no " + name + " dataset, which its format has");
  }
  h5::Handle dataset = h5::dataset_handle(H5Dopen2(file, name.c_str(), H5P_DEFAULT),
                                          "opening the chunk hashes", where);
  h5::Handle space =
      h5::space_handle(H5Dget_space(dataset.get()), "reading the chunk hashes", where);
  const hssize_t count = H5Sget_simple_extent_npoints(space.get());
  if (count < 0 || H5Sget_simple_extent_ndims(space.get()) != 1) {
    throw FormatError(where + ": damaged " + name + ": expected a 1-D dataset");
  }
  h5::Handle type = h5::type_handle(H5Dget_type(dataset.get()), "reading the chunk hashes", where);
  if (H5Tequal(type.get(), H5T_STD_U64LE) <= 0 ||
      static_cast<std::uint64_t>(count) > file_size(file) / sizeof(std::uint64_t)) {
    throw FormatError(where + ": damaged " + name + ": expected uint64 hashes, at most as many " +
                      "as the file's size allows");
  }
  std::vector<std::uint64_t> hashes(static_cast<std::size_t>(count));
  if (!hashes.empty()) {
    h5::check<FormatError>(
        H5Dread(dataset.get(), H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, hashes.data()),
        "reading the chunk hashes", where);
  }
  return hashes;
}

std::string read_fixed_graph_text(hid_t dataset, hid_t type, const std::string& context) {
  const std::size_t size = H5Tget_size(type);
  hsize_t stored = 0;
  const hid_t file = H5Iget_file_id(dataset);
  if (file >= 0) {
    H5Fget_filesize(file, &stored);
    H5Fclose(file);
  }
  if (size == 0 || size > stored) {
    throw FormatError(context + ": damaged: a graph of " + std::to_string(size) +
                      " bytes in a file of " + std::to_string(stored));
  }
  std::string value(size, '\0');
  h5::check<FormatError>(H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, value.data()),
                         "reading graph text", context);
  return h5::fixed_string(value.data(), size);
}

std::vector<StoredMetrics> read_stored_metrics(hid_t file, const std::vector<RecordInfo>& records,
                                               const std::vector<std::int64_t>& record_of_index_row,
                                               HashAlgorithm hash, const std::string& where) {
  const std::string name = root_path(schema::kMetricsDataset);
  if (H5Lexists(file, name.c_str(), H5P_DEFAULT) <= 0) return {};
  const std::string context = where + " " + name;
  h5::Handle table = h5::dataset_handle(H5Dopen2(file, name.c_str(), H5P_DEFAULT),
                                        "opening the metrics table", where);
  h5::Handle space = h5::space_handle(H5Dget_space(table.get()), "reading the metrics", context);
  const hssize_t count = H5Sget_simple_extent_npoints(space.get());
  if (count < 0 || H5Sget_simple_extent_ndims(space.get()) != 1) {
    throw FormatError(context + ": damaged: expected a 1-D table");
  }
  // The checksum covers the bytes as stored, whatever columns this reader knows: a table written
  // with more metrics (a newer writer) or fewer (an older one) is checked all the same, and read
  // by column name below (a column the file lacks keeps its default).
  h5::Handle stored_type =
      h5::type_handle(H5Dget_type(table.get()), "reading the metrics type", context);
  refuse_variable_length(stored_type.get(), context);  // numbers only, in every version
  const std::size_t row_size = H5Tget_size(stored_type.get());
  if (row_size == 0 || static_cast<std::uint64_t>(count) > file_size(file) / row_size) {
    throw FormatError(context + ": damaged: more rows than the file's size allows");
  }
  std::vector<std::byte> stored_bytes(static_cast<std::size_t>(count) * row_size);
  std::vector<MetricsRow> rows(static_cast<std::size_t>(count));
  h5::Handle type = metrics_row_type();
  if (!rows.empty()) {
    h5::check<FormatError>(
        H5Dread(table.get(), stored_type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, stored_bytes.data()),
        "reading the metrics", context);
    h5::check<FormatError>(
        H5Dread(table.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data()),
        "reading the metrics", context);
  }
  if (hash_bytes(hash, stored_bytes.data(), stored_bytes.size()) !=
      h5::read_u64_attribute(table.get(), schema::kMetricsChecksumAttr, name, where)) {
    throw FormatError(context + ": damaged: its " + hash_name(hash) +
                      " checksum does not match the metrics (a damaged disk, or the file was "
                      "edited in place)");
  }
  // A table from before max_tol_ratio (or rms_eager, rms_compiled): its default, 0, would say
  // "every element within tolerance" (or "all zeros"), so it reads as not stored.
  const auto has = [&](const char* member) {
    return H5Tget_member_index(stored_type.get(), member) >= 0;
  };
  const bool has_tol_ratio = has("max_tol_ratio"), has_rms = has("rms_eager");
  std::vector<StoredMetrics> metrics;
  metrics.reserve(rows.size());
  for (MetricsRow& row : rows) {
    if (!has_tol_ratio) row.metrics.max_tol_ratio = kMetricNotStored;
    if (!has_rms) row.metrics.rms_eager = row.metrics.rms_compiled = kMetricNotStored;
    if (row.record >= record_of_index_row.size()) {
      throw FormatError(context + ": damaged: a row names index row " + std::to_string(row.record) +
                        ", but the index has " + std::to_string(record_of_index_row.size()));
    }
    const std::int64_t record = record_of_index_row[row.record];
    if (record < 0) continue;  // of a record this reader skips
    for (const MetricField& field : kMetricFields) {
      std::uint8_t flag = 0;  // a bool must hold 0 or 1: anything else is damage, not true
      if (field.type != MetricType::kBool) continue;
      std::memcpy(&flag, reinterpret_cast<const char*>(&row.metrics) + field.offset, 1);
      if (flag > 1) {
        throw FormatError(context + ": damaged: " + std::string(field.name) + " is " +
                          std::to_string(flag) + ", neither 0 nor 1");
      }
    }
    StoredMetrics stored{{}, row.tolerances, row.metrics};
    stored.key = records[static_cast<std::size_t>(record)].key;
    metrics.push_back(std::move(stored));
  }
  return metrics;
}

}  // namespace dynaprobe::formats

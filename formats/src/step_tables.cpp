// The tables StepWriter writes when it commits a step (step_tables.h).
#include "step_tables.h"

#include <cstring>
#include <map>

#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/schema.h"
#include "hdf5_types.h"

namespace dynaprobe::formats {
namespace {

// Creates the 1-D dataset `name` under the root of `file` of `count` rows and writes them; a
// non-empty `checksum_attr` gets `checksum`. The caller holds the HDF5 lock.
void write_table(hid_t file, const std::string& file_name, std::string_view name, hid_t file_type,
                 hid_t memory_type, const void* rows, std::size_t count,
                 std::string_view checksum_attr, std::uint64_t checksum) {
  const std::string where = file_name + " /" + std::string(name);
  const hsize_t size = count;
  h5::Handle space = h5::space_handle(H5Screate_simple(1, &size, nullptr), "creating", where);
  h5::Handle table =
      h5::dataset_handle(H5Dcreate2(file, std::string(name).c_str(), file_type, space.get(),
                                    H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                         "creating the dataset", where);
  if (count > 0) {
    h5::check(H5Dwrite(table.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows),
              "writing the dataset", where);
  }
  if (!checksum_attr.empty()) h5::write_u64_attribute(table.get(), checksum_attr, checksum, where);
  table.close(where);
}

}  // namespace

void write_index_tables(hid_t file, const std::vector<RecordInfo>& index, std::int64_t step,
                        const Provenance& provenance, const std::string& file_name) {
  std::vector<IndexRow> rows;
  std::vector<std::uint64_t> chunk_hashes;
  rows.reserve(index.size());
  for (const RecordInfo& info : index) {
    rows.push_back(IndexRow{info.key.module.c_str(), info.key.call, kind_name(info.key.kind).data(),
                            info.key.tensor_index, side_name(info.key.side).data(),
                            info.label.c_str(), dtype_name(info.dtype).data(),
                            hvl_t{info.shape.size(), const_cast<std::int64_t*>(info.shape.data())},
                            info.stored_bytes, info.chunk_offset, info.chunk_filter_mask,
                            info.chunk_hash, chunk_hashes.size(), info.chunk_hashes.size()});
    chunk_hashes.insert(chunk_hashes.end(), info.chunk_hashes.begin(), info.chunk_hashes.end());
  }
  const PackedIndex packed = pack_index(rows);
  const std::uint64_t checksum = index_checksum_v2(packed.bytes, chunk_hashes, step, provenance);
  h5::Lock lock(h5::hdf5_mutex());
  write_table(file, file_name, schema::kChunkHashesDataset, H5T_STD_U64LE, H5T_NATIVE_UINT64,
              chunk_hashes.data(), chunk_hashes.size(), "", 0);
  write_table(file, file_name, schema::kIndexDataset, packed.type.get(), packed.type.get(),
              packed.bytes.data(), rows.size(), schema::kIndexChecksumAttr, checksum);
}

void write_metrics_table(hid_t file, const std::vector<RecordInfo>& index,
                         const std::vector<StoredMetrics>& metrics, const std::string& file_name) {
  if (metrics.empty()) return;
  std::map<RecordKey, std::uint64_t> position;
  for (std::size_t i = 0; i < index.size(); ++i) position.emplace(index[i].key, i);
  std::vector<MetricsRow> rows;
  rows.reserve(metrics.size());
  for (const StoredMetrics& stored : metrics) {
    const auto found = position.find(stored.key);
    if (found == position.end()) {
      throw UsageError("metrics of " + to_string(stored.key) +
                       ": no such record in the step; write or describe it first");
    }
    rows.push_back(MetricsRow{found->second, stored.tolerances, stored.metrics});
  }
  const h5::Handle type = metrics_row_type();
  h5::Lock lock(h5::hdf5_mutex());
  // Stored packed (no padding bytes of memory never written), little-endian as the type says;
  // the checksum covers those bytes.
  const std::string& where = file_name;
  h5::Handle packed = h5::type_handle(H5Tcopy(type.get()), "copying", where);
  h5::check(H5Tpack(packed.get()), "packing the /metrics type", where);
  std::vector<std::byte> bytes(rows.size() * sizeof(MetricsRow));
  std::memcpy(bytes.data(), rows.data(), bytes.size());
  if (!rows.empty()) {
    std::vector<std::byte> background(rows.size() * H5Tget_size(packed.get()));  // compounds
    h5::check(H5Tconvert(type.get(), packed.get(), rows.size(), bytes.data(), background.data(),
                         H5P_DEFAULT),
              "packing the metrics", where);
  }
  bytes.resize(rows.size() * H5Tget_size(packed.get()));
  write_table(file, file_name, schema::kMetricsDataset, packed.get(), packed.get(), bytes.data(),
              rows.size(), schema::kMetricsChecksumAttr, xxh3(bytes.data(), bytes.size()));
}

}  // namespace dynaprobe::formats

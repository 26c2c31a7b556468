// The tables StepWriter writes when it commits a step (docs/dump-format.md, "Inside a step
// file"): /index with /chunk_hashes and the index checksum, and /metrics with its checksum.
// Private to formats.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dynaprobe/formats/metrics.h"
#include "dynaprobe/formats/stored_tensor.h"
#include "h5.h"

namespace dynaprobe::formats {

// Writes /chunk_hashes and /index of `index` (the step's records in index order) to `file`, with
// the index checksum over them, `step` and `provenance`. Takes the HDF5 lock; `file_name` names
// the file in errors (IoError).
void write_index_tables(hid_t file, const std::vector<RecordInfo>& index, std::int64_t step,
                        const Provenance& provenance, const std::string& file_name);

// Writes /metrics: a row per entry of `metrics` naming its record's position in `index`, nothing
// when `metrics` is empty. Throws UsageError for metrics of a record not in `index`. Takes the
// HDF5 lock.
void write_metrics_table(hid_t file, const std::vector<RecordInfo>& index,
                         const std::vector<StoredMetrics>& metrics, const std::string& file_name);

}  // namespace dynaprobe::formats

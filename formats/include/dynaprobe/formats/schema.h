// The on-disk names of a dynaprobe dump, defined once. docs/dump-format.md specifies the layout;
// keep both in sync with the readers in other languages that users may write from it.
//
//   <run>/rank<R>/step_<NNNNNNNN>.h5            one file per step and rank (crash safety: a step
//                                               is written as <name>.partial and renamed on commit)
//   /                      attrs: dynaprobe_format_version = "<major>.<minor>", step, provenance
//   /tensors/<module>/<kind>.<side>.<call>.<tensor_index>   one dataset per record, attr dtype
//   /graphs/<name>         one scalar string dataset per graph, attrs kind and the graph's own
//   /modules/<module>      one empty group per module the capture knew of, string attributes
//   /index                 compound table listing every record (no tensor data needs reading),
//                          attr checksum (since 1.2)
//   /chunk_hashes          uint64 per chunk of multi-chunk records (since 1.2)
//   /metrics               compound table of the pairs judged at capture, attr checksum (1.3)
// Format 2.0 keeps this layout with nothing variable-length (fixed-length strings, the shape as
// rank + a fixed array), XXH3-64 checksums over every chunk and table, and checksums of /modules
// and /graphs (attributes of those groups).
#pragma once

#include <cstdint>
#include <string_view>

namespace dynaprobe::formats::schema {

// A reader refuses files whose major version is newer than kFormatMajor, and reads every older
// one.
inline constexpr int kFormatMajor = 2;
// 1.1: /index locates single-chunk records. 1.2: /chunk_hashes checks every chunk stored as it
// is, and the index carries a checksum of itself and of the provenance. 1.3: /metrics holds the
// metrics the capture computed in memory, and an index row with elements and stored_bytes 0 is a
// record whose tensor was not stored (PrecisionChecker(dump="failing" or "stats")). 1.4: records
// of kind "replay" keep what a replay of a failing call needs (never compared).
// 2.0: no variable-length data (nothing in HDF5's global heap), XXH3 checksums over every chunk
// of every record, the index, /metrics, /modules and /graphs; complex dtypes.
inline constexpr int kFormatMinor = 0;
// The last minor version of format 1, which this reader still reads.
inline constexpr int kFormat1LastMinor = 4;

inline constexpr std::string_view kFormatVersionAttr = "dynaprobe_format_version";
inline constexpr std::string_view kStepAttr = "step";
inline constexpr std::string_view kTensorsGroup = "tensors";
inline constexpr std::string_view kGraphsGroup = "graphs";
inline constexpr std::string_view kModulesGroup = "modules";
inline constexpr std::string_view kIndexDataset = "index";
inline constexpr std::string_view kDtypeAttr = "dtype";
inline constexpr std::string_view kGraphKindAttr = "kind";

// Fields of the /index compound table.
inline constexpr std::string_view kIndexModule = "module";
inline constexpr std::string_view kIndexCall = "call";
inline constexpr std::string_view kIndexKind = "kind";
inline constexpr std::string_view kIndexTensorIndex = "tensor_index";
inline constexpr std::string_view kIndexSide = "side";
inline constexpr std::string_view kIndexLabel = "label";
inline constexpr std::string_view kIndexDtype = "dtype";
inline constexpr std::string_view kIndexShape = "shape";
inline constexpr std::string_view kIndexRank = "rank";  // since 2.0: shape is int64[max rank]
inline constexpr std::string_view kIndexStoredBytes = "stored_bytes";
inline constexpr std::string_view kIndexChunkOffset = "chunk_offset";  // since 1.1
inline constexpr std::string_view kIndexChunkFilterMask = "chunk_filter_mask";
inline constexpr std::string_view kIndexChunkHash = "chunk_hash";
inline constexpr std::string_view kIndexChunkHashesFirst = "chunk_hashes_first";  // since 1.2
inline constexpr std::string_view kIndexChunkCount = "chunk_count";               // since 1.2
// Since 1.2: XXH64 of every chunk of a multi-chunk record stored as it is (0 for a compressed
// chunk, which zstd's content checksum covers), rows point into it; and the /index attribute
// holding the XXH64 of the index, the chunk hashes, the step and the provenance.
inline constexpr std::string_view kChunkHashesDataset = "chunk_hashes";
inline constexpr std::string_view kIndexChecksumAttr = "checksum";
// Since 1.3: the metrics of pairs judged at capture, and their checksum (an attribute of it).
inline constexpr std::string_view kMetricsDataset = "metrics";
inline constexpr std::string_view kMetricsChecksumAttr = "checksum";
// Since 2.0: the checksums of /modules and of /graphs, attributes of those groups.
inline constexpr std::string_view kGroupChecksumAttr = "checksum";

// The folder layout: a run folder holds one dump per rank, rank<R>/ (or is itself the dump of
// one process); PrecisionChecker puts one run per process into kRunsDir unless told a dump_dir.
inline constexpr std::string_view kRankDirPrefix = "rank";
inline constexpr std::string_view kRunsDir = "dynaprobe_runs";
inline constexpr std::string_view kStepFilePrefix = "step_";
inline constexpr std::string_view kStepFileSuffix = ".h5";
inline constexpr std::string_view kPartialSuffix = ".partial";
// Ops dumps (dynaprobe bisect --ops) of a dump folder: <dump>/ops/<module>.call<C>.step<S>/, each
// an ordinary one-step dump whose modules are the ops of the call's aten graphs.
inline constexpr std::string_view kOpsDir = "ops";
inline constexpr std::string_view kOpsCallInfix = ".call";
inline constexpr std::string_view kOpsStepInfix = ".step";

// Registered HDF5 filter ids
// (https://github.com/HDFGroup/hdf5_plugins/blob/master/docs/RegisteredFilterPlugins.md).
inline constexpr int kShuffleFilterId = 2;   // H5Z_FILTER_SHUFFLE
inline constexpr int kZstdFilterId = 32015;  // cd_values[0] = level (two's complement if negative)
// The filter mask of a chunk stored as it is: shuffle (filter 0) and zstd (filter 1) skipped.
inline constexpr unsigned kAllFiltersSkipped = 0b11;

}  // namespace dynaprobe::formats::schema

// What reading a step file depends on its dump format generation (docs/dump-format.md), behind one
// interface with one implementation per generation, each whole in a file of its own, the way
// HDF5 keeps a decoder per version of its messages and Arrow an IPC reader per metadata version:
//   format_1_reader.cpp  formats 1.0 to 1.4: variable-length strings, XXH64, hashes from 1.2 on
//   format_2_reader.cpp  format 2.0: nothing variable-length, XXH3-64 of every byte it uses
// StepReader (reader.cpp) reads the version attribute, picks the generation (format_reader()) and
// runs the phases every generation shares through it; a TensorStream (tensor_stream.cpp) asks its
// generation how to check a chunk. What the generations store alike is read here too (the chunk
// hashes' table, /metrics). Private to formats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/metrics.h"
#include "dynaprobe/formats/stored_tensor.h"
#include "h5.h"
#include "hdf5_types.h"
#include "step_index.h"

namespace dynaprobe::formats {

// /index as read: its rows (valid while the table lives; their strings and shapes may be HDF5's
// variable-length data, which it owns) and the file's /chunk_hashes, which rows point into.
class IndexTable {
 public:
  virtual ~IndexTable() = default;
  virtual const std::vector<IndexRow>& rows() const = 0;
  virtual const std::vector<std::uint64_t>& chunk_hashes() const = 0;
};

// One dump format generation's way of reading a step file. Implementations are stateless
// singletons, safe to use from any thread; methods that touch HDF5 are called under its lock.
class FormatReader {
 public:
  virtual ~FormatReader() = default;

  // The hash of the generation's checksums (chunks, /index, /metrics).
  virtual HashAlgorithm hash() const = 0;

  // A scalar string attribute of `object` (FormatError when missing, not a string, or stored as
  // this generation never stores one).
  virtual std::string read_string(hid_t object, std::string_view name,
                                  std::string_view where) const = 0;

  // /index and /chunk_hashes, verified against the index checksum (where the generation has
  // one) together with `step` and `provenance` before anything of them is returned. Throws
  // FormatError for a damaged or missing index.
  virtual std::unique_ptr<const IndexTable> read_index(hid_t file, const FormatVersion& version,
                                                       std::int64_t step,
                                                       const Provenance& provenance,
                                                       const std::string& where) const = 0;

  // Whether the tensor of an index row is in the file: since 1.3 a row with elements but no
  // stored bytes was judged at capture and not stored.
  virtual bool stores_tensor(const RecordInfo& record, const FormatVersion& version) const = 0;

  // /graphs or /modules (`name`) is not in the file: nothing to read, or damage (FormatError).
  virtual void missing_group(const std::string& name, const std::string& where) const = 0;
  // A graph's source: the one string of its dataset, whose type `type` is a string type.
  virtual std::string read_graph_text(hid_t dataset, hid_t type,
                                      const std::string& context) const = 0;
  // /graphs or /modules as read (graphs in any order) against the group's checksum, where the
  // generation has one.
  virtual void verify_group(hid_t group, std::vector<NamedAttributes> entries, bool with_text,
                            const std::string& name, const std::string& where) const = 0;

  // A record's dataset opened for streaming (`stream` has its layout): takes the hashes of its
  // chunks from the index row, or throws FormatError when the dataset cannot be checked as the
  // generation checks every chunk.
  virtual void take_chunk_hashes(TensorStream::State& stream, const RecordInfo& record) const = 0;
  // Checks chunk `chunk` of a stream with a chunk layout, its stored bytes in `raw`, before any of
  // them is used (FormatError naming the chunk when they are damaged).
  virtual void check_chunk(const TensorStream::State& stream, std::size_t chunk,
                           const RawChunk& raw) const = 0;
  // Whether zstd is to verify its frames' content checksum (an XXH64 of the decompressed bytes).
  virtual bool zstd_content_checksum() const = 0;
  // A record /index locates whose bytes there do not match their hash, and whose dataset HDF5
  // keeps elsewhere (a tool rewrote the file, e.g. h5repack, copying /index as it was): returns
  // to read the dataset through HDF5 instead, or throws FormatError.
  virtual void relocated_chunk(const std::string& where) const = 0;
};

// The generation that reads files of `version` (parse_format_version has refused newer majors).
const FormatReader& format_reader(const FormatVersion& version);
const FormatReader& format_1_reader();
const FormatReader& format_2_reader();

// What the generations store alike, read under the HDF5 lock.

std::string hash_name(HashAlgorithm hash);

// "/<name>": the path of a dataset or group under the root group.
inline std::string root_path(std::string_view name) { return std::string("/").append(name); }

// The size of an open file in bytes (bounds what a damaged table may claim to hold).
std::uint64_t file_size(hid_t file);

// The /index dataset; FormatError when the file has none (a step never committed).
h5::Handle open_index(hid_t file, const std::string& where);

// /chunk_hashes of a format >= 1.2 file (fixed-size integers: nothing in HDF5's global heap).
std::vector<std::uint64_t> read_chunk_hashes(hid_t file, const std::string& where);

// A graph's source stored as a fixed-length string (of type `type`), bounded by the file's size.
std::string read_fixed_graph_text(hid_t dataset, hid_t type, const std::string& context);

// The error for chunk `chunk` of the dataset `where` whose stored bytes are damaged (`what`).
FormatError corrupt_chunk(const std::string& where, std::size_t chunk, const std::string& what);

// The metrics judged at capture (format 1.3), verified against their checksum (`hash`); each names
// an index row, whose key it takes from `records` (`record_of_index_row`: -1 for a skipped row).
std::vector<StoredMetrics> read_stored_metrics(hid_t file, const std::vector<RecordInfo>& records,
                                               const std::vector<std::int64_t>& record_of_index_row,
                                               HashAlgorithm hash, const std::string& where);

}  // namespace dynaprobe::formats

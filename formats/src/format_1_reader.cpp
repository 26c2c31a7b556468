// Dump formats 1.0 to 1.4 (docs/dump-format.md, Versioning): strings variable-length (HDF5's
// global heap); /index a table of variable-length rows, with chunk locations since 1.1 and
// chunk hashes and an XXH64 checksum since 1.2; only chunks stored as they are hashed (zstd's
// content checksum covers compressed ones); /graphs and /modules without checksums. The writer
// of format 1 is gone: tests/data/format_1.2 and format_1.4 hold files it wrote.
#include <algorithm>
#include <memory>
#include <optional>

#include "dynaprobe/formats/schema.h"
#include "format_reader.h"
#include "tensor_stream.h"

namespace dynaprobe::formats {
namespace {

// /index read whole, with /chunk_hashes from 1.2 on. The rows' strings and shapes are HDF5's
// variable-length data, reclaimed when the table goes away.
class Format1Index : public IndexTable {
 public:
  Format1Index(hid_t file, const FormatVersion& version, const std::string& where);

  // Throws FormatError unless the index checksum (format >= 1.2) covers these rows, the chunk
  // hashes, `step` and `provenance`. Call before trusting any offset, hash or name of a row.
  void verify(std::int64_t step, const Provenance& provenance, const std::string& where) const;

  const std::vector<IndexRow>& rows() const override { return rows_.rows; }
  const std::vector<std::uint64_t>& chunk_hashes() const override { return chunk_hashes_; }

 private:
  // Rows read from HDF5, whose variable-length data HDF5 allocated: reclaimed when they go away,
  // also when the constructor throws after reading them. Declared after the handles it uses.
  struct Rows {
    hid_t type = -1, space = -1;
    std::vector<IndexRow> rows;
    Rows() = default;
    Rows(const Rows&) = delete;
    Rows& operator=(const Rows&) = delete;
    ~Rows() {
      if (!rows.empty()) H5Dvlen_reclaim(type, space, H5P_DEFAULT, rows.data());
    }
  };

  h5::Handle table_, type_, space_;
  bool hashed_ = false;
  Rows rows_;
  std::vector<std::uint64_t> chunk_hashes_;
};

Format1Index::Format1Index(hid_t file, const FormatVersion& version, const std::string& where)
    : table_(open_index(file, where)) {
  const auto has_field = [&](std::string_view field) {
    h5::Handle stored = h5::type_handle(H5Dget_type(table_.get()), "reading the index", where);
    return H5Tget_member_index(stored.get(), std::string(field).c_str()) >= 0;
  };
  const bool located = has_field(schema::kIndexChunkOffset);  // format 1.1: chunk locations
  hashed_ = has_field(schema::kIndexChunkCount);  // format 1.2: chunk hashes, index checksum
  if (version.major == 1 && version.minor >= 2 && !hashed_) {
    throw FormatError(where + ": damaged /index: format " + version.text +
                      " files have chunk hashes, but this index has none");
  }
  type_ = index_row_type(located, hashed_);
  space_ = h5::space_handle(H5Dget_space(table_.get()), "reading the index", where);
  const hssize_t count = H5Sget_simple_extent_npoints(space_.get());
  std::vector<IndexRow> rows(static_cast<std::size_t>(std::max<hssize_t>(count, 0)), IndexRow{});
  if (!rows.empty()) {
    h5::check<FormatError>(
        H5Dread(table_.get(), type_.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data()),
        "reading the index", where);
  }
  rows_.type = type_.get();
  rows_.space = space_.get();
  rows_.rows = std::move(rows);
  if (hashed_) chunk_hashes_ = read_chunk_hashes(file, where);
}

void Format1Index::verify(std::int64_t step, const Provenance& provenance,
                          const std::string& where) const {
  if (!hashed_) return;
  const std::uint64_t stored = h5::read_u64_attribute(table_.get(), schema::kIndexChecksumAttr,
                                                      root_path(schema::kIndexDataset), where);
  if (index_checksum(rows_.rows, chunk_hashes_, step, provenance) != stored) {
    throw FormatError(where +
                      ": damaged /index: its XXH64 checksum does not match the index, the chunk "
                      "hashes, the step or the provenance (a damaged disk, or the file was edited "
                      "in place)");
  }
}

class Format1Reader : public FormatReader {
 public:
  HashAlgorithm hash() const override { return HashAlgorithm::kXxh64; }

  std::string read_string(hid_t object, std::string_view name,
                          std::string_view where) const override {
    return h5::read_string_attribute(object, name, where, /*allow_variable=*/true);
  }

  std::unique_ptr<const IndexTable> read_index(hid_t file, const FormatVersion& version,
                                               std::int64_t step, const Provenance& provenance,
                                               const std::string& where) const override {
    auto index = std::make_unique<const Format1Index>(file, version, where);
    index->verify(step, provenance, where);
    return index;
  }

  // Writers before 1.3 stored every record.
  bool stores_tensor(const RecordInfo& record, const FormatVersion& version) const override {
    return !(version.minor >= 3 && record.numel() > 0 && record.stored_bytes == 0);
  }

  // Files from before /graphs and /modules have neither: nothing to read.
  void missing_group(const std::string&, const std::string&) const override {}

  // Written variable-length; a fixed-length one (as format 2.0 stores it) is read too.
  std::string read_graph_text(hid_t dataset, hid_t type,
                              const std::string& context) const override {
    if (H5Tis_variable_str(type) <= 0) return read_fixed_graph_text(dataset, type, context);
    char* text = nullptr;
    h5::check<FormatError>(
        H5Dread(dataset, h5::string_type(context), H5S_ALL, H5S_ALL, H5P_DEFAULT, &text),
        "reading graph text", context);
    std::string value = text ? text : "";
    H5free_memory(text);
    return value;
  }

  // No checksums of /graphs and /modules in format 1.
  void verify_group(hid_t, std::vector<NamedAttributes>, bool, const std::string&,
                    const std::string&) const override {}

  // A file rewritten by a tool (h5repack) may have other chunks than the index hashes: then there
  // is nothing to check them against, as for files older than 1.2.
  void take_chunk_hashes(TensorStream::State& stream, const RecordInfo& record) const override {
    if (stream.layout && stream.layout->chunk_count() == record.chunk_hashes.size()) {
      stream.chunk_hashes = record.chunk_hashes;
    }
  }

  // A chunk stored as it is has no zstd checksum: /chunk_hashes (1.2 on) has its XXH64. One
  // stored compressed must still be (else its frame would be read as values).
  void check_chunk(const TensorStream::State& stream, std::size_t chunk,
                   const RawChunk& raw) const override {
    if (stream.chunk_hashes.empty() || stream.zstd_bit < 0) return;
    const bool stored_as_is = !stream.applied(stream.zstd_bit, raw.filter_mask) &&
                              !stream.applied(stream.shuffle_bit, raw.filter_mask);
    if (!stored_as_is) return;
    const std::uint64_t expected = stream.chunk_hashes[chunk];
    if (expected == 0) {
      throw corrupt_chunk(
          stream.where, chunk,
          "it was written compressed, but its filter mask says it is stored as it is");
    }
    if (xxh64(raw.bytes.data(), raw.bytes.size()) != expected) {
      throw corrupt_chunk(stream.where, chunk,
                          "its stored bytes do not match their XXH64 in /chunk_hashes (a damaged "
                          "disk, or the file was edited in place)");
    }
  }

  // Compressed chunks carry no hash of their own in /chunk_hashes: zstd's checksum is the check.
  bool zstd_content_checksum() const override { return true; }

  // The dataset is read through HDF5, wherever the tool put its chunks.
  void relocated_chunk(const std::string&) const override {}
};

}  // namespace

const FormatReader& format_1_reader() {
  static const Format1Reader reader;
  return reader;
}

}  // namespace dynaprobe::formats

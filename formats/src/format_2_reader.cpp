// Dump format 2.0 (docs/dump-format.md, "Format 2.0: every byte the reader uses is checksummed"):
// nothing variable-length (a variable-length type is refused before it is read: HDF5 1.10
// crashes on a damaged global heap); /index fixed-size rows; XXH3-64 of every chunk of every
// record, of /index with /chunk_hashes, the step and the provenance, of /metrics, /modules and
// /graphs, each verified before what it covers is used.
#include <memory>
#include <optional>

#include "dynaprobe/formats/schema.h"
#include "format_reader.h"
#include "tensor_stream.h"

namespace dynaprobe::formats {
namespace {

// /index read as stored (its checksum covers those bytes) and unpacked into rows, with
// /chunk_hashes.
class Format2Index : public IndexTable {
 public:
  Format2Index(hid_t file, const std::string& where);

  // Throws FormatError unless the index checksum covers the index's bytes, the chunk hashes,
  // `step` and `provenance`. Call before trusting any offset, hash or name of a row.
  void verify(std::int64_t step, const Provenance& provenance, const std::string& where) const;

  const std::vector<IndexRow>& rows() const override { return unpacked_->rows(); }
  const std::vector<std::uint64_t>& chunk_hashes() const override { return chunk_hashes_; }

 private:
  h5::Handle table_;
  std::vector<std::byte> bytes_;
  std::optional<UnpackedIndex> unpacked_;
  std::vector<std::uint64_t> chunk_hashes_;
};

Format2Index::Format2Index(hid_t file, const std::string& where) : table_(open_index(file, where)) {
  // Fixed-size rows only (nothing variable-length: refused before any read), read as stored.
  h5::Handle stored = h5::type_handle(H5Dget_type(table_.get()), "reading the index", where);
  refuse_variable_length(stored.get(), where + " /index");
  h5::Handle space = h5::space_handle(H5Dget_space(table_.get()), "reading the index", where);
  const hssize_t count = H5Sget_simple_extent_npoints(space.get());
  const std::size_t row_size = H5Tget_size(stored.get());
  if (count < 0 || H5Sget_simple_extent_ndims(space.get()) != 1 || row_size == 0 ||
      static_cast<std::uint64_t>(count) > file_size(file) / row_size) {
    throw FormatError(where + ": damaged /index: expected a 1-D table no larger than the file");
  }
  bytes_.resize(static_cast<std::size_t>(count) * row_size);
  if (!bytes_.empty()) {
    h5::check<FormatError>(
        H5Dread(table_.get(), stored.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes_.data()),
        "reading the index", where);
  }
  unpacked_.emplace(stored.get(), bytes_, where);
  chunk_hashes_ = read_chunk_hashes(file, where);
}

void Format2Index::verify(std::int64_t step, const Provenance& provenance,
                          const std::string& where) const {
  const std::uint64_t stored = h5::read_u64_attribute(table_.get(), schema::kIndexChecksumAttr,
                                                      root_path(schema::kIndexDataset), where);
  if (index_checksum_v2(bytes_, chunk_hashes_, step, provenance) != stored) {
    throw FormatError(where +
                      ": damaged /index: its XXH3 checksum does not match the index, the chunk "
                      "hashes, the step or the provenance (a damaged disk, or the file was edited "
                      "in place)");
  }
}

class Format2Reader : public FormatReader {
 public:
  HashAlgorithm hash() const override { return HashAlgorithm::kXxh3; }

  std::string read_string(hid_t object, std::string_view name,
                          std::string_view where) const override {
    return h5::read_string_attribute(object, name, where, /*allow_variable=*/false);
  }

  std::unique_ptr<const IndexTable> read_index(hid_t file, const FormatVersion&, std::int64_t step,
                                               const Provenance& provenance,
                                               const std::string& where) const override {
    auto index = std::make_unique<const Format2Index>(file, where);
    index->verify(step, provenance, where);
    return index;
  }

  bool stores_tensor(const RecordInfo& record, const FormatVersion&) const override {
    return !(record.numel() > 0 && record.stored_bytes == 0);
  }

  void missing_group(const std::string& name, const std::string& where) const override {
    throw FormatError(where + ": damaged: no " + name + " group");
  }

  std::string read_graph_text(hid_t dataset, hid_t type,
                              const std::string& context) const override {
    if (H5Tis_variable_str(type) > 0) {
      throw FormatError(context +
                        ": damaged: a variable-length string, which format 2.0 never has");
    }
    return read_fixed_graph_text(dataset, type, context);
  }

  // The checksum attribute of /modules or /graphs against what the reader read.
  void verify_group(hid_t group, std::vector<NamedAttributes> entries, bool with_text,
                    const std::string& name, const std::string& where) const override {
    if (group_checksum(entries, with_text) !=
        h5::read_u64_attribute(group, schema::kGroupChecksumAttr, name, where)) {
      throw FormatError(where + ": damaged " + name +
                        ": its XXH3 checksum does not match what it holds (a damaged disk, or "
                        "the file was edited in place)");
    }
  }

  // Every chunk is checked against its XXH3: a dataset that is not dynaprobe's chunk layout, or
  // has other chunks than the index says, is damage.
  void take_chunk_hashes(TensorStream::State& stream, const RecordInfo& record) const override {
    if (stream.numel == 0 || stream.shape.empty()) return;  // no chunks
    if (!stream.layout || stream.layout->chunk_count() != record.chunk_hashes.size()) {
      throw FormatError(stream.where + ": damaged: its chunks are not the " +
                        std::to_string(record.chunk_hashes.size()) + " the index hashes");
    }
    stream.chunk_hashes = record.chunk_hashes;
  }

  void check_chunk(const TensorStream::State& stream, std::size_t chunk,
                   const RawChunk& raw) const override {
    if (chunk >= stream.chunk_hashes.size() ||
        xxh3(raw.bytes.data(), raw.bytes.size()) != stream.chunk_hashes[chunk]) {
      throw corrupt_chunk(stream.where, chunk,
                          "its stored bytes do not match their XXH3 in /chunk_hashes (a damaged "
                          "disk, or the file was edited in place)");
    }
  }

  // The stored bytes were checked against their XXH3 before they reach zstd, so they are the
  // bytes the writer compressed: hashing the decompressed megabyte again cost 4-6% of reading
  // compressed data.
  bool zstd_content_checksum() const override { return false; }

  // Only the bytes dynaprobe wrote, checked, are read.
  void relocated_chunk(const std::string& where) const override {
    throw FormatError(where +
                      ": the file was rewritten by another tool (its chunk is not where the "
                      "index puts it, e.g. by h5repack) or is damaged: format 2.0 files are read "
                      "as dynaprobe wrote them, every chunk checked against its XXH3; read the "
                      "original file");
  }
};

}  // namespace

const FormatReader& format_2_reader() {
  static const Format2Reader reader;
  return reader;
}

}  // namespace dynaprobe::formats

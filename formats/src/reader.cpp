#include "dynaprobe/formats/reader.h"

#include <tbb/concurrent_queue.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>
#include <unistd.h>
// For the name of ZSTD_d_forceIgnoreChecksum (an experimental parameter of the stable
// ZSTD_DCtx_setParameter); no experimental function is called.
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "chunk_layout.h"
#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/schema.h"
#include "h5.h"
#include "hdf5_types.h"
#include "step_index.h"

namespace dynaprobe::formats {
namespace fs = std::filesystem;
namespace {

using Decompressor = std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)>;

// This thread's zstd decompression context. `content_checksum`: verify the frame's content
// checksum (an XXH64 of the decompressed bytes). A format 2.0 chunk does not need it: its stored
// bytes were checked against their XXH3 before they reach zstd, so they are the bytes the writer
// compressed, and hashing the decompressed megabyte again cost 4-6% of reading compressed data.
ZSTD_DCtx* thread_decompressor(bool content_checksum) {
  thread_local Decompressor verifying(ZSTD_createDCtx(), ZSTD_freeDCtx);
  thread_local Decompressor trusting = [] {
    Decompressor context(ZSTD_createDCtx(), ZSTD_freeDCtx);
    // On a zstd without the parameter the checksum is verified, which is only slower.
    ZSTD_DCtx_setParameter(context.get(), ZSTD_d_forceIgnoreChecksum, ZSTD_d_ignoreChecksum);
    return context;
  }();
  return content_checksum ? verifying.get() : trusting.get();
}

std::atomic<OpenObserver> open_observer{nullptr};

std::string hash_name(HashAlgorithm hash) {
  return hash == HashAlgorithm::kXxh3 ? "XXH3" : "XXH64";
}

// The size of an open file in bytes (bounds what a damaged table may claim to hold).
std::uint64_t file_size(hid_t file) {
  hsize_t size = 0;
  return H5Fget_filesize(file, &size) < 0 ? 0 : size;
}

// /chunk_hashes of a format >= 1.2 file (fixed-size integers: nothing in HDF5's global heap).
std::vector<std::uint64_t> read_chunk_hashes(hid_t file, const std::string& where) {
  const std::string name = "/" + std::string(schema::kChunkHashesDataset);
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

// The metrics judged at capture (format 1.3), verified against their checksum; each names an
// index row, whose key it takes.
std::vector<StoredMetrics> read_stored_metrics(hid_t file, const std::vector<RecordInfo>& records,
                                               const std::vector<std::int64_t>& record_of_index_row,
                                               HashAlgorithm hash, const std::string& where) {
  const std::string name = "/" + std::string(schema::kMetricsDataset);
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
  // A table from before max_tol_ratio: its default, 0, would say "every element within
  // tolerance", so it reads as not stored.
  const bool has_tol_ratio = H5Tget_member_index(stored_type.get(), "max_tol_ratio") >= 0;
  std::vector<StoredMetrics> metrics;
  metrics.reserve(rows.size());
  for (MetricsRow& row : rows) {
    if (!has_tol_ratio) row.metrics.max_tol_ratio = kTolRatioNotStored;
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

// Opens an HDF5 file read-only, telling "cannot read" (IoError) from "not a valid HDF5 file"
// (FormatError).
std::shared_ptr<h5::Handle> open_file(const fs::path& path) {
  if (const OpenObserver observer = open_observer.load()) observer(path);
  h5::init();
  const std::string where = path.string();
  std::error_code error;
  if (!fs::is_regular_file(path, error)) {
    throw IoError(where + ": no such file (expected a dynaprobe step file step_<N>.h5)");
  }
  if (::access(path.c_str(), R_OK) != 0) {
    throw IoError(where + ": permission denied; make the file readable");
  }
  h5::Lock lock(h5::hdf5_mutex());
  if (H5Fis_hdf5(where.c_str()) <= 0) {
    throw FormatError(where +
                      ": not an HDF5 file (no HDF5 signature): expected a dynaprobe "
                      "step file; was it truncated at the start or overwritten?");
  }
  const hid_t file = H5Fopen(where.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0 && where.ends_with(schema::kPartialSuffix)) {
    // HDF5's own reason ("file is already open for write (may use <h5clear file> ...)") would
    // send the user to h5clear, but the step was never committed: its index was not written.
    throw FormatError(where +
                      ": an unfinished step (its writer is still running, or stopped "
                      "before commit, e.g. killed mid-step): its records are lost; read "
                      "the committed step_<N>.h5 files of the dump instead (HDF5: " +
                      h5::error_stack() + ")");
  }
  return std::make_shared<h5::Handle>(
      h5::check<FormatError>(file, "cannot open as HDF5 (truncated or corrupt file?)", where),
      H5Fclose);
}

bool link_exists(hid_t location, const std::string& path) {
  // H5Lexists needs every intermediate link to exist, so walk the path one name at a time.
  std::size_t position = 0;
  while (true) {
    position = path.find('/', position + 1);
    const std::string prefix = path.substr(0, position);
    if (!prefix.empty() && prefix != "/" && H5Lexists(location, prefix.c_str(), H5P_DEFAULT) <= 0) {
      return false;
    }
    if (position == std::string::npos) return true;
  }
}

}  // namespace

ReadBatch::ReadBatch() : lock_(std::make_unique<h5::Lock>(h5::hdf5_mutex())) {}
ReadBatch::~ReadBatch() = default;

std::uint64_t RecordInfo::numel() const { return shape_numel(shape); }

struct TensorStream::State {
  std::shared_ptr<h5::Handle> file;  // keeps the file open while the stream lives
  h5::Handle dataset;
  std::string where;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 0;
  // dynaprobe's chunk layout with at most shuffle then zstd: read with H5Dread_chunk.
  std::optional<ChunkLayout> layout;
  int shuffle_bit = -1;  // position of each filter in the pipeline (its filter-mask bit)
  int zstd_bit = -1;
  // A record whose only chunk /index locates: fetch() preads it, no HDF5 call, no lock.
  struct Located {
    int fd = -1;
    std::string file_name, dataset;
    std::uint64_t offset = 0, size = 0, hash = 0;
    std::uint32_t filter_mask = 0;
  };
  std::optional<Located> located;
  // Format >= 1.2, per chunk: XXH64 of a chunk stored as it is, 0 for a compressed one; format
  // 2.0: XXH3-64 of every chunk (`every_chunk`).
  std::vector<std::uint64_t> chunk_hashes;
  HashAlgorithm hash = HashAlgorithm::kXxh64;
  bool every_chunk = false;  // format 2.0: no unverified bytes, no stale offsets
};

namespace {

std::shared_ptr<TensorStream::State> open_state(std::shared_ptr<h5::Handle> file,
                                                const std::string& dataset_name,
                                                const std::string& file_name,
                                                std::optional<DType> expected_dtype,
                                                bool format2 = false);

// Reads the dataset whole through HDF5's own filter pipeline.
void read_whole(const TensorStream::State& s, RawChunk& raw) {
  h5::Lock lock(h5::hdf5_mutex());
  h5::Handle type = stored_type(s.dtype);
  raw.bytes.resize(s.numel * dtype_size(s.dtype));
  raw.filter_mask = schema::kAllFiltersSkipped;
  h5::check<FormatError>(
      H5Dread(s.dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.bytes.data()),
      "reading dataset", s.where);
}

// Fetches a located record: one pread, checked by its hash. Bytes that do not match are either
// damaged (HDF5 still places the chunk there: an error, even for chunks stored uncompressed,
// which carry no zstd checksum) or stale (a tool rewrote the file, e.g. h5repack, which copies
// /index as it is): then the dataset is read through HDF5.
void fetch_located(const TensorStream::State& s, RawChunk& raw) {
  const auto& at = *s.located;
  raw.bytes.resize(at.size);
  raw.filter_mask = at.filter_mask;
  if (h5::read_at(at.fd, raw.bytes.data(), at.size, at.offset) &&
      hash_bytes(s.hash, raw.bytes.data(), raw.bytes.size()) == at.hash) {
    return;
  }
  const auto dataset = open_state(s.file, at.dataset, at.file_name, s.dtype, s.every_chunk);
  if (dataset->shape != s.shape) {
    throw FormatError(s.where + ": the index says shape " + shape_string(s.shape) +
                      ", but the dataset has shape " + shape_string(dataset->shape));
  }
  // HDF5 still places the chunk there: the bytes are damaged.
  const auto chunk = [&]() -> std::optional<h5::ChunkLocation> {
    if (!dataset->layout || dataset->layout->chunk_count() != 1) return std::nullopt;
    h5::Lock lock(h5::hdf5_mutex());
    return h5::first_chunk_location(dataset->dataset.get(), dataset->shape.size());
  }();
  if (chunk && chunk->offset == at.offset && chunk->size == at.size) {
    throw FormatError(s.where + ": chunk 0 is corrupt: its stored bytes do not match their " +
                      hash_name(s.hash) +
                      " in /index (a damaged disk, or the file was edited in place)");
  }
  if (s.every_chunk) {  // format 2.0: only the bytes dynaprobe wrote, checked, are read
    throw FormatError(s.where +
                      ": the file was rewritten by another tool (its chunk is not where the index "
                      "puts it, e.g. by h5repack) or is damaged: format 2.0 files are read as "
                      "dynaprobe wrote them, every chunk checked against its XXH3; read the "
                      "original file");
  }
  read_whole(*dataset, raw);
}

}  // namespace

DType TensorStream::dtype() const { return state_->dtype; }
const std::vector<std::int64_t>& TensorStream::shape() const { return state_->shape; }

std::size_t TensorStream::chunk_count() const {
  if (state_->layout) return state_->layout->chunk_count();
  return state_->numel > 0 ? 1 : 0;
}

ChunkExtent TensorStream::extent(std::size_t chunk) const {
  if (state_->layout) return state_->layout->extent(chunk);
  return {0, state_->numel};
}

void TensorStream::fetch(std::size_t chunk, RawChunk& raw) const {
  const State& s = *state_;
  if (s.located) return fetch_located(s, raw);
  if (!s.layout) return read_whole(s, raw);
  h5::Lock lock(h5::hdf5_mutex());
  const auto offset = s.layout->offset(chunk);
  hsize_t size = 0;
  if (H5Dget_chunk_storage_size(s.dataset.get(), offset.data(), &size) < 0 || size == 0) {
    throw FormatError(s.where + ": chunk " + std::to_string(chunk) +
                      " is missing (the file is truncated or was not written completely)");
  }
  raw.bytes.resize(size);
  h5::check<FormatError>(H5Dread_chunk(s.dataset.get(), H5P_DEFAULT, offset.data(),
                                       &raw.filter_mask, raw.bytes.data()),
                         "reading chunk " + std::to_string(chunk), s.where);
}

const std::byte* TensorStream::decode(std::size_t chunk, RawChunk& raw, std::vector<std::byte>& out,
                                      std::vector<std::byte>& scratch) const {
  const State& s = *state_;
  if (!s.layout) return raw.bytes.data();
  const std::size_t element_size = dtype_size(s.dtype);
  const std::size_t chunk_bytes = s.layout->chunk_elements() * element_size;
  const auto applied = [&](int bit) { return bit >= 0 && !(raw.filter_mask & (1u << bit)); };
  const bool unshuffle = applied(s.shuffle_bit) && element_size > 1;
  const std::byte* data = raw.bytes.data();
  std::size_t size = raw.bytes.size();
  const auto corrupt = [&](const std::string& what) {
    return FormatError(s.where + ": chunk " + std::to_string(chunk) + " is corrupt: " + what);
  };
  // Checked before any byte is used. A chunk stored as it is has no zstd checksum: /chunk_hashes
  // has its XXH64. One stored compressed must still be (else its frame would be read as values).
  if (s.every_chunk && !s.located) {  // (a located chunk was checked when fetched)
    if (chunk >= s.chunk_hashes.size() || xxh3(data, size) != s.chunk_hashes[chunk]) {
      throw corrupt(
          "its stored bytes do not match their XXH3 in /chunk_hashes (a damaged disk, or the "
          "file was edited in place)");
    }
  } else if (!s.chunk_hashes.empty() && s.zstd_bit >= 0) {
    const bool stored_as_is = !applied(s.zstd_bit) && !applied(s.shuffle_bit);
    const std::uint64_t expected = s.chunk_hashes[chunk];
    if (stored_as_is && expected == 0) {
      throw corrupt("it was written compressed, but its filter mask says it is stored as it is");
    }
    if (stored_as_is && xxh64(data, size) != expected) {
      throw corrupt(
          "its stored bytes do not match their XXH64 in /chunk_hashes (a damaged disk, "
          "or the file was edited in place)");
    }
  }
  if (applied(s.zstd_bit)) {
    std::vector<std::byte>& target = unshuffle ? scratch : out;
    target.resize(chunk_bytes);
    const unsigned long long content = ZSTD_getFrameContentSize(data, size);
    if (content != chunk_bytes) {
      throw corrupt("expected a zstd frame of " + std::to_string(chunk_bytes) +
                    " bytes, but the frame header says " +
                    (ZSTD_isError(content) || content == ZSTD_CONTENTSIZE_ERROR
                         ? std::string("it is not a zstd frame")
                         : std::to_string(content)));
    }
    const std::size_t got = ZSTD_decompressDCtx(thread_decompressor(!s.every_chunk), target.data(),
                                                chunk_bytes, data, size);
    if (ZSTD_isError(got) || got != chunk_bytes) {
      throw corrupt(std::string("zstd: ") +
                    (ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short frame"));
    }
    data = target.data();
    size = chunk_bytes;
  }
  if (size != chunk_bytes) {
    throw corrupt("expected " + std::to_string(chunk_bytes) + " bytes, but received " +
                  std::to_string(size));
  }
  if (unshuffle) {
    out.resize(chunk_bytes);
    unshuffle_bytes(data, out.data(), chunk_bytes, element_size);
    data = out.data();
  }
  return data;
}

namespace {

// The buffers one chunk is decoded in.
struct Slot {
  RawChunk raw;
  std::vector<std::byte> out;
  std::vector<std::byte> scratch;

  std::size_t capacity() const {
    return raw.bytes.capacity() + out.capacity() + scratch.capacity();
  }
};

// Slots kept from one stream_chunks call to the next. Fresh 1 MiB buffers per call are mapped,
// page-faulted and handed back to the OS by glibc every time: about 2,000 page faults per
// 256 MiB tensor, 5% of its read time, and more for the analyzer's many medium-sized tensors.
// Holds at most a few slots per core, and none larger than a few chunks (a dataset of another
// tool is read whole, and its buffer must not stay behind).
class SlotPool {
 public:
  std::unique_ptr<Slot> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) return std::make_unique<Slot>();
    std::unique_ptr<Slot> slot = std::move(free_.back());
    free_.pop_back();
    return slot;
  }
  void give_back(std::unique_ptr<Slot> slot) {
    constexpr std::size_t kMaxSlotBytes = 16 << 20;
    if (slot->capacity() > kMaxSlotBytes) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < max_slots_) free_.push_back(std::move(slot));
  }

 private:
  // Read once: hardware_concurrency() reads a file in /sys on every call.
  const std::size_t max_slots_ = 4 * std::max<std::size_t>(1, std::thread::hardware_concurrency());
  std::mutex mutex_;
  std::vector<std::unique_ptr<Slot>> free_;
};

SlotPool& slot_pool() {
  static SlotPool pool;
  return pool;
}

// The slots of one stream_chunks call, returned to the pool however the call ends.
struct SlotLease {
  std::vector<std::unique_ptr<Slot>> slots;
  explicit SlotLease(std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) slots.push_back(slot_pool().take());
  }
  ~SlotLease() {
    for (auto& slot : slots) slot_pool().give_back(std::move(slot));
  }
};

}  // namespace

void stream_chunks(const TensorStream& stream, const ChunkConsumer& consumer, ChunkOrder order) {
  const std::size_t count = stream.chunk_count();
  if (count == 1) {  // nothing to overlap
    SlotLease lease(1);
    Slot& slot = *lease.slots[0];
    stream.fetch(0, slot.raw);
    consumer(stream.extent(0), stream.decode(0, slot.raw, slot.out, slot.scratch));
    return;
  }
  const std::size_t tokens = std::min<std::size_t>(
      count, 2 * static_cast<std::size_t>(tbb::this_task_arena::max_concurrency()));
  SlotLease lease(tokens);
  tbb::concurrent_bounded_queue<Slot*> free_slots;
  for (auto& slot : lease.slots) free_slots.push(slot.get());
  struct Item {
    std::size_t chunk = 0;
    Slot* slot = nullptr;
    const std::byte* data = nullptr;
  };
  std::size_t next = 0;
  tbb::parallel_pipeline(
      tokens, tbb::make_filter<void, Item>(tbb::filter_mode::serial_in_order,
                                           [&](tbb::flow_control& control) -> Item {
                                             if (next == count) {
                                               control.stop();
                                               return {};
                                             }
                                             Item item{next++};
                                             free_slots.pop(item.slot);
                                             stream.fetch(item.chunk, item.slot->raw);
                                             return item;
                                           }) &
                  tbb::make_filter<Item, Item>(tbb::filter_mode::parallel,
                                               [&](Item item) {
                                                 item.data = stream.decode(
                                                     item.chunk, item.slot->raw, item.slot->out,
                                                     item.slot->scratch);
                                                 if (order == ChunkOrder::kAnyOrder) {
                                                   consumer(stream.extent(item.chunk), item.data);
                                                 }
                                                 return item;
                                               }) &
                  tbb::make_filter<Item, void>(tbb::filter_mode::serial_in_order, [&](Item item) {
                    if (order == ChunkOrder::kInOrder)
                      consumer(stream.extent(item.chunk), item.data);
                    free_slots.push(item.slot);
                  }));
}

namespace {

std::shared_ptr<TensorStream::State> open_state(std::shared_ptr<h5::Handle> file,
                                                const std::string& dataset_name,
                                                const std::string& file_name,
                                                std::optional<DType> expected_dtype, bool format2) {
  auto state = std::make_shared<TensorStream::State>();
  state->file = std::move(file);
  state->where = file_name + " " + dataset_name;
  const std::string& where = state->where;
  h5::Lock lock(h5::hdf5_mutex());
  // Open first: walking the path link by link only pays off to explain a failure.
  // dynaprobe reads chunks directly, so datasets are opened without HDF5's chunk cache, whose
  // hash table opening a dataset would otherwise allocate and clear every time.
  static const h5::Handle no_chunk_cache = [&] {
    h5::Handle dapl = h5::plist_handle(H5Pcreate(H5P_DATASET_ACCESS), "creating dapl", where);
    h5::check(H5Pset_chunk_cache(dapl.get(), 1, 0, 1.0), "configuring the chunk cache", where);
    return dapl;
  }();
  const hid_t opened = H5Dopen2(state->file->get(), dataset_name.c_str(), no_chunk_cache.get());
  if (opened < 0 && !link_exists(state->file->get(), dataset_name)) {
    throw FormatError(where + ": dataset is missing from the file");
  }
  state->dataset = h5::dataset_handle(opened, "opening dataset", where);
  const hid_t dataset = state->dataset.get();
  h5::Handle type = h5::type_handle(H5Dget_type(dataset), "reading type", where);
  const DType stored = dtype_of_hdf5_type(type.get(), where);
  DType dtype = stored;
  if (h5::has_attribute(dataset, schema::kDtypeAttr)) {
    const std::string name =
        h5::read_string_attribute(dataset, schema::kDtypeAttr, where, !format2);
    const auto parsed = parse_dtype(name);
    if (!parsed) {
      throw FormatError(where + ": unknown dtype attribute '" + name +
                        "'; expected a torch dtype name such as 'float32' or 'bfloat16'");
    }
    const DType expected_storage = is_float8(*parsed) ? DType::kUInt8 : *parsed;
    if (expected_storage != stored) {
      throw FormatError(where + ": dtype attribute says '" + name + "', but the dataset stores " +
                        std::string(dtype_name(stored)) + " values");
    }
    dtype = *parsed;
  }
  if (expected_dtype && *expected_dtype != dtype) {
    throw FormatError(where + ": the index says dtype " + std::string(dtype_name(*expected_dtype)) +
                      ", but the dataset holds " + std::string(dtype_name(dtype)));
  }
  state->dtype = dtype;
  h5::Handle space = h5::space_handle(H5Dget_space(dataset), "reading dataspace", where);
  const int rank =
      h5::check<FormatError>(H5Sget_simple_extent_ndims(space.get()), "reading dataspace", where);
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  state->shape.assign(dims.begin(), dims.end());
  state->numel = shape_numel(state->shape);

  h5::Handle dcpl = h5::plist_handle(H5Dget_create_plist(dataset), "reading layout", where);
  if (H5Pget_layout(dcpl.get()) == H5D_CHUNKED && state->numel > 0) {
    std::vector<hsize_t> chunk(static_cast<std::size_t>(rank));
    H5Pget_chunk(dcpl.get(), rank, chunk.data());
    bool known_filters = true;
    const int filters = H5Pget_nfilters(dcpl.get());
    for (int i = 0; i < filters; ++i) {
      unsigned flags = 0;
      std::size_t n = 0;
      const H5Z_filter_t id = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &n,
                                             nullptr, 0, nullptr, nullptr);
      if (id == schema::kShuffleFilterId && state->zstd_bit < 0 && state->shuffle_bit < 0) {
        state->shuffle_bit = i;
      } else if (id == schema::kZstdFilterId && state->zstd_bit < 0) {
        state->zstd_bit = i;
      } else {
        known_filters = false;
      }
    }
    if (known_filters) state->layout = ChunkLayout::from_chunk_dims(state->shape, chunk);
  }
  return state;
}

// A stream over a record whose only chunk /index locates; nothing is read until fetch().
TensorStream located_stream(std::shared_ptr<h5::Handle> file, int fd, const RecordInfo& record,
                            const std::string& file_name, bool format2) {
  auto state = std::make_shared<TensorStream::State>();
  state->file = std::move(file);
  state->located = TensorStream::State::Located{fd,
                                                file_name,
                                                dataset_path(record.key),
                                                record.chunk_offset,
                                                record.stored_bytes,
                                                record.chunk_hash,
                                                record.chunk_filter_mask};
  state->where = file_name + " " + state->located->dataset;
  state->dtype = record.dtype;
  state->shape = record.shape;
  state->numel = record.numel();
  state->layout = ChunkLayout::from_chunk_dims(
      record.shape, std::vector<hsize_t>(record.shape.begin(), record.shape.end()));
  state->shuffle_bit = 0;  // the filter pipeline of dynaprobe's writer: shuffle, then zstd
  state->zstd_bit = 1;
  state->hash = format2 ? HashAlgorithm::kXxh3 : HashAlgorithm::kXxh64;
  state->every_chunk = format2;
  return TensorStream(std::move(state));
}

bool is_located(int fd, const RecordInfo& record) {
  return fd >= 0 && record.chunk_offset != 0 && record.stored_bytes != 0 &&
         record.stored_bytes <= record.nbytes() && !record.shape.empty();
}

}  // namespace

struct StepReader::Impl {
  fs::path path;
  std::shared_ptr<h5::Handle> file;
  int fd = -1;           // the file's descriptor, for reading single-chunk records by their offset
  bool format2 = false;  // format >= 2.0: nothing variable-length, every chunk hashed (XXH3)
  std::int64_t step = 0;
  std::string format_version;
  Provenance provenance;
  std::vector<RecordInfo> records;
  std::map<RecordKey, std::size_t> by_key;
  std::vector<std::string> skipped;
  std::vector<StoredMetrics> metrics;
  std::map<RecordKey, std::size_t> metrics_by_key;

  // A pending step (StepReader(PendingStep)): what it keeps in memory, and the committed file's
  // reader once something needed it.
  bool pending = false;
  std::vector<ModuleInfo> modules;
  std::map<RecordKey, std::vector<std::byte>> small_tensors;
  std::function<void()> wait_committed;
  std::mutex committed_mutex;
  std::unique_ptr<StepReader> committed;

  void index_by_key() {
    for (std::size_t i = 0; i < records.size(); ++i) by_key.emplace(records[i].key, i);
    for (std::size_t i = 0; i < metrics.size(); ++i) metrics_by_key.emplace(metrics[i].key, i);
  }
  // The committed file's reader (waits for the commit) and its row of `record`.
  std::pair<const StepReader*, const RecordInfo*> on_disk(const RecordInfo& record) {
    const StepReader& reader = committed_file();
    const RecordInfo* info = reader.find(record.key);
    if (!info) {
      throw FormatError(path.string() + ": record " + to_string(record.key) +
                        " is missing from the committed step");
    }
    return {&reader, info};
  }
  const StepReader& committed_file() {
    std::lock_guard lock(committed_mutex);
    if (!committed) {
      wait_committed();
      committed = std::make_unique<StepReader>(path);
    }
    return *committed;
  }
};

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

namespace {

FormatVersion read_format_version(hid_t file, const std::string& where) {
  if (!h5::has_attribute(file, schema::kFormatVersionAttr)) {
    throw FormatError(where + ": not a dynaprobe step file (no '" +
                      std::string(schema::kFormatVersionAttr) + "' attribute on /)");
  }
  // Format 1 wrote it variable-length, 2.0 fixed-length: which one tells the versions apart before
  // any variable-length read of a 2.0 file.
  bool variable = false;
  {
    h5::Handle attribute = h5::attribute_handle(
        H5Aopen(file, std::string(schema::kFormatVersionAttr).c_str(), H5P_DEFAULT),
        "opening the format version", where);
    h5::Handle type =
        h5::type_handle(H5Aget_type(attribute.get()), "reading the format version", where);
    variable = H5Tget_class(type.get()) == H5T_STRING && H5Tis_variable_str(type.get()) > 0;
  }
  FormatVersion version = parse_format_version(
      h5::read_string_attribute(file, schema::kFormatVersionAttr, where), where);
  if (variable && version.major >= 2) {
    throw FormatError(where + ": damaged: its format version attribute says " + version.text +
                      ", but is stored as format 1 stores it");
  }
  return version;
}

// Provenance: every other string attribute of the root group.
Provenance read_provenance(hid_t file, bool format2, const std::string& where) {
  Provenance provenance;
  for (const std::string& key : h5::attribute_names(file, where)) {
    if (key == schema::kFormatVersionAttr || key == schema::kStepAttr) continue;
    try {
      provenance[key] = h5::read_string_attribute(file, key, where, !format2);
    } catch (const FormatError&) {  // not a string: not provenance written by dynaprobe
    }
  }
  return provenance;
}

// /index read whole, with /chunk_hashes for format >= 1.2. The rows' strings and shapes are
// HDF5's variable-length data, reclaimed when the table goes away.
class IndexTable {
 public:
  IndexTable(hid_t file, const FormatVersion& version, const std::string& where);

  // Throws FormatError unless the index checksum (format >= 1.2) covers these rows, the chunk
  // hashes, `step` and `provenance`. Call before trusting any offset, hash or name of a row.
  void verify(std::int64_t step, const Provenance& provenance, const std::string& where) const;

  const std::vector<IndexRow>& rows() const { return unpacked_ ? unpacked_->rows() : rows_.rows; }
  const std::vector<std::uint64_t>& chunk_hashes() const { return chunk_hashes_; }

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
  Rows rows_;  // format 1
  // Format 2.0: the index's bytes as stored (its checksum covers them) and the rows read from them.
  std::vector<std::byte> bytes_;
  std::optional<UnpackedIndex> unpacked_;
  std::vector<std::uint64_t> chunk_hashes_;
};

IndexTable::IndexTable(hid_t file, const FormatVersion& version, const std::string& where) {
  const std::string index_name = "/" + std::string(schema::kIndexDataset);
  if (H5Lexists(file, index_name.c_str(), H5P_DEFAULT) <= 0) {
    throw FormatError(where + ": no " + index_name +
                      " table: not a complete dynaprobe step file (was it committed?)");
  }
  table_ = h5::dataset_handle(H5Dopen2(file, index_name.c_str(), H5P_DEFAULT), "opening the index",
                              where);
  if (version.major >= 2) {
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
    hashed_ = true;
    chunk_hashes_ = read_chunk_hashes(file, where);
    return;
  }
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

void IndexTable::verify(std::int64_t step, const Provenance& provenance,
                        const std::string& where) const {
  if (!hashed_) return;
  const std::uint64_t stored = h5::read_u64_attribute(
      table_.get(), schema::kIndexChecksumAttr, "/" + std::string(schema::kIndexDataset), where);
  const std::uint64_t computed = unpacked_
                                     ? index_checksum_v2(bytes_, chunk_hashes_, step, provenance)
                                     : index_checksum(rows_.rows, chunk_hashes_, step, provenance);
  if (computed != stored) {
    throw FormatError(where + ": damaged /index: its " + (unpacked_ ? "XXH3" : "XXH64") +
                      " checksum does not match the index, the chunk hashes, the step or the "
                      "provenance (a damaged disk, or the file was edited in place)");
  }
}

}  // namespace

StepReader::StepReader(const fs::path& path) : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  impl.path = path;
  impl.file = open_file(path);
  impl.fd = h5::file_descriptor(impl.file->get());
  const std::string where = path.string();
  h5::Lock lock(h5::hdf5_mutex());
  const hid_t file = impl.file->get();
  const FormatVersion version = read_format_version(file, where);
  impl.format_version = version.text;
  impl.format2 = version.major >= 2;
  impl.step =
      parse_step(h5::read_string_attribute(file, schema::kStepAttr, where, !impl.format2), where);
  impl.provenance = read_provenance(file, impl.format2, where);
  const IndexTable index(file, version, where);
  index.verify(impl.step, impl.provenance, where);
  impl.records.reserve(index.rows().size());
  // Where each index row went in records(), -1 for a skipped one (/metrics names index rows).
  std::vector<std::int64_t> record_of_index_row(index.rows().size(), -1);
  for (std::size_t i = 0; i < index.rows().size(); ++i) {
    std::string unknown;
    std::optional<RecordInfo> info =
        record_of_row(index.rows()[i], i, impl.step, index.chunk_hashes(), where, unknown);
    if (!info) {
      // A newer minor version may add kinds, sides or dtypes: such records are listed as
      // skipped, and everything this reader understands stays readable. In a file of a version
      // this reader knows, an unknown name can only be damage.
      if (!version.newer()) {
        throw FormatError(where + ": damaged /index: " + unknown + ", which format " +
                          version.text +
                          " does not have; the file is corrupt (re-capture or re-copy it)");
      }
      impl.skipped.push_back(unknown + ", written by a newer dynaprobe (format " + version.text +
                             ")");
      continue;
    }
    // Format 1.3: a record with elements but no stored bytes was judged at capture and not
    // stored (older writers stored every record).
    info->stored = !((version.major >= 2 || version.minor >= 3) && info->numel() > 0 &&
                     info->stored_bytes == 0);
    record_of_index_row[i] = static_cast<std::int64_t>(impl.records.size());
    impl.records.push_back(std::move(*info));
  }
  impl.metrics =
      read_stored_metrics(file, impl.records, record_of_index_row,
                          impl.format2 ? HashAlgorithm::kXxh3 : HashAlgorithm::kXxh64, where);
  impl.index_by_key();
}

StepReader::StepReader(PendingStep pending) : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  impl.pending = true;
  impl.path = std::move(pending.file);
  impl.format2 = true;
  impl.format_version =
      std::to_string(schema::kFormatMajor) + "." + std::to_string(schema::kFormatMinor);
  impl.step = pending.step;
  impl.provenance = std::move(pending.provenance);
  impl.records = std::move(pending.records);
  impl.metrics = std::move(pending.metrics);
  impl.modules = std::move(pending.modules);
  impl.small_tensors = std::move(pending.small_tensors);
  impl.wait_committed = std::move(pending.wait_committed);
  impl.index_by_key();
}

StepReader::~StepReader() = default;
StepReader::StepReader(StepReader&&) noexcept = default;
StepReader& StepReader::operator=(StepReader&&) noexcept = default;

const fs::path& StepReader::path() const { return impl_->path; }
std::int64_t StepReader::step() const { return impl_->step; }
const std::string& StepReader::format_version() const { return impl_->format_version; }
const Provenance& StepReader::provenance() const { return impl_->provenance; }
const std::vector<RecordInfo>& StepReader::records() const { return impl_->records; }
const std::vector<std::string>& StepReader::skipped_records() const { return impl_->skipped; }
const std::vector<StoredMetrics>& StepReader::stored_metrics() const { return impl_->metrics; }

const StoredMetrics* StepReader::find_metrics(const RecordKey& key) const {
  auto found = impl_->metrics_by_key.find(key);
  return found == impl_->metrics_by_key.end() ? nullptr : &impl_->metrics[found->second];
}

const RecordInfo* StepReader::find(const RecordKey& key) const {
  auto found = impl_->by_key.find(key);
  return found == impl_->by_key.end() ? nullptr : &impl_->records[found->second];
}

namespace {

// A graph's source: a variable-length string (format 1) or, in format 2.0, a fixed-length one
// (nothing read from HDF5's global heap).
std::string read_graph_text(hid_t dataset, bool format2, const std::string& context) {
  h5::Handle type = h5::type_handle(H5Dget_type(dataset), "reading graph type", context);
  h5::Handle space = h5::space_handle(H5Dget_space(dataset), "reading graph", context);
  if (H5Tget_class(type.get()) != H5T_STRING || H5Sget_simple_extent_npoints(space.get()) != 1) {
    throw FormatError(context + ": damaged: expected one string (the graph's source)");
  }
  if (H5Tis_variable_str(type.get()) > 0) {
    if (format2) {
      throw FormatError(context +
                        ": damaged: a variable-length string, which format 2.0 never has");
    }
    char* text = nullptr;
    h5::check<FormatError>(
        H5Dread(dataset, h5::string_type(context), H5S_ALL, H5S_ALL, H5P_DEFAULT, &text),
        "reading graph text", context);
    std::string value = text ? text : "";
    H5free_memory(text);
    return value;
  }
  const std::size_t size = H5Tget_size(type.get());
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
  h5::check<FormatError>(H5Dread(dataset, type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, value.data()),
                         "reading graph text", context);
  return h5::fixed_string(value.data(), size);
}

// Format 2.0: the checksum attribute of /modules or /graphs against what the reader read.
void verify_group(hid_t group, const std::vector<NamedAttributes>& entries, bool with_text,
                  const std::string& name, const std::string& where) {
  if (group_checksum(entries, with_text) !=
      h5::read_u64_attribute(group, schema::kGroupChecksumAttr, name, where)) {
    throw FormatError(where + ": damaged " + name +
                      ": its XXH3 checksum does not match what it holds (a damaged disk, or the "
                      "file was edited in place)");
  }
}

}  // namespace

std::vector<Graph> StepReader::graphs() const {
  if (impl_->pending) return impl_->committed_file().graphs();
  const std::string where = impl_->path.string();
  const bool format2 = impl_->format2;
  h5::Lock lock(h5::hdf5_mutex());
  const hid_t file = impl_->file->get();
  std::vector<Graph> graphs;
  const std::string group_name = "/" + std::string(schema::kGraphsGroup);
  const auto group = h5::open_group_if_present(file, group_name, where);
  if (!group) {
    if (format2) throw FormatError(where + ": damaged: no " + group_name + " group");
    return graphs;
  }
  std::vector<NamedAttributes> entries;
  const auto names = h5::link_names(group->get(), false, where);
  for (const std::string& name : names) {
    const std::string context = where + " /graphs/" + name;
    h5::Handle dataset = h5::dataset_handle(H5Dopen2(group->get(), name.c_str(), H5P_DEFAULT),
                                            "opening graph", context);
    Graph graph{name, "", read_graph_text(dataset.get(), format2, context), {}};
    NamedAttributes entry{name, graph.text, {}};
    for (const std::string& key : h5::attribute_names(dataset.get(), context)) {
      std::string value = h5::read_string_attribute(dataset.get(), key, context, !format2);
      entry.attributes[key] = value;
      if (key == schema::kGraphKindAttr) {
        graph.kind = std::move(value);
      } else {
        graph.attributes[key] = std::move(value);
      }
    }
    graphs.push_back(std::move(graph));
    entries.push_back(std::move(entry));
  }
  if (format2) {
    std::sort(entries.begin(), entries.end(),
              [](const NamedAttributes& a, const NamedAttributes& b) { return a.name < b.name; });
    verify_group(group->get(), entries, true, group_name, where);
  }
  return graphs;
}

std::vector<ModuleInfo> StepReader::modules() const {
  if (impl_->pending) return impl_->modules;
  const std::string where = impl_->path.string();
  const bool format2 = impl_->format2;
  h5::Lock lock(h5::hdf5_mutex());
  const hid_t file = impl_->file->get();
  std::vector<ModuleInfo> modules;
  const std::string group_name = "/" + std::string(schema::kModulesGroup);
  const auto group = h5::open_group_if_present(file, group_name, where);
  if (!group) {
    if (format2) throw FormatError(where + ": damaged: no " + group_name + " group");
    return modules;
  }
  std::vector<NamedAttributes> entries;
  const auto names = h5::link_names(group->get(), true, where);
  for (const std::string& name : names) {
    const std::string context = where + " /modules/" + name;
    h5::Handle module = h5::group_handle(H5Gopen2(group->get(), name.c_str(), H5P_DEFAULT),
                                         "opening module", context);
    ModuleInfo info{name, {}};
    for (const std::string& key : h5::attribute_names(module.get(), context)) {
      info.attributes[key] = h5::read_string_attribute(module.get(), key, context, !format2);
    }
    if (format2) {
      entries.push_back(
          NamedAttributes{name, "", {info.attributes.begin(), info.attributes.end()}});
    }
    modules.push_back(std::move(info));
  }
  if (format2) verify_group(group->get(), entries, false, group_name, where);
  return modules;
}

void StepReader::wait_readable() const {
  if (impl_->pending) impl_->committed_file();
}

TensorStream StepReader::open(const RecordInfo& record) const {
  if (!record.stored) {
    throw FormatError(impl_->path.string() + ": record " + to_string(record.key) +
                      " was judged at capture and its tensor not stored (PrecisionChecker(dump="
                      "\"failing\" or \"stats\")): only its dtype, shape and metrics are in the "
                      "dump");
  }
  if (impl_->pending) {
    const auto [reader, info] = impl_->on_disk(record);
    return reader->open(*info);
  }
  // Most records of a step are small, and opening a dataset costs more than reading and checking
  // its bytes: a single-chunk record is read at the offset /index gives, checked by its hash.
  if (is_located(impl_->fd, record)) {
    return located_stream(impl_->file, impl_->fd, record, impl_->path.string(), impl_->format2);
  }
  const std::string name = dataset_path(record.key);
  const auto state = [&] {
    try {
      return open_state(impl_->file, name, impl_->path.string(), record.dtype, impl_->format2);
    } catch (const FormatError& error) {
      throw FormatError("record " + to_string(record.key) + ": " + error.what());
    }
  }();
  if (state->shape != record.shape) {
    throw FormatError(impl_->path.string() + " " + name + ": the index says shape " +
                      shape_string(record.shape) + ", but the dataset has shape " +
                      shape_string(state->shape));
  }
  if (impl_->format2 && state->numel > 0 && !state->shape.empty()) {
    // Format 2.0: every chunk is checked against its XXH3; a dataset that is not dynaprobe's
    // chunk layout, or has other chunks than the index says, is damage.
    if (!state->layout || state->layout->chunk_count() != record.chunk_hashes.size()) {
      throw FormatError(impl_->path.string() + " " + name + ": damaged: its chunks are not the " +
                        std::to_string(record.chunk_hashes.size()) + " the index hashes");
    }
    state->chunk_hashes = record.chunk_hashes;
    state->hash = HashAlgorithm::kXxh3;
    state->every_chunk = true;
  } else if (state->layout && state->layout->chunk_count() == record.chunk_hashes.size()) {
    // A file rewritten by a tool (h5repack) may have other chunks: then there is nothing to
    // check them against, as for files older than 1.2.
    state->chunk_hashes = record.chunk_hashes;
  }
  return TensorStream(state);
}

std::vector<std::byte> StepReader::read(const RecordInfo& record) const {
  if (impl_->pending) {
    auto kept = impl_->small_tensors.find(record.key);
    if (kept != impl_->small_tensors.end()) return kept->second;
    const auto [reader, info] = impl_->on_disk(record);
    return reader->read(*info);
  }
  TensorStream stream = open(record);
  std::vector<std::byte> data(record.nbytes());
  const std::size_t element_size = dtype_size(record.dtype);
  stream_chunks(
      stream,
      [&](ChunkExtent extent, const std::byte* chunk) {
        std::memcpy(data.data() + extent.first_element * element_size, chunk,
                    extent.element_count * element_size);
      },
      ChunkOrder::kAnyOrder);
  return data;
}

TensorStream open_dataset(const fs::path& file, const std::string& dataset) {
  return TensorStream(open_state(open_file(file), dataset, file.string(), std::nullopt));
}

void set_open_observer(OpenObserver observer) { open_observer.store(observer); }

DumpFiles list_dump(const fs::path& dump) {
  std::error_code error;
  const auto status = fs::status(dump, error);
  if (!fs::exists(status)) {
    throw IoError(dump.string() +
                  ": no such file or folder (expected a dump folder or a step file)");
  }
  DumpFiles files;
  if (fs::is_regular_file(status)) {
    files.steps.push_back(dump);
    return files;
  }
  std::vector<std::pair<long long, fs::path>> steps;
  for (const auto& entry : fs::directory_iterator(dump, error)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(schema::kStepFilePrefix)) continue;
    if (name.ends_with(schema::kPartialSuffix)) {
      files.unfinished.push_back(entry.path());
    } else if (name.ends_with(schema::kStepFileSuffix)) {
      const auto digits = std::string_view(name).substr(
          schema::kStepFilePrefix.size(),
          name.size() - schema::kStepFilePrefix.size() - schema::kStepFileSuffix.size());
      long long step = 0;
      if (std::from_chars(digits.data(), digits.data() + digits.size(), step).ec == std::errc()) {
        steps.emplace_back(step, entry.path());
      }
    }
  }
  if (error) throw IoError(dump.string() + ": cannot list folder: " + error.message());
  std::sort(steps.begin(), steps.end());
  for (auto& [step, path] : steps) files.steps.push_back(std::move(path));
  std::sort(files.unfinished.begin(), files.unfinished.end());
  return files;
}

}  // namespace dynaprobe::formats

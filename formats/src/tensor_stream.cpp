// TensorStream: a stored tensor read chunk by chunk, whichever format generation wrote it (its
// FormatReader checks the chunks), and stream_chunks(), which overlaps fetching and decoding.
#include "tensor_stream.h"

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
#include <mutex>
#include <thread>

#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/schema.h"
#include "hdf5_types.h"

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
// /index as it is): then the record's generation says whether its dataset is read through HDF5.
void fetch_located(const TensorStream::State& s, RawChunk& raw) {
  const auto& at = *s.located;
  raw.bytes.resize(at.size);
  raw.filter_mask = at.filter_mask;
  if (h5::read_at(at.fd, raw.bytes.data(), at.size, at.offset) &&
      hash_bytes(at.algorithm, raw.bytes.data(), raw.bytes.size()) == at.hash) {
    return;
  }
  const auto dataset = open_state(s.file, at.dataset, at.file_name, s.dtype, *s.format);
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
                      hash_name(at.algorithm) +
                      " in /index (a damaged disk, or the file was edited in place)");
  }
  s.format->relocated_chunk(s.where);
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
  const bool unshuffle = s.applied(s.shuffle_bit, raw.filter_mask) && element_size > 1;
  const std::byte* data = raw.bytes.data();
  std::size_t size = raw.bytes.size();
  const auto corrupt = [&](const std::string& what) { return corrupt_chunk(s.where, chunk, what); };
  // Checked before any byte is used (a located chunk was checked when fetched).
  if (!s.located) s.format->check_chunk(s, chunk, raw);
  if (s.applied(s.zstd_bit, raw.filter_mask)) {
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
    const std::size_t got =
        ZSTD_decompressDCtx(thread_decompressor(s.format->zstd_content_checksum()), target.data(),
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

std::shared_ptr<TensorStream::State> open_state(std::shared_ptr<h5::Handle> file,
                                                const std::string& dataset_name,
                                                const std::string& file_name,
                                                std::optional<DType> expected_dtype,
                                                const FormatReader& format) {
  auto state = std::make_shared<TensorStream::State>();
  state->file = std::move(file);
  state->format = &format;
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
    const std::string name = format.read_string(dataset, schema::kDtypeAttr, where);
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

TensorStream located_stream(std::shared_ptr<h5::Handle> file, int fd, const RecordInfo& record,
                            const std::string& file_name, const FormatReader& format) {
  auto state = std::make_shared<TensorStream::State>();
  state->file = std::move(file);
  state->format = &format;
  state->located = TensorStream::State::Located{fd,
                                                file_name,
                                                dataset_path(record.key),
                                                record.chunk_offset,
                                                record.stored_bytes,
                                                record.chunk_hash,
                                                record.chunk_filter_mask,
                                                format.hash()};
  state->where = file_name + " " + state->located->dataset;
  state->dtype = record.dtype;
  state->shape = record.shape;
  state->numel = record.numel();
  state->layout = ChunkLayout::from_chunk_dims(
      record.shape, std::vector<hsize_t>(record.shape.begin(), record.shape.end()));
  state->shuffle_bit = 0;  // the filter pipeline of dynaprobe's writer: shuffle, then zstd
  state->zstd_bit = 1;
  return TensorStream(std::move(state));
}

bool is_located(int fd, const RecordInfo& record) {
  return fd >= 0 && record.chunk_offset != 0 && record.stored_bytes != 0 &&
         record.stored_bytes <= record.nbytes() && !record.shape.empty();
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

TensorStream open_dataset(const fs::path& file, const std::string& dataset) {
  return TensorStream(
      open_state(open_file(file), dataset, file.string(), std::nullopt, format_1_reader()));
}

void set_open_observer(OpenObserver observer) { open_observer.store(observer); }

}  // namespace dynaprobe::formats

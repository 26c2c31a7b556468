// StepWriter: a step's records through the chunk pipeline into one HDF5 file, repeats stored
// once, then the index and the crash-safe commit (durable_file.h, step_tables.h).
#include "dynaprobe/formats/writer.h"

#include <tbb/concurrent_queue.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "chunk_layout.h"
#include "chunk_pipeline.h"
#include "direct_driver.h"
#include "durable_file.h"
#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/niceness.h"
#include "dynaprobe/formats/schema.h"
#include "h5.h"
#include "hdf5_types.h"
#include "step_tables.h"

namespace dynaprobe::formats {
namespace fs = std::filesystem;
namespace {

constexpr int kMaxRank = H5S_MAX_RANK;

// A cheap fingerprint of a tensor's bytes for finding repeats: its first, middle and last 64
// bytes. Equal fingerprints are then compared byte for byte.
std::uint64_t fingerprint(const TensorView& tensor) {
  const auto* data = static_cast<const std::byte*>(tensor.data);
  const std::size_t size = tensor.nbytes(), window = std::min<std::size_t>(size, 64);
  std::uint64_t h = xxh3(data, window);
  h = h * 31 + xxh3(data + (size - window) / 2, window);
  return h * 31 + xxh3(data + size - window, window);
}

// For each record, the position of the record of `records` whose dataset is to hold its bytes:
// among the records with the same dtype, shape and bytes, the first in page-aligned memory, whose
// chunks go to the disk straight from it (direct_driver.h; the others would be copied first), or
// else the first. A record with no repeat holds its own.
std::vector<std::size_t> holders_of_same_bytes(std::span<const Record> records) {
  std::vector<std::size_t> first(records.size());
  std::unordered_multimap<std::uint64_t, std::size_t> seen;
  for (std::size_t i = 0; i < records.size(); ++i) {
    first[i] = i;
    const TensorView& tensor = records[i].tensor;
    if (tensor.shape.empty() || tensor.numel() == 0) continue;  // compact or empty: no data
    const std::uint64_t key = fingerprint(tensor);
    const auto [begin, end] = seen.equal_range(key);
    for (auto it = begin; it != end; ++it) {
      const TensorView& other = records[it->second].tensor;
      if (other.dtype == tensor.dtype && other.shape == tensor.shape &&
          std::memcmp(other.data, tensor.data, tensor.nbytes()) == 0) {
        first[i] = it->second;
        break;
      }
    }
    if (first[i] == i) seen.emplace(key, i);
  }
  std::vector<std::size_t> aligned_of_first(records.size(), records.size());  // none yet
  for (std::size_t i = 0; i < records.size(); ++i) {
    const auto address = reinterpret_cast<std::uintptr_t>(records[i].tensor.data);
    if (address % h5::kDirectAlignment == 0 && aligned_of_first[first[i]] == records.size()) {
      aligned_of_first[first[i]] = i;
    }
  }
  std::vector<std::size_t> holder(records.size());
  for (std::size_t i = 0; i < records.size(); ++i) {
    const std::size_t aligned = aligned_of_first[first[i]];
    holder[i] = aligned < records.size() ? aligned : first[i];
  }
  return holder;
}

}  // namespace

struct StepWriter::Impl {
  fs::path final_path;
  fs::path partial_path;
  std::int64_t step = 0;
  WriterOptions options;
  Provenance provenance;  // as written, for the index checksum
  h5::Handle file;
  h5::Handle tensors;
  h5::Handle graphs;
  h5::Handle modules;
  std::map<std::string, h5::Handle, std::less<>> module_groups;
  std::set<RecordKey> keys;
  std::vector<RecordInfo> index;
  std::set<std::string> graph_names;
  std::set<std::string> module_names;
  // What /modules and /graphs hold, for their checksums (written by commit()).
  std::vector<NamedAttributes> module_entries;
  std::vector<NamedAttributes> graph_entries;
  bool broken = false;
  bool committed = false;
  tbb::task_arena arena;
  std::unique_ptr<NiceObserver> nice;
  std::vector<ChunkBuffers> buffers;
  tbb::concurrent_bounded_queue<ChunkBuffers*> free_buffers;
  std::optional<int> fd;  // the step file's descriptor (-1: none), looked up on the first write
  WritebackStream writeback;

  using Plan = WritePlan;
  // The dataset being written by the serial output stage.
  h5::Handle dataset;
  RecordInfo dataset_info;  // stored_bytes and the chunk location so far

  hid_t module_group(const std::string& module);
  void create_dataset(const Plan& plan);
  void locate_only_chunk(std::uint64_t hash);
  // Stores `record` as a hard link to the dataset `stored` describes; returns its index row.
  RecordInfo link(const Record& record, RecordInfo stored);
  // Records of earlier batches stored as they are in one chunk, by fingerprint: index positions.
  std::unordered_multimap<std::uint64_t, std::size_t> stored_as_is;
  std::vector<std::byte> read_back;
  std::optional<std::size_t> find_stored_copy(const TensorView& tensor);
  void remember_stored(const TensorView& tensor, std::size_t index_position);
  void finish_dataset(const Plan& plan);
  void write_all(const std::vector<Plan>& plans);
  void store(const ChunkItem& item);
  void write_chunk(const ChunkItem& item);
  // /index with its checksum, and the checksums of /modules and /graphs.
  void write_index();
  void ensure_usable(std::string_view action) const;
  std::set<RecordKey> check_new_records(std::span<const Record> records, bool with_data) const;
  std::vector<StoredMetrics> metrics;  // for /metrics, written by commit()
};

void StepWriter::Impl::ensure_usable(std::string_view action) const {
  if (committed) {
    throw UsageError("cannot " + std::string(action) + ": step " + std::to_string(step) +
                     " was already committed to " + final_path.string());
  }
  if (broken) {
    throw IoError("cannot " + std::string(action) + ": an earlier write to " +
                  partial_path.string() + " failed; the step is lost, earlier steps are intact");
  }
}

hid_t StepWriter::Impl::module_group(const std::string& module) {
  auto found = module_groups.find(module);
  if (found != module_groups.end()) return found->second.get();
  h5::Handle group = h5::group_handle(
      H5Gcreate2(tensors.get(), module.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
      "creating group for module " + module, partial_path.string());
  return module_groups.emplace(module, std::move(group)).first->second.get();
}

void StepWriter::Impl::create_dataset(const Plan& plan) {
  const Record& record = *plan.record;
  const std::string where = partial_path.string() + " " + dataset_path(record.key);
  const auto& shape = record.tensor.shape;
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  h5::Handle space =
      shape.empty()
          ? h5::space_handle(H5Screate(H5S_SCALAR), "creating dataspace", where)
          : h5::space_handle(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                             "creating dataspace", where);
  h5::Handle dcpl = h5::plist_handle(H5Pcreate(H5P_DATASET_CREATE), "creating dcpl", where);
  h5::check(H5Pset_obj_track_times(dcpl.get(), false), "configuring dataset", where);
  if (plan.layout) {
    const auto& chunk = plan.layout->chunk_dims();
    h5::check(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()),
              "setting chunk size", where);
    h5::check(H5Pset_shuffle(dcpl.get()), "setting shuffle filter", where);
    const unsigned level = static_cast<unsigned>(options.zstd_level);
    h5::check(H5Pset_filter(dcpl.get(), schema::kZstdFilterId, H5Z_FLAG_OPTIONAL, 1, &level),
              "setting zstd filter", where);
  } else {
    h5::check(H5Pset_layout(dcpl.get(), H5D_COMPACT), "setting compact layout", where);
  }
  h5::Handle type = stored_type(record.tensor.dtype);
  const std::string name =
      std::string(kind_name(record.key.kind)) + "." + std::string(side_name(record.key.side)) +
      "." + std::to_string(record.key.call) + "." + std::to_string(record.key.tensor_index);
  dataset = h5::dataset_handle(H5Dcreate2(module_group(record.key.module), name.c_str(), type.get(),
                                          space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                               "creating dataset", where);
  h5::write_string_attribute(dataset.get(), schema::kDtypeAttr, dtype_name(record.tensor.dtype),
                             where);
  dataset_info = RecordInfo{};
  dataset_info.key = record.key;
  dataset_info.label = record.label;
  dataset_info.dtype = record.tensor.dtype;
  dataset_info.shape = record.tensor.shape;
  if (!plan.layout && record.tensor.numel() > 0) {  // a 0-d tensor: one small compact write
    h5::check(
        H5Dwrite(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, record.tensor.data),
        "writing", where);
    dataset_info.stored_bytes = record.tensor.nbytes();
  }
}

// The index position of a record written by an earlier write() with the same dtype, shape and
// bytes, stored as they are in one chunk: its bytes are read back from the file and compared.
std::optional<std::size_t> StepWriter::Impl::find_stored_copy(const TensorView& tensor) {
  if (tensor.shape.empty() || tensor.numel() == 0 || stored_as_is.empty()) return std::nullopt;
  const auto [begin, end] = stored_as_is.equal_range(fingerprint(tensor));
  for (auto it = begin; it != end; ++it) {
    const RecordInfo& info = index[it->second];
    if (info.dtype != tensor.dtype || info.shape != tensor.shape || !fd || *fd < 0) continue;
    read_back.resize(info.stored_bytes);
    if (h5::read_at(*fd, read_back.data(), read_back.size(), info.chunk_offset) &&
        std::memcmp(read_back.data(), tensor.data, read_back.size()) == 0) {
      return it->second;
    }
  }
  return std::nullopt;
}

void StepWriter::Impl::remember_stored(const TensorView& tensor, std::size_t index_position) {
  const RecordInfo& info = index[index_position];
  if (info.chunk_offset != 0 && info.chunk_filter_mask == schema::kAllFiltersSkipped &&
      info.stored_bytes == tensor.nbytes()) {
    stored_as_is.emplace(fingerprint(tensor), index_position);
  }
}

RecordInfo StepWriter::Impl::link(const Record& record, RecordInfo stored) {
  const std::string path = dataset_path(record.key);
  const std::string target = dataset_path(stored.key);
  h5::Lock lock(h5::hdf5_mutex());
  module_group(record.key.module);
  h5::check(H5Lcreate_hard(file.get(), target.c_str(), file.get(), path.c_str(), H5P_DEFAULT,
                           H5P_DEFAULT),
            "linking to " + target, partial_path.string() + " " + path);
  stored.key = record.key;
  stored.label = record.label;
  return stored;
}

// Notes in /index where the just-written only chunk of `dataset` lies, for readers to pread it.
void StepWriter::Impl::locate_only_chunk(std::uint64_t hash) {
  const auto chunk = h5::first_chunk_location(dataset.get(), dataset_info.shape.size());
  if (!chunk || chunk->size != dataset_info.stored_bytes) return;  // readers open the dataset
  dataset_info.chunk_offset = chunk->offset;
  dataset_info.chunk_filter_mask = chunk->filter_mask;
  dataset_info.chunk_hash = hash;
}

void StepWriter::Impl::finish_dataset(const Plan& plan) {
  const Record& record = *plan.record;
  dataset.close(partial_path.string() + " " + dataset_path(record.key));
  index.push_back(std::move(dataset_info));
}

// Compression runs in parallel; HDF5 writes run serially, in order (docs/design.md, Threads).
// The file driver queues the chunks' direct writes (direct_driver.h): they are on the disk, or
// their failure thrown, before this returns, also when the pipeline throws (a queued write may
// be from a record's memory, which is the caller's again after write()).
void StepWriter::Impl::write_all(const std::vector<Plan>& plans) {
  if (!fd) fd = h5::file_descriptor(file.get());
  ChunkSequence sequence(plans);
  const auto produce = [&](tbb::flow_control& control) -> ChunkItem {
    std::optional<ChunkItem> item = sequence.next();
    if (!item) {
      control.stop();
      return {};
    }
    if (item->has_chunk) free_buffers.pop(item->buffers);
    return *item;
  };
  const auto compress = [&](ChunkItem item) -> ChunkItem {
    compress_chunk(item, options.zstd_level, options.min_compression_ratio);
    return item;
  };
  const std::string where = partial_path.string();
  try {
    arena.execute([&] {
      tbb::parallel_pipeline(
          buffers.size(),
          tbb::make_filter<void, ChunkItem>(tbb::filter_mode::serial_in_order, produce) &
              tbb::make_filter<ChunkItem, ChunkItem>(tbb::filter_mode::parallel, compress) &
              tbb::make_filter<ChunkItem, void>(tbb::filter_mode::serial_in_order,
                                                [&](ChunkItem item) { store(item); }));
    });
  } catch (...) {
    try {
      h5::wait_for_direct_writes(*fd, where);
    } catch (const IoError&) {  // the pipeline's error is the one to report
    }
    throw;
  }
  h5::wait_for_direct_writes(*fd, where);
}

// The serial stage: a record's first item creates its dataset, its last closes and indexes it.
// The item's buffers go back to the pipeline, also when a write fails.
void StepWriter::Impl::store(const ChunkItem& item) {
  struct ReturnBuffers {
    Impl& impl;
    ChunkBuffers* buffers;
    ~ReturnBuffers() {
      if (buffers) impl.free_buffers.push(buffers);
    }
  } give_back{*this, item.buffers};
  {
    h5::Lock lock(h5::hdf5_mutex());
    if (item.first) create_dataset(*item.plan);
    if (item.has_chunk) write_chunk(item);
    if (item.last) finish_dataset(*item.plan);
  }
  if (writeback.due()) writeback.stream(*fd, partial_path);  // outside HDF5's lock
}

// Writes the item's payload as its chunk of `dataset` and notes it in `dataset_info`: the bytes
// stored, the only chunk's location, or each chunk's hash.
void StepWriter::Impl::write_chunk(const ChunkItem& item) {
  const ChunkLayout& layout = *item.plan->layout;
  const auto offset = layout.offset(item.chunk);
  std::optional<h5::BorrowedPayload> borrowed;  // the record's bytes: written without a copy
  if (item.payload_in_record) borrowed.emplace(item.payload);
  h5::check(H5Dwrite_chunk(dataset.get(), H5P_DEFAULT, item.filter_mask, offset.data(),
                           item.payload_size, item.payload),
            "writing chunk " + std::to_string(item.chunk),
            partial_path.string() + " " + dataset_path(item.plan->record->key));
  dataset_info.stored_bytes += item.payload_size;
  if (layout.chunk_count() == 1) locate_only_chunk(item.payload_hash);
  dataset_info.chunk_hashes.push_back(item.payload_hash);
  writeback.wrote(item.payload_size);
}

void StepWriter::Impl::write_index() {
  write_index_tables(file.get(), index, step, provenance, partial_path.string());
  h5::Lock lock(h5::hdf5_mutex());
  // /modules and /graphs: a checksum each, over what their objects hold (format 2.0).
  const std::string where = partial_path.string();
  h5::write_u64_attribute(modules.get(), schema::kGroupChecksumAttr,
                          group_checksum(module_entries, false), where + " /modules");
  std::sort(graph_entries.begin(), graph_entries.end(),
            [](const NamedAttributes& a, const NamedAttributes& b) { return a.name < b.name; });
  h5::write_u64_attribute(graphs.get(), schema::kGroupChecksumAttr,
                          group_checksum(graph_entries, true), where + " /graphs");
}

StepWriter::StepWriter(const fs::path& dump_dir, std::int64_t step, Provenance provenance,
                       WriterOptions options)
    : impl_(std::make_unique<Impl>()) {
  h5::init();
  Impl& impl = *impl_;
  impl.step = step;
  impl.options = options;
  impl.final_path = dump_dir / step_file_name(step);
  impl.partial_path = impl.final_path;
  impl.partial_path += schema::kPartialSuffix;
  if (options.chunk_bytes == 0) throw UsageError("WriterOptions.chunk_bytes must be positive");
  if (options.threads > 0) impl.arena.initialize(options.threads);
  if (options.nice != 0) {
    impl.arena.initialize();
    impl.nice = std::make_unique<NiceObserver>(impl.arena, options.nice);
  }
  for (const auto& reserved : {schema::kFormatVersionAttr, schema::kStepAttr}) {
    if (provenance.count(std::string(reserved))) {
      throw UsageError("provenance key '" + std::string(reserved) +
                       "' is reserved by the dump format; choose another name");
    }
  }
  std::error_code error;
  if (options.create_folder) fs::create_directories(dump_dir, error);
  if (error) {
    throw IoError("cannot create dump folder " + dump_dir.string() + ": " + error.message());
  }
  if (!fs::is_directory(dump_dir, error)) {
    throw IoError("the dump folder " + dump_dir.string() +
                  " does not exist any more (removed during the run?)");
  }
  // symlink_status: a link (even a dangling one) at the step's name is something to refuse, not
  // to follow.
  // A storage error, not a usage error: a capture whose folder another run already wrote (it
  // finished, so its lock is free) loses the step and keeps training (strict_io off).
  if (fs::exists(fs::symlink_status(impl.final_path, error))) {
    throw IoError("step " + std::to_string(step) + " already exists in " +
                  impl.final_path.string() +
                  "; dynaprobe never overwrites a committed step: write to a new folder");
  }
  prepare_partial_path(impl.partial_path);
  const std::string where = impl.partial_path.string();
  h5::Lock lock(h5::hdf5_mutex());
  h5::Handle fapl = h5::plist_handle(H5Pcreate(H5P_FILE_ACCESS), "creating fapl", where);
  h5::check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_V110),
            "setting file format bounds", where);
  h5::use_direct_writes(fapl.get());
  // H5F_ACC_EXCL: HDF5 opens with O_CREAT | O_EXCL, which creates a new file or fails, and never
  // follows a symbolic link planted at the name in the meantime.
  impl.file = h5::file_handle(H5Fcreate(where.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get()),
                              "cannot create step file", where);
  h5::write_string_attribute(
      impl.file.get(), schema::kFormatVersionAttr,
      std::to_string(schema::kFormatMajor) + "." + std::to_string(schema::kFormatMinor), where);
  h5::write_string_attribute(impl.file.get(), schema::kStepAttr, std::to_string(step), where);
  for (const auto& [key, value] : provenance) {
    h5::write_string_attribute(impl.file.get(), key, value, where);
  }
  impl.provenance = std::move(provenance);
  impl.tensors =
      h5::group_handle(H5Gcreate2(impl.file.get(), std::string(schema::kTensorsGroup).c_str(),
                                  H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                       "creating /tensors", where);
  impl.graphs =
      h5::group_handle(H5Gcreate2(impl.file.get(), std::string(schema::kGraphsGroup).c_str(),
                                  H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                       "creating /graphs", where);
  {
    // Creation order is tracked so that readers list modules in model order.
    h5::Handle gcpl = h5::plist_handle(H5Pcreate(H5P_GROUP_CREATE), "creating gcpl", where);
    h5::check(H5Pset_link_creation_order(gcpl.get(), H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED),
              "tracking creation order", where);
    impl.modules =
        h5::group_handle(H5Gcreate2(impl.file.get(), std::string(schema::kModulesGroup).c_str(),
                                    H5P_DEFAULT, gcpl.get(), H5P_DEFAULT),
                         "creating /modules", where);
  }
  const std::size_t tokens = 2 * static_cast<std::size_t>(impl.arena.max_concurrency());
  impl.buffers.resize(tokens);
  for (auto& buffers : impl.buffers) impl.free_buffers.push(&buffers);
}

StepWriter::~StepWriter() {
  if (!impl_ || impl_->committed) return;
  impl_->dataset.reset();
  impl_->module_groups.clear();
  impl_->tensors.reset();
  impl_->graphs.reset();
  impl_->modules.reset();
  impl_->file.reset();
  std::error_code ignored;
  fs::remove(impl_->partial_path, ignored);
}

// The keys of `records`, checked: new in this step, of this step, a shape HDF5 can hold and,
// when `with_data`, data for their elements.
std::set<RecordKey> StepWriter::Impl::check_new_records(std::span<const Record> records,
                                                        bool with_data) const {
  std::set<RecordKey> batch_keys;
  for (const Record& record : records) {
    const RecordKey& key = record.key;
    validate_module_path(key.module);
    if (key.step != step) {
      throw UsageError("record " + to_string(key) + " belongs to step " + std::to_string(key.step) +
                       ", but this writer writes step " + std::to_string(step));
    }
    if (keys.count(key) || !batch_keys.insert(key).second) {
      throw UsageError("record " + to_string(key) + " was already written in this step");
    }
    const auto& shape = record.tensor.shape;
    if (shape.size() > static_cast<std::size_t>(kMaxRank)) {
      throw UsageError("record " + to_string(key) + " has " + std::to_string(shape.size()) +
                       " dimensions; HDF5 stores at most " + std::to_string(kMaxRank));
    }
    for (auto d : shape) {
      if (d < 0) throw UsageError("record " + to_string(key) + " has a negative dimension");
    }
    if (with_data && record.tensor.numel() > 0 && record.tensor.data == nullptr) {
      throw UsageError("record " + to_string(key) + " has elements but no data pointer");
    }
  }
  return batch_keys;
}

void StepWriter::describe(std::span<const Record> records) {
  Impl& impl = *impl_;
  impl.ensure_usable("describe records");
  const std::set<RecordKey> batch_keys = impl.check_new_records(records, false);
  for (const Record& record : records) {
    RecordInfo info;
    info.key = record.key;
    info.label = record.label;
    info.dtype = record.tensor.dtype;
    info.shape = record.tensor.shape;
    info.stored = info.numel() == 0;  // stored_bytes 0: nothing stored (an empty one is whole)
    impl.index.push_back(std::move(info));
  }
  impl.keys.insert(batch_keys.begin(), batch_keys.end());
}

void StepWriter::write_metrics(std::span<const StoredMetrics> metrics) {
  Impl& impl = *impl_;
  impl.ensure_usable("write metrics");
  impl.metrics.insert(impl.metrics.end(), metrics.begin(), metrics.end());
}

void StepWriter::write(std::span<const Record> records) {
  Impl& impl = *impl_;
  impl.ensure_usable("write records");
  std::vector<Impl::Plan> plans;
  plans.reserve(records.size());
  const std::set<RecordKey> batch_keys = impl.check_new_records(records, true);
  // Records with the same bytes (eager and compiled agreeing bit for bit, a block's output that
  // is the next block's input) are stored once: the dataset of one of them, the holder, has the
  // bytes; the others' are hard links to it and their index rows repeat its location. Repeats
  // within the batch are compared in memory; repeats of records of earlier batches, read back
  // from the file, when those were stored as they are in one chunk (most float32 data: see
  // min_compression_ratio).
  const std::vector<std::size_t> holder = holders_of_same_bytes(records);
  std::vector<std::optional<std::size_t>> stored(records.size());  // index row with the bytes
  std::vector<std::size_t> plan_of(records.size());
  for (std::size_t i = 0; i < records.size(); ++i) {
    if (holder[i] != i) continue;
    stored[i] = impl.find_stored_copy(records[i].tensor);
    if (stored[i]) continue;
    const Record& record = records[i];
    Impl::Plan plan{&record, std::nullopt};
    if (!record.tensor.shape.empty() && record.tensor.numel() > 0) {
      plan.layout = ChunkLayout::plan(record.tensor.shape, dtype_size(record.tensor.dtype),
                                      impl.options.chunk_bytes);
    }
    plan_of[i] = plans.size();
    plans.push_back(std::move(plan));
  }
  try {
    const std::size_t written_before = impl.index.size();
    impl.write_all(plans);  // appends the index rows of `plans`, in plan order
    // The batch's index rows in record order, the links' rows repeating their dataset's.
    std::vector<RecordInfo> rows(records.size());
    for (std::size_t i = 0; i < records.size(); ++i) {  // the holders first
      if (holder[i] != i) continue;
      rows[i] = stored[i] ? impl.link(records[i], impl.index[*stored[i]])  // of an earlier batch
                          : std::move(impl.index[written_before + plan_of[i]]);
    }
    for (std::size_t i = 0; i < records.size(); ++i) {
      if (holder[i] != i) rows[i] = impl.link(records[i], rows[holder[i]]);
    }
    impl.index.resize(written_before);
    for (std::size_t i = 0; i < records.size(); ++i) {
      impl.index.push_back(std::move(rows[i]));
      if (holder[i] == i && !stored[i])
        impl.remember_stored(records[i].tensor, impl.index.size() - 1);
    }
  } catch (...) {
    impl.broken = true;
    throw;
  }
  impl.keys.insert(batch_keys.begin(), batch_keys.end());
}

void StepWriter::write_graph(const Graph& graph) {
  Impl& impl = *impl_;
  impl.ensure_usable("write graph " + graph.name);
  validate_module_path(graph.name);
  // Checked before anything is written: a refused graph leaves no dataset behind.
  if (graph.attributes.count(std::string(schema::kGraphKindAttr))) {
    throw UsageError("graph attribute 'kind' is reserved; set Graph::kind instead");
  }
  if (!impl.graph_names.insert(graph.name).second) {
    throw UsageError("graph " + graph.name + " was already written in step " +
                     std::to_string(impl.step));
  }
  const std::string where = impl.partial_path.string() + " /graphs/" + graph.name;
  h5::Lock lock(h5::hdf5_mutex());
  try {
    // A fixed-length string (format 2.0): its bytes are the dataset's, nothing in the global heap.
    h5::Handle type = h5::fixed_string_type(graph.text.size(), where);
    h5::Handle space = h5::space_handle(H5Screate(H5S_SCALAR), "creating dataspace", where);
    h5::Handle dataset =
        h5::dataset_handle(H5Dcreate2(impl.graphs.get(), graph.name.c_str(), type.get(),
                                      space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                           "creating graph dataset", where);
    std::string text = graph.text;
    text.resize(std::max<std::size_t>(text.size(), 1), '\0');
    h5::check(H5Dwrite(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()),
              "writing graph", where);
    h5::write_string_attribute(dataset.get(), schema::kGraphKindAttr, graph.kind, where);
    for (const auto& [key, value] : graph.attributes) {
      h5::write_string_attribute(dataset.get(), key, value, where);
    }
    NamedAttributes entry{graph.name, graph.text, graph.attributes};
    entry.attributes[std::string(schema::kGraphKindAttr)] = graph.kind;
    impl.graph_entries.push_back(std::move(entry));
  } catch (const IoError&) {
    impl.broken = true;
    throw;
  }
}

void StepWriter::write_module(const ModuleInfo& module) {
  Impl& impl = *impl_;
  impl.ensure_usable("write module " + module.module);
  validate_module_path(module.module);
  if (!impl.module_names.insert(module.module).second) {
    throw UsageError("module " + module.module + " was already described in step " +
                     std::to_string(impl.step));
  }
  const std::string where = impl.partial_path.string() + " /modules/" + module.module;
  h5::Lock lock(h5::hdf5_mutex());
  try {
    h5::Handle group = h5::group_handle(H5Gcreate2(impl.modules.get(), module.module.c_str(),
                                                   H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                                        "creating module group", where);
    for (const auto& [key, value] : module.attributes) {
      h5::write_string_attribute(group.get(), key, value, where);
    }
    impl.module_entries.push_back(
        NamedAttributes{module.module, "", {module.attributes.begin(), module.attributes.end()}});
  } catch (const IoError&) {
    impl.broken = true;
    throw;
  }
}

fs::path StepWriter::commit() {
  Impl& impl = *impl_;
  impl.ensure_usable("commit");
  const std::string where = impl.partial_path.string();
  try {
    impl.write_index();
    write_metrics_table(impl.file.get(), impl.index, impl.metrics, where);
    h5::Lock lock(h5::hdf5_mutex());
    impl.module_groups.clear();
    impl.tensors.close(where);
    impl.graphs.close(where);
    impl.modules.close(where);
    impl.file.close(where);
  } catch (...) {
    impl.broken = true;
    throw;
  }
  fsync_path(impl.partial_path, where, /*drop_cached=*/true);
  rename_no_replace(impl.partial_path, impl.final_path, where);
  fsync_path(impl.final_path.parent_path(), where);
  impl.committed = true;
  return impl.final_path;
}

std::int64_t StepWriter::step() const { return impl_->step; }
const fs::path& StepWriter::partial_path() const { return impl_->partial_path; }

}  // namespace dynaprobe::formats

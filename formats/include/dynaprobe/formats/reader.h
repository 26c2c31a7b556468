// Reads dumps: the index of a step file without touching tensor data, and tensors streamed chunk
// by chunk with parallel decompression (a stored tensor and its stream: stored_tensor.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dynaprobe/formats/metrics.h"
#include "dynaprobe/formats/record.h"
#include "dynaprobe/formats/stored_tensor.h"

namespace dynaprobe::formats {

namespace h5 {
class Lock;
}

// A batch of opens and fetches on this thread with formats' HDF5 lock taken once: the HDF5
// library runs behind one global lock, and many small reads (a model's small records) pay for
// taking it per call. Other threads' reads wait until the batch ends; reads inside it work as
// usual (the lock is recursive).
class ReadBatch {
 public:
  ReadBatch();
  ~ReadBatch();
  ReadBatch(const ReadBatch&) = delete;
  ReadBatch& operator=(const ReadBatch&) = delete;

 private:
  std::unique_ptr<h5::Lock> lock_;
};

// `data` is valid during the call only.
using ChunkConsumer = std::function<void(ChunkExtent extent, const std::byte* data)>;

enum class ChunkOrder {
  kInOrder,   // the consumer is called in element order, from one thread at a time
  kAnyOrder,  // the consumer is called as chunks are decoded, from several threads at once
};

// Streams a whole tensor through `consumer`, fetching serially and decoding ahead in parallel;
// memory stays O(threads × chunk). kAnyOrder suits consumers that place each chunk by its extent
// (copying into a whole tensor), which then run in parallel too.
void stream_chunks(const TensorStream& stream, const ChunkConsumer& consumer,
                   ChunkOrder order = ChunkOrder::kInOrder);

// A step still being written by the capture's background thread, as the capture already knows
// it once every record is judged: its index, the metrics judged in memory and its modules, which
// are all a comparison reads when every pair was judged in memory (PrecisionChecker.collect()
// reports before the step's tensors reach the disk).
struct PendingStep {
  std::filesystem::path file;  // where the step is being committed
  std::int64_t step = 0;
  Provenance provenance;
  std::vector<RecordInfo> records;     // in index order; chunk locations unknown
  std::vector<StoredMetrics> metrics;  // in the order written
  std::vector<ModuleInfo> modules;     // in the order written
  // The bytes of records small enough to keep (the loss), so that reading them needs no file.
  std::map<RecordKey, std::vector<std::byte>> small_tensors;
  // Returns once `file` is committed; throws why it never will be.
  std::function<void()> wait_committed;
};

class StepReader {
 public:
  // Opens a step file and reads its attributes and index. Throws IoError if it cannot be opened,
  // FormatError if it is not a dynaprobe step file or its format version is newer.
  explicit StepReader(const std::filesystem::path& file);
  // A pending step: served from memory; graphs(), open() and read() of a tensor not kept in
  // memory wait for the commit (PendingStep::wait_committed) and read the committed file.
  explicit StepReader(PendingStep pending);
  ~StepReader();
  StepReader(StepReader&&) noexcept;
  StepReader& operator=(StepReader&&) noexcept;

  // The accessors that return a reference into the reader return a copy when the reader is a
  // temporary: `for (auto& m : StepReader(file).stored_metrics())` would otherwise iterate over
  // a vector destroyed with the reader before the loop's first step.
  const std::filesystem::path& path() const&;
  std::filesystem::path path() &&;
  std::int64_t step() const;
  const std::string& format_version() const&;
  std::string format_version() &&;
  const Provenance& provenance() const&;
  Provenance provenance() &&;
  const std::vector<RecordInfo>& records() const&;
  std::vector<RecordInfo> records() &&;
  // Index rows this reader cannot interpret (a kind, side or dtype added by a newer minor
  // version of the format), described for a warning; records() leaves them out.
  const std::vector<std::string>& skipped_records() const&;
  std::vector<std::string> skipped_records() &&;
  // nullptr when the file has no such record.
  const RecordInfo* find(const RecordKey& key) const;
  // The metrics the capture computed in memory (format 1.3), in the order written; checked
  // against their checksum when the file is opened.
  const std::vector<StoredMetrics>& stored_metrics() const&;
  std::vector<StoredMetrics> stored_metrics() &&;
  // The stored metrics of the pair whose key is `key`; nullptr when none were stored.
  const StoredMetrics* find_metrics(const RecordKey& key) const;
  std::vector<Graph> graphs() const;
  // In the order they were written.
  std::vector<ModuleInfo> modules() const;

  // A pending step: waits for its commit and opens the committed file, so that open() and read()
  // wait no more (nothing for a committed step). Call it before taking the HDF5 lock for reads
  // (ReadBatch): the background writer needs that lock to finish the commit waited for.
  void wait_readable() const;
  // Throws FormatError when the dataset is missing or disagrees with the index or its dtype.
  TensorStream open(const RecordInfo& record) const;
  std::vector<std::byte> read(const RecordInfo& record) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Opens any HDF5 dataset as a tensor: the dtype comes from its "dtype" attribute if present,
// else from its HDF5 type. For files written by other tools.
TensorStream open_dataset(const std::filesystem::path& file, const std::string& dataset);

// The step files of one dump (one run and rank): `dump` is a rank folder or a single step file.
struct DumpFiles {
  std::vector<std::filesystem::path> steps;       // committed, in step order
  std::vector<std::filesystem::path> unfinished;  // .partial files: steps in progress at a crash
};
DumpFiles list_dump(const std::filesystem::path& dump);

// Called with a file's path each time a reader opens it (StepReader, a record's dataset,
// open_dataset), on the opening thread, before HDF5 parses anything of it. The dynaprobe CLI uses
// it to name the file being read when HDF5 crashes or hangs on a damaged one. Set it before
// reading starts; nullptr (the default): none. The observer must be thread-safe.
using OpenObserver = void (*)(const std::filesystem::path& file);
void set_open_observer(OpenObserver observer);

}  // namespace dynaprobe::formats

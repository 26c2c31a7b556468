// Writes one step of a dump: the records of one (run, rank, step) in one HDF5 file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/metrics.h"
#include "dynaprobe/formats/record.h"

namespace dynaprobe::formats {

struct WriterOptions {
  int zstd_level = kDefaultZstdLevel;  // negative levels are zstd's fast modes
  std::size_t chunk_bytes = 1 << 20;   // target uncompressed bytes per chunk (HDF5 chunk size)
  // A chunk is stored compressed only if zstd shrinks it by this factor (judged first from a
  // sample of it), else as it is. Compression that saves little costs more than it saves: zstd
  // takes ~0.5 ms of CPU per MiB of float32 activations at the default level (~1 ms at level 1),
  // which it shrinks by ~16%, and reading them back pays decompression on top. 1.0: whenever it
  // shrinks at all.
  double min_compression_ratio = 1.25;
  int threads = 0;  // compression threads; 0: TBB's default (all cores)
  // Scheduling niceness of the threads compressing and writing (0: unchanged). A capture running
  // beside training sets it, so that the training threads keep the cores and the writing fills
  // the gaps; the threads get their own niceness back when they leave the writer.
  int nice = 0;
  // Make the dump folder when it does not exist. A capture makes it once, with its lock
  // (DumpLock), and turns this off: a folder removed during the run is not made again behind
  // the user's back (its steps are then not stored).
  bool create_folder = true;
};

// Crash safety: the step is written to "<dir>/step_<N>.h5.partial" and only commit() flushes,
// fsyncs and renames it to "step_<N>.h5". A process killed mid-step leaves the committed steps
// untouched and at most one .partial file, which readers list as unfinished and skip.
//
// Not thread-safe: one thread drives a writer (compression inside write() is parallel).
class StepWriter {
 public:
  // Creates `dump_dir` if needed. Throws IoError when the file cannot be created.
  StepWriter(const std::filesystem::path& dump_dir, std::int64_t step, Provenance provenance,
             WriterOptions options = {});
  ~StepWriter();  // without commit(): closes and removes the partial file
  StepWriter(const StepWriter&) = delete;
  StepWriter& operator=(const StepWriter&) = delete;

  // Compresses (in parallel) and writes the records; the caller may free their data afterwards.
  // A record with the same dtype, shape and bytes as another of this call (or as an earlier
  // call's record stored uncompressed in one chunk) becomes a hard link to that dataset.
  // Throws UsageError for a bad key (duplicate, other step, bad module path) and IoError when
  // writing fails (disk full); after an error the writer is broken and commit() throws.
  void write(std::span<const Record> records);
  void write(const Record& record) { write(std::span<const Record>(&record, 1)); }
  // Index rows for records whose tensors are not stored (PrecisionChecker(dump="failing" or
  // "stats")): their key, label, dtype and shape; readers see RecordInfo::stored false. `data`
  // is not read. The same key rules as write().
  void describe(std::span<const Record> records);
  // Metrics computed at capture, kept for commit(), which writes them to /metrics; each key must
  // be in the index by then (UsageError otherwise).
  void write_metrics(std::span<const StoredMetrics> metrics);
  void write_graph(const Graph& graph);
  void write_module(const ModuleInfo& module);

  // Writes the index, closes, fsyncs and atomically renames the file. Returns the final path.
  std::filesystem::path commit();

  std::int64_t step() const;
  const std::filesystem::path& partial_path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dynaprobe::formats

// The POSIX side of writing a step file: the crash-safe commit's steps (docs/dump-format.md,
// Crash safety) and streaming the file to the disk and out of the page cache while it is written.
// Private to formats; StepWriter (writer.cpp) uses them.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <filesystem>
#include <string>

namespace dynaprobe::formats {

// A step is written to a new file only. A regular file left at the .partial name by a writer
// that died is removed (unlink removes a name, never what a link points to); anything else there
// (a symbolic link, a folder) is refused with IoError: nothing is ever written outside the dump
// folder.
void prepare_partial_path(const std::filesystem::path& partial);

// fsyncs `path` (IoError naming `where`, the step being committed, when it fails); with
// `drop_cached`, its pages then leave the page cache (a step file: see WritebackStream).
void fsync_path(const std::filesystem::path& path, const std::string& where,
                bool drop_cached = false);

// Commits by renaming, without ever replacing what is at the final name (a committed step, or a
// link planted there): renameat2(RENAME_NOREPLACE), or link + unlink where the file system lacks
// it. Both fail with EEXIST instead of replacing (IoError).
void rename_no_replace(const std::filesystem::path& from, const std::filesystem::path& to,
                       const std::string& where);

// Streams a file to the disk as it is written, and out of the page cache, a window of
// kWindowBytes at a time (stream()). The disk writes the step while later chunks still compress,
// so commit()'s fsync waits for the tail only, not the whole step (here 30 ms per 90 MB: 20% of a
// 256 MiB step's time).
class WritebackStream {
 public:
  static constexpr std::size_t kWindowBytes = 16 << 20;

  // Counts bytes handed to the file since the last stream().
  void wrote(std::size_t bytes) { unsynced_bytes_ += bytes; }
  bool due() const { return unsynced_bytes_ >= kWindowBytes; }
  // Starts the writeback of what `fd` (the file `file`; -1: none) got since the last call, waits
  // for the writeback the call before started and drops those pages. Throws IoError when that
  // writeback failed. Call it outside HDF5's lock: it waits for the disk.
  void stream(int fd, const std::filesystem::path& file);

 private:
  std::size_t unsynced_bytes_ = 0;
  off_t writeback_started_until_ = 0;  // file bytes whose writeback stream() started
  off_t dropped_until_ = 0;            // file bytes it has written back and dropped
};

}  // namespace dynaprobe::formats

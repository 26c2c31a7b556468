// The HDF5 file driver the StepWriter writes through: HDF5's POSIX driver (sec2), except that a
// page-aligned write of raw data (a stored chunk) sends its whole pages to the disk with O_DIRECT,
// past the page cache, and only the rest of its last page through the cache. The files are plain
// HDF5 files (no driver information in the superblock); readers open them with the default driver.
//
// Why: a step's tensors are written once and not read back by the process that wrote them. A
// buffered write copies every byte into the page cache (on this project's machines the largest
// CPU cost of writing a step, docs/performance.md, Scale); a direct write hands the pages to the
// disk as they are.
//
// The direct writes are asynchronous (Linux's io_submit): the disk writes a chunk while the next
// ones compress, and wait_for_direct_writes says when they are done, and how they failed. Made
// synchronously by the writer's stage that hands chunks to HDF5, each would stall compression
// (docs/performance.md, Dump format); made by a thread of the file's own, each would wake it.
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <string>

namespace dynaprobe::formats::h5 {

// Writes bigger than this are aligned to kDirectAlignment in the file (H5Pset_alignment), so
// that the chunks of a step qualify for direct writes.
inline constexpr hsize_t kDirectThreshold = 64 * 1024;
inline constexpr std::size_t kDirectAlignment = 4096;

// The driver's HDF5 identifier, registered on first use. Needs hdf5_mutex().
hid_t direct_writes_driver();

// Sets `fapl` to the direct-write driver with its alignment. Where O_DIRECT is not available
// (tmpfs, some network file systems) the driver writes everything through the page cache.
// Needs hdf5_mutex().
void use_direct_writes(hid_t fapl);

// At most this many bytes of a file's direct writes in flight are copies (kQueuedCopyBytes; more
// waits for the disk), and at most kQueuedWrites writes are in flight in all.
inline constexpr std::size_t kQueuedCopyBytes = std::size_t{8} << 20;
inline constexpr std::size_t kQueuedWrites = 16;

// Waits until the disk has every direct write queued for the file the driver opened as `fd`
// (h5::file_descriptor; nothing to wait for on other files). Throws IoError naming `where` when
// one of them failed (ENOSPC, EFBIG, EIO); the file's later direct writes then fail too, and so
// does closing it. Call it outside HDF5's lock: it waits for the disk. Thread-safe.
void wait_for_direct_writes(int fd, const std::string& where);

// While one lives, a direct write of raw data made on this thread from `data` (the buffer of the
// H5Dwrite_chunk it wraps) is queued as it is, without a copy: the caller guarantees that `data`
// keeps its bytes until wait_for_direct_writes() returns for the file, or the file is closed.
// Any other write is copied into memory of the driver's before it is queued.
class BorrowedPayload {
 public:
  explicit BorrowedPayload(const void* data);
  ~BorrowedPayload();
  BorrowedPayload(const BorrowedPayload&) = delete;
  BorrowedPayload& operator=(const BorrowedPayload&) = delete;

 private:
  const void* previous_;
};

}  // namespace dynaprobe::formats::h5

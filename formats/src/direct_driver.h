// The HDF5 file driver the StepWriter writes through: HDF5's POSIX driver (sec2), except that a
// page-aligned write of raw data (a stored chunk) sends its whole pages to the disk with O_DIRECT,
// past the page cache, and only the rest of its last page through the cache. The files are plain
// HDF5 files (no driver information in the superblock); readers open them with the default driver.
//
// Why: a step's tensors are written once and not read back by the process that wrote them. A
// buffered write copies every byte into the page cache (on this project's machines the largest
// CPU cost of writing a step, docs/performance.md, Scale); a direct write hands the pages to the
// disk as they are.
#pragma once

#include <hdf5.h>

#include <cstddef>

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

}  // namespace dynaprobe::formats::h5

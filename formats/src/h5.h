// Checked, RAII access to the HDF5 C API. Every call that can fail goes through check(), which
// turns the HDF5 error stack into an exception naming the file or object. The HDF5 library is
// thread-safe only behind one global lock, so every use of it holds hdf5_mutex().
// Private to formats (tests and benchmarks of formats' internals add formats/src to their include
// path): other folders ask formats for steps, records and chunks, never for HDF5 handles.
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dynaprobe/formats/error.h"

namespace dynaprobe::formats::h5 {

// Held around every sequence of HDF5 calls. Recursive so helpers can nest.
std::recursive_mutex& hdf5_mutex();

// Holds hdf5_mutex(). A thread-safe HDF5 keeps its error-printing setting per thread, so the first
// Lock on each thread also silences HDF5's own printing there (errors go into exceptions).
class Lock {
 public:
  explicit Lock(std::recursive_mutex& mutex);
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

 private:
  std::lock_guard<std::recursive_mutex> guard_;
};

// Silences HDF5's own printing of error stacks (we report them in exceptions) and registers the
// zstd filter. Idempotent and thread-safe; every entry point of formats calls it.
void init();

// The current HDF5 error stack as text, one frame per line ("H5Dcreate2(): unable to ...").
std::string error_stack();

// Throws E with "<what> (<where>): <HDF5 error stack>" when `status` is negative.
template <typename E = IoError, typename T>
T check(T status, std::string_view what, std::string_view where) {
  if (status < 0) {
    throw E(std::string(what) + " (" + std::string(where) + "): " + error_stack());
  }
  return status;
}

// Owns one HDF5 identifier and closes it with the matching H5?close function.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(Handle&& other) noexcept : id_(other.id_), closer_(other.closer_) { other.id_ = -1; }
  Handle& operator=(Handle&& other) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset();
  // Closes now and reports a failure (closing a file flushes it, which can fail on a full disk).
  void close(std::string_view where);

 private:
  hid_t id_ = -1;
  Closer closer_ = nullptr;
};

Handle file_handle(hid_t id, std::string_view what, std::string_view where);
Handle group_handle(hid_t id, std::string_view what, std::string_view where);
Handle dataset_handle(hid_t id, std::string_view what, std::string_view where);
Handle space_handle(hid_t id, std::string_view what, std::string_view where);
Handle type_handle(hid_t id, std::string_view what, std::string_view where);
Handle plist_handle(hid_t id, std::string_view what, std::string_view where);
Handle attribute_handle(hid_t id, std::string_view what, std::string_view where);

// The variable-length UTF-8 string type (attributes, graph text, /index fields), made once and
// owned by formats; do not close it. Callers hold the HDF5 lock.
hid_t string_type(std::string_view where);

// The group at `path` if the file has one (older or other files may lack optional groups).
std::optional<Handle> open_group_if_present(hid_t file, const std::string& path,
                                            std::string_view where);

// The POSIX file descriptor of a file opened through HDF5's default (sec2) driver or the writer's
// (direct_driver.h), or -1. It lives as long as the file is open; pread/pwrite on it need no HDF5
// lock.
int file_descriptor(hid_t file);

// Reads exactly `size` bytes at `offset` of `fd` (retrying short reads); false if it cannot.
bool read_at(int fd, std::byte* data, std::size_t size, std::uint64_t offset);

// Where the chunk at the origin of a chunked dataset of rank `rank` lies in its file (HDF5's
// H5Dget_chunk_info_by_coord), if it is written. Callers hold the HDF5 lock.
struct ChunkLocation {
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
  unsigned filter_mask = 0;
};
std::optional<ChunkLocation> first_chunk_location(hid_t dataset, std::size_t rank);

// A fixed-length UTF-8 string type of `size` bytes (at least 1), padded with NULs (format 2.0:
// strings that live in the object header or a dataset, never in HDF5's global heap).
Handle fixed_string_type(std::size_t size, std::string_view where);

// Scalar string attributes. Written as fixed-length UTF-8 (format 2.0; h5py reads bytes). Read in
// either form; `allow_variable` false (format 2.0 files) refuses a variable-length one with a
// FormatError instead of reading HDF5's global heap.
void write_string_attribute(hid_t object, std::string_view name, std::string_view value,
                            std::string_view where);
std::string read_string_attribute(hid_t object, std::string_view name, std::string_view where,
                                  bool allow_variable = true);
// A fixed-length string held in a byte buffer: up to its first NUL.
std::string fixed_string(const char* data, std::size_t size);
bool has_attribute(hid_t object, std::string_view name);
// Scalar uint64 attributes (the checksums). The reader throws FormatError, naming `what`, when
// the attribute is missing or not one number.
void write_u64_attribute(hid_t object, std::string_view name, std::uint64_t value,
                         std::string_view where);
std::uint64_t read_u64_attribute(hid_t object, std::string_view name, std::string_view what,
                                 std::string_view where);

// Names of an object's attributes (by name), and of a group's links (by name, or by creation order
// where the group tracks it). Listing first and reading afterwards keeps C++ exceptions out of
// HDF5's C callbacks.
std::vector<std::string> attribute_names(hid_t object, std::string_view where);
std::vector<std::string> link_names(hid_t group, bool creation_order, std::string_view where);

}  // namespace dynaprobe::formats::h5

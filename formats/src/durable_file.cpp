// The POSIX side of writing a step file (durable_file.h).
#include "durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>  // renameat2, RENAME_NOREPLACE (glibc >= 2.28)
#include <cstring>

#include "dynaprobe/formats/error.h"

namespace dynaprobe::formats {
namespace fs = std::filesystem;
namespace {

// Tells the kernel that `size` bytes of the file at `offset` (0: to its end) will not be read
// soon: their clean pages leave the page cache. Advice only: nothing is lost when it fails.
void drop_from_page_cache(int fd, off_t offset, off_t size) {
  ::posix_fadvise(fd, offset, size, POSIX_FADV_DONTNEED);
}

}  // namespace

void fsync_path(const fs::path& path, const std::string& where, bool drop_cached) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const std::string reason = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    throw IoError("fsync of " + path.string() + " failed while committing " + where + ": " +
                  reason);
  }
  if (drop_cached) drop_from_page_cache(fd, 0, 0);
  ::close(fd);
}

void prepare_partial_path(const fs::path& partial) {
  struct stat info {};
  if (::lstat(partial.c_str(), &info) != 0) {
    if (errno == ENOENT) return;
    throw IoError("cannot inspect " + partial.string() + ": " + std::strerror(errno));
  }
  if (S_ISLNK(info.st_mode) || !S_ISREG(info.st_mode)) {
    throw IoError(partial.string() + " exists and is " +
                  (S_ISLNK(info.st_mode) ? "a symbolic link" : "not a regular file") +
                  "; dynaprobe never writes through links or over other files in a dump folder: "
                  "remove it, or write to a new folder");
  }
  if (::unlink(partial.c_str()) != 0 && errno != ENOENT) {
    throw IoError("cannot remove the unfinished step " + partial.string() + ": " +
                  std::strerror(errno));
  }
}

void rename_no_replace(const fs::path& from, const fs::path& to, const std::string& where) {
  int result = -1;
#if defined(__linux__) && defined(RENAME_NOREPLACE)
  result = ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE);
  if (result != 0 && errno != EINVAL && errno != ENOSYS) {
    throw IoError("cannot rename " + where + " to " + to.string() + ": " + std::strerror(errno));
  }
#endif
  if (result != 0) {
    if (::link(from.c_str(), to.c_str()) != 0 || ::unlink(from.c_str()) != 0) {
      throw IoError("cannot rename " + where + " to " + to.string() + ": " + std::strerror(errno));
    }
  }
}

// Streams the file to disk as it is written, and out of the page cache: starts the writeback of
// what was written since the last call, waits for the writeback the call before started (most
// of it done by then, unless the disk is slower than the writer) and drops those pages from the
// page cache. Chunks the file driver wrote with O_DIRECT (direct_driver.h) were never cached:
// this covers the rest, and every write where the file system refuses O_DIRECT. A dump is
// written once and read later, if ever: kept cached, a run's steps would fill the host's memory
// with dirty and then clean pages, evict what training reads (its dataset), and every new page the
// next step writes would be memory the kernel must find first. Streaming keeps the writer's pages
// to two windows of kWindowBytes, reused step after step; on this machine kind that wrote 1.6 GB/s
// steadily against 0.4 GB/s once earlier steps filled the cache (docs/performance.md, Scale). Pages
// that HDF5 writes again later (its metadata) are read back first: correct, and rare. A writeback
// error throws here: the wait would consume it, and commit()'s fsync would no longer see it.
void WritebackStream::stream(int fd, const fs::path& file) {
  unsynced_bytes_ = 0;
#if defined(__linux__)
  if (fd < 0) return;
  // HDF5's sec2 driver writes with pwrite: the file's size is as far as it has written.
  struct stat info {};
  if (::fstat(fd, &info) != 0) return;
  if (writeback_started_until_ > dropped_until_) {
    const off_t size = writeback_started_until_ - dropped_until_;
    if (::sync_file_range(fd, dropped_until_, size,
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                              SYNC_FILE_RANGE_WAIT_AFTER) != 0 &&
        errno != ESPIPE && errno != EINVAL) {  // not a file the kernel writes back
      throw IoError("writing " + file.string() + " to disk failed: " + std::strerror(errno));
    }
    drop_from_page_cache(fd, dropped_until_, size);
    dropped_until_ = writeback_started_until_;
  }
  if (info.st_size > writeback_started_until_) {
    ::sync_file_range(fd, writeback_started_until_, info.st_size - writeback_started_until_,
                      SYNC_FILE_RANGE_WRITE);  // errors: the wait above or commit()'s fsync
    writeback_started_until_ = info.st_size;
  }
#endif
}

}  // namespace dynaprobe::formats

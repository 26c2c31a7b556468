#include "direct_driver.h"

#include <fcntl.h>
#include <linux/aio_abi.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "h5.h"

namespace dynaprobe::formats::h5 {
namespace {

constexpr std::size_t kBounceBytes = std::size_t{1} << 20;
constexpr haddr_t kMaxAddress = (haddr_t{1} << 62) - 1;

// Writes all of `size` bytes at `offset`; false with errno set on failure.
bool write_all(int fd, const void* data, std::size_t size, off_t offset) {
  const auto* bytes = static_cast<const std::byte*>(data);
  while (size > 0) {
    const ssize_t written = ::pwrite(fd, bytes, size, offset);
    if (written < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (written == 0) {
      errno = EIO;
      return false;
    }
    bytes += written;
    size -= static_cast<std::size_t>(written);
    offset += written;
  }
  return true;
}

// Aligned kBounceBytes buffers for copies of queued writes, kept from file to file (a step file
// is opened per step; fresh buffers would be mapped and page-faulted every time).
class CopyBuffers {
 public:
  void* take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        void* buffer = free_.back();
        free_.pop_back();
        return buffer;
      }
    }
    return std::aligned_alloc(h5::kDirectAlignment, kBounceBytes);
  }
  void give_back(void* buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(buffer);  // at most kQueuedCopyBytes / kBounceBytes per file writing at once
  }

 private:
  std::mutex mutex_;
  std::vector<void*> free_;
};

CopyBuffers& copy_buffers() {
  static auto* buffers =
      new CopyBuffers;  // never destroyed: a queue may outlive static destructors
  return *buffers;
}

// Asynchronous I/O contexts, kept from file to file: io_destroy waits for the kernel's RCU grace
// period (40 ms here, on every step's commit).
class AioContexts {
 public:
  // A context for kQueuedWrites writes in flight; 0 where the kernel has none to give.
  aio_context_t take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (owner_ != ::getpid()) {  // a forked child: its parent's contexts are not its own
        free_.clear();
        owner_ = ::getpid();
      }
      if (!free_.empty()) {
        const aio_context_t context = free_.back();
        free_.pop_back();
        return context;
      }
    }
    aio_context_t context = 0;
    return ::syscall(SYS_io_setup, kQueuedWrites, &context) == 0 ? context : 0;
  }
  // Gives back a context with no write in flight.
  void give_back(aio_context_t context) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (owner_ == ::getpid()) free_.push_back(context);  // at most one per file writing at once
  }

 private:
  std::mutex mutex_;
  pid_t owner_ = ::getpid();  // the process whose contexts free_ holds
  std::vector<aio_context_t> free_;
};

AioContexts& aio_contexts() {
  static auto* contexts = new AioContexts;  // never destroyed: the process's end frees them
  return *contexts;
}

// The first direct write of a file that failed.
struct WriteFailure {
  int error = 0;
  std::size_t size = 0;
  off_t offset = 0;
  // What failed, as the driver reports any write that fails (push_error adds the reason).
  std::string what() const {
    return "cannot write " + std::to_string(size) + " bytes at offset " + std::to_string(offset);
  }
};

// The direct writes of one file in flight: submitted with Linux's native asynchronous I/O
// (io_submit), so that the caller (HDF5's write callback, under HDF5's lock) returns while the
// disk writes, with no thread to wake per chunk. Bounded: at most kQueuedWrites writes and
// kQueuedCopyBytes of copies in flight; push() waits for the disk beyond that. After a write fails,
// the later ones are dropped and push() and wait() report the failure.
//
// A direct write that extends the file is carried out inside io_submit (the file system updates
// the file's size first), so the file's size is reserved ahead of the writes, kReserveBytes at a
// time, by ftruncate (a hole: no disk space); truncate_file() gives the file its true size.
// Where asynchronous I/O is unavailable (io_setup fails), each write is made at once.
class WriteQueue {
 public:
  WriteQueue(int fd, int direct_fd, off_t size) : fd_(fd), direct_fd_(direct_fd), size_(size) {}
  ~WriteQueue() {
    wait();
    if (context_ != 0) aio_contexts().give_back(context_);
  }
  WriteQueue(const WriteQueue&) = delete;
  WriteQueue& operator=(const WriteQueue&) = delete;

  // Submits `size` bytes for `offset`: a page-aligned `data` that `borrowed` as it is, anything
  // else copied piece by piece. The failure of this or an earlier write, if any, instead.
  std::optional<WriteFailure> push(const void* data, std::size_t size, off_t offset,
                                   bool borrowed) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) reserve(offset, size);
    if (failure_) return failure_;
    if (borrowed) {
      submit({data, size, offset, nullptr});
      return failure_;
    }
    const auto* bytes = static_cast<const std::byte*>(data);
    for (std::size_t done = 0; done < size && !failure_; done += kBounceBytes) {
      while (!failure_ && copies_ == kMaxCopies) reap(1);
      if (failure_) break;
      const std::size_t piece = std::min(kBounceBytes, size - done);
      void* copy = copy_buffers().take();
      if (!copy) {
        failure_ = WriteFailure{ENOMEM, piece, offset + static_cast<off_t>(done)};
        break;
      }
      std::memcpy(copy, bytes + done, piece);
      ++copies_;
      submit({copy, piece, offset + static_cast<off_t>(done), copy});
    }
    return failure_;
  }

  // Waits until every write in flight is done; their first failure, if any.
  std::optional<WriteFailure> wait() {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!in_flight_.empty()) reap(1);
    return failure_;
  }

  // Waits until no write in flight touches [offset, offset + size): HDF5 reads only what the
  // disk has (rarely raw data in a file it writes; never an unwritten chunk's bytes in dynaprobe's
  // use).
  void wait_for_range(off_t offset, std::size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto overlaps = [&](const auto& entry) {
      const Request& r = entry.second->request;
      return r.offset < offset + static_cast<off_t>(size) &&
             offset < r.offset + static_cast<off_t>(r.size);
    };
    while (std::any_of(in_flight_.begin(), in_flight_.end(), overlaps)) reap(1);
  }

  // Whether the file system refused O_DIRECT (EINVAL): the queue then writes through the page
  // cache, and the driver need not queue at all.
  bool direct_refused() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return direct_refused_;
  }

  // The size reserve() gave the file ahead of its writes (0: none since the last truncated()).
  off_t reserved_size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reserved_;
  }

  // The file was truncated to `size` (truncate_file(), once every write is done).
  void truncated(off_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_ = size;
    reserved_ = 0;
  }

 private:
  static constexpr std::size_t kMaxCopies = kQueuedCopyBytes / kBounceBytes;
  static constexpr off_t kReserveBytes = off_t{64} << 20;
  struct Request {
    const void* data;
    std::size_t size;
    off_t offset;
    void* copy;  // the copy's buffer, given back once written; nullptr for borrowed bytes
  };
  struct InFlight {
    Request request;
    iocb control{};
  };

  // Gives the file at least the bytes that a write of `size` bytes at `offset` needs, never fewer
  // than it has (HDF5 writes its metadata through the page cache, past the last direct write).
  void reserve(off_t offset, std::size_t size) {
    const off_t end = offset + static_cast<off_t>(size);
    if (end <= size_) return;
    struct stat status {};
    if (::fstat(fd_, &status) == 0 && status.st_size >= end) {
      size_ = status.st_size;
      return;
    }
    const off_t rounded = (end + kReserveBytes - 1) / kReserveBytes * kReserveBytes;
    if (::ftruncate(fd_, rounded) == 0) {
      size_ = reserved_ = rounded;
    } else if (::ftruncate(fd_, end) == 0) {  // past a file-size limit the exact end may fit
      size_ = reserved_ = end;
    } else {
      failure_ = WriteFailure{errno, size, offset};
    }
  }

  // Writes `request` now, directly or, where the file system refuses that, through the page
  // cache; its failure, if any, becomes the queue's.
  void write_now(const Request& request) {
    bool written =
        !direct_refused_ && write_all(direct_fd_, request.data, request.size, request.offset);
    if (!written && !direct_refused_ && errno == EINVAL) direct_refused_ = true;
    if (!written && direct_refused_) {
      written = write_all(fd_, request.data, request.size, request.offset);
    }
    if (!written && !failure_) failure_ = WriteFailure{errno, request.size, request.offset};
  }

  void submit(const Request& request) {
    if (failure_) return release(request);
    if (context_ == 0 && !aio_unavailable_) {
      context_ = aio_contexts().take();
      aio_unavailable_ = context_ == 0;
    }
    if (aio_unavailable_ || direct_refused_) {
      write_now(request);
      return release(request);
    }
    while (in_flight_.size() == kQueuedWrites) reap(1);
    auto entry = std::make_unique<InFlight>();
    entry->request = request;
    iocb& control = entry->control;
    control.aio_lio_opcode = IOCB_CMD_PWRITE;
    control.aio_fildes = static_cast<std::uint32_t>(direct_fd_);
    control.aio_buf = reinterpret_cast<std::uint64_t>(request.data);
    control.aio_nbytes = request.size;
    control.aio_offset = request.offset;
    control.aio_data = reinterpret_cast<std::uint64_t>(entry.get());
    iocb* controls[] = {&control};
    while (true) {
      if (::syscall(SYS_io_submit, context_, 1, controls) == 1) {
        in_flight_.emplace(entry.get(), std::move(entry));
        return;
      }
      if (errno == EAGAIN && !in_flight_.empty()) {  // the kernel's queue is full: make room
        reap(1);
        continue;
      }
      if (errno == EINTR) continue;
      write_now(request);  // refused at submission (EINVAL: O_DIRECT; EAGAIN): write it now
      return release(request);
    }
  }

  // Waits for at least `minimum` writes in flight to complete and settles them: a short write's
  // rest is written now, a failed one's error kept (EINVAL: O_DIRECT refused after all, written
  // through the page cache).
  void reap(long minimum) {
    io_event events[kQueuedWrites];
    const long got = ::syscall(SYS_io_getevents, context_, minimum, kQueuedWrites, events, nullptr);
    if (got < 0) {
      if (errno == EINTR) return;
      // Cannot happen with a valid context. The writes are given up for failed rather than
      // waited for forever; their copies are not reused (the disk may still read them).
      if (!failure_) failure_ = WriteFailure{errno, 0, 0};
      in_flight_.clear();
      return;
    }
    for (long i = 0; i < got; ++i) {
      auto* key = reinterpret_cast<InFlight*>(events[i].data);
      const auto found = in_flight_.find(key);
      if (found == in_flight_.end()) continue;
      const Request request = found->second->request;
      const long long result = events[i].res;
      if (result == -EINVAL && !failure_) {
        direct_refused_ = true;
        write_now(request);
      } else if (result < 0) {
        if (!failure_)
          failure_ = WriteFailure{static_cast<int>(-result), request.size, request.offset};
      } else if (static_cast<std::size_t>(result) < request.size && !failure_) {
        const auto done = static_cast<std::size_t>(result);
        if (!write_all(fd_, static_cast<const std::byte*>(request.data) + done, request.size - done,
                       request.offset + static_cast<off_t>(done))) {
          failure_ = WriteFailure{errno, request.size, request.offset};
        }
      }
      release(request);
      in_flight_.erase(found);
    }
  }

  void release(const Request& request) {
    if (!request.copy) return;
    copy_buffers().give_back(request.copy);
    --copies_;
  }

  const int fd_;
  const int direct_fd_;
  mutable std::mutex mutex_;
  aio_context_t context_ = 0;
  bool aio_unavailable_ = false;
  std::unordered_map<InFlight*, std::unique_ptr<InFlight>> in_flight_;
  std::size_t copies_ = 0;
  std::optional<WriteFailure> failure_;
  bool direct_refused_ = false;
  off_t size_ = 0;      // the file's size as far as this queue knows (its writes need no more)
  off_t reserved_ = 0;  // the size reserve() gave the file, 0 if none
};

// The queues of the files open for writing, by descriptor, for wait_for_direct_writes().
std::mutex queues_mutex;
std::map<int, std::shared_ptr<WriteQueue>>& queues() {
  static auto* by_fd = new std::map<int, std::shared_ptr<WriteQueue>>;
  return *by_fd;
}

// The buffer BorrowedPayload lends on this thread.
thread_local const void* borrowed_payload = nullptr;

// A file open through the driver. `pub` comes first: HDF5 passes &pub to the callbacks.
struct DirectFile {
  H5FD_t pub;
  int fd = -1;         // reads, and every write that is not direct
  int direct_fd = -1;  // the same file with O_DIRECT; -1 where the file system refuses it
  haddr_t eoa = 0;     // end of the address space HDF5 has allocated
  haddr_t eof = 0;     // end of the file as written
  dev_t device = 0;
  ino_t inode = 0;
  std::shared_ptr<WriteQueue> queue;  // the direct writes, when direct_fd is open
};

DirectFile* of(H5FD_t* file) { return reinterpret_cast<DirectFile*>(file); }
const DirectFile* of(const H5FD_t* file) { return reinterpret_cast<const DirectFile*>(file); }

// Pushes an error with errno's text onto HDF5's stack (h5::error_stack() reports it).
void push_error(const char* function, hid_t minor, const std::string& what, int error) {
  const std::string message = what + ": " + std::strerror(error);
  H5Epush2(H5E_DEFAULT, __FILE__, function, __LINE__, H5E_ERR_CLS, H5E_VFL, minor, "%s",
           message.c_str());
}

H5FD_t* open_file(const char* name, unsigned flags, hid_t, haddr_t) {
  int mode = (flags & H5F_ACC_RDWR) ? O_RDWR : O_RDONLY;
  if (flags & H5F_ACC_TRUNC) mode |= O_TRUNC;
  if (flags & H5F_ACC_CREAT) mode |= O_CREAT;
  if (flags & H5F_ACC_EXCL) mode |= O_EXCL;
  const int fd = ::open(name, mode | O_CLOEXEC, 0666);
  if (fd < 0) {
    push_error(__func__, H5E_CANTOPENFILE, std::string("cannot open ") + name, errno);
    return nullptr;
  }
  struct stat status {};
  if (::fstat(fd, &status) != 0) {
    push_error(__func__, H5E_CANTOPENFILE, std::string("cannot stat ") + name, errno);
    ::close(fd);
    return nullptr;
  }
  auto* file = new (std::nothrow) DirectFile{};
  if (!file) {
    ::close(fd);
    return nullptr;
  }
  file->fd = fd;
  file->eof = static_cast<haddr_t>(status.st_size);
  file->device = status.st_dev;
  file->inode = status.st_ino;
  if (flags & H5F_ACC_RDWR) {
    // The same open file again (not the name, which might meanwhile lead elsewhere), with
    // O_DIRECT; a file system without it refuses here, and every write is buffered.
    const std::string self = "/proc/self/fd/" + std::to_string(fd);
    file->direct_fd = ::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
    if (file->direct_fd >= 0) {
      file->queue = std::make_shared<WriteQueue>(fd, file->direct_fd, status.st_size);
      std::lock_guard<std::mutex> lock(queues_mutex);
      queues()[fd] = file->queue;
    }
  }
  return &file->pub;
}

// Waits for the file's queued direct writes: the failure of one of them, if any, pushed onto
// HDF5's error stack by `function`.
bool direct_writes_done(DirectFile& file, const char* function) {
  if (!file.queue) return true;
  if (const auto failure = file.queue->wait()) {
    push_error(function, H5E_WRITEERROR, failure->what(), failure->error);
    return false;
  }
  return true;
}

herr_t close_file(H5FD_t* handle) {
  DirectFile* file = of(handle);
  const bool written = direct_writes_done(*file, __func__);
  if (file->queue) {
    std::lock_guard<std::mutex> lock(queues_mutex);
    queues().erase(file->fd);
  }
  file->queue.reset();
  const int direct = file->direct_fd >= 0 ? ::close(file->direct_fd) : 0;
  const int error = direct != 0 ? errno : 0;
  const int buffered = ::close(file->fd);
  const int buffered_error = buffered != 0 ? errno : 0;
  delete file;
  if (direct != 0 || buffered != 0) {
    push_error(__func__, H5E_CANTCLOSEFILE, "cannot close the file",
               buffered != 0 ? buffered_error : error);
    return -1;
  }
  return written ? 0 : -1;
}

int compare_files(const H5FD_t* a, const H5FD_t* b) {
  const DirectFile* x = of(a);
  const DirectFile* y = of(b);
  if (x->device != y->device) return x->device < y->device ? -1 : 1;
  if (x->inode != y->inode) return x->inode < y->inode ? -1 : 1;
  return 0;
}

herr_t query(const H5FD_t*, unsigned long* flags) {
  // What sec2 offers: HDF5 aggregates and accumulates metadata and small raw data itself.
  if (flags) {
    *flags = H5FD_FEAT_AGGREGATE_METADATA | H5FD_FEAT_ACCUMULATE_METADATA | H5FD_FEAT_DATA_SIEVE |
             H5FD_FEAT_AGGREGATE_SMALLDATA | H5FD_FEAT_POSIX_COMPAT_HANDLE |
             H5FD_FEAT_DEFAULT_VFD_COMPATIBLE;
  }
  return 0;
}

haddr_t get_eoa(const H5FD_t* file, H5FD_mem_t) { return of(file)->eoa; }
herr_t set_eoa(H5FD_t* file, H5FD_mem_t, haddr_t address) {
  of(file)->eoa = address;
  return 0;
}
haddr_t get_eof(const H5FD_t* file, H5FD_mem_t) { return of(file)->eof; }

herr_t get_handle(H5FD_t* file, hid_t, void** handle) {
  *handle = &of(file)->fd;
  return 0;
}

herr_t read_file(H5FD_t* handle, H5FD_mem_t, hid_t, haddr_t address, size_t size, void* buffer) {
  DirectFile* file = of(handle);
  auto* bytes = static_cast<std::byte*>(buffer);
  auto offset = static_cast<off_t>(address);
  if (file->queue) file->queue->wait_for_range(offset, size);
  while (size > 0) {
    const ssize_t got = ::pread(file->fd, bytes, size, offset);
    if (got < 0) {
      if (errno == EINTR) continue;
      push_error(__func__, H5E_READERROR, "cannot read at offset " + std::to_string(offset), errno);
      return -1;
    }
    if (got == 0) {  // past the end of the file: zeros, as HDF5 expects
      std::memset(bytes, 0, size);
      break;
    }
    bytes += got;
    size -= static_cast<std::size_t>(got);
    offset += got;
  }
  return 0;
}

herr_t write_file(H5FD_t* handle, H5FD_mem_t type, hid_t, haddr_t address, size_t size,
                  const void* buffer) {
  DirectFile* file = of(handle);
  const auto offset = static_cast<off_t>(address);
  const auto write_error = [&] {
    push_error(
        __func__, H5E_WRITEERROR,
        "cannot write " + std::to_string(size) + " bytes at offset " + std::to_string(offset),
        errno);
    return -1;
  };
  // A chunk's whole pages go direct, the rest of its last page through the page cache: chunks
  // are rows of a tensor, rarely a whole number of pages (113 rows of 2,304 float32 are 254.25
  // pages), and the next chunk starts on a page of its own (H5Pset_alignment), so no page is
  // written both ways. The direct pages are queued (WriteQueue): the disk writes them while the
  // caller compresses the next chunks.
  std::size_t direct = 0;
  if (file->queue && type == H5FD_MEM_DRAW && address % kDirectAlignment == 0 &&
      !file->queue->direct_refused()) {
    direct = size - size % kDirectAlignment;
  }
  if (direct > 0) {
    const bool borrowed = buffer == borrowed_payload &&
                          reinterpret_cast<std::uintptr_t>(buffer) % kDirectAlignment == 0;
    std::optional<WriteFailure> failure;
    try {  // nothing may throw through HDF5
      failure = file->queue->push(buffer, direct, offset, borrowed);
    } catch (const std::exception&) {  // no memory for the queue
      failure = WriteFailure{ENOMEM, direct, offset};
    }
    if (failure) {
      // An earlier write's failure: the step is lost either way.
      push_error(__func__, H5E_WRITEERROR, failure->what(), failure->error);
      return -1;
    }
  }
  const auto* rest = static_cast<const std::byte*>(buffer) + direct;
  if (direct < size &&
      !write_all(file->fd, rest, size - direct, offset + static_cast<off_t>(direct))) {
    return write_error();
  }
  file->eof = std::max<haddr_t>(file->eof, address + size);
  return 0;
}

herr_t truncate_file(H5FD_t* handle, hid_t, hbool_t) {
  DirectFile* file = of(handle);
  if (!direct_writes_done(*file, __func__)) return -1;
  const off_t reserved = file->queue ? file->queue->reserved_size() : 0;
  if (file->eoa == file->eof && reserved <= static_cast<off_t>(file->eoa)) return 0;
  if (::ftruncate(file->fd, static_cast<off_t>(file->eoa)) != 0) {
    push_error(__func__, H5E_SEEKERROR, "cannot set the file's size", errno);
    return -1;
  }
  file->eof = file->eoa;
  if (file->queue) file->queue->truncated(static_cast<off_t>(file->eoa));
  return 0;
}

// HDF5's file lock, as sec2 takes it (HDF5 then also marks the superblock "open for write" on
// disk at once, which tells a reader handed a partial file that its writer never finished).
herr_t lock_file(H5FD_t* handle, hbool_t read_write) {
  if (::flock(of(handle)->fd, (read_write ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
    if (errno == ENOSYS) return 0;  // a file system without locks: as HDF5's own drivers do
    push_error(__func__, H5E_CANTLOCKFILE, "cannot lock the file", errno);
    return -1;
  }
  return 0;
}

herr_t unlock_file(H5FD_t* handle) {
  if (::flock(of(handle)->fd, LOCK_UN) != 0 && errno != ENOSYS) {
    push_error(__func__, H5E_CANTUNLOCKFILE, "cannot unlock the file", errno);
    return -1;
  }
  return 0;
}

const H5FD_class_t kDriver = {
    "dynaprobe_direct",    // name
    kMaxAddress,           // maxaddr
    H5F_CLOSE_WEAK,        // fc_degree
    nullptr,               // terminate
    nullptr,               // sb_size: no driver information in the superblock
    nullptr,               // sb_encode
    nullptr,               // sb_decode
    0,                     // fapl_size
    nullptr,               // fapl_get
    nullptr,               // fapl_copy
    nullptr,               // fapl_free
    0,                     // dxpl_size
    nullptr,               // dxpl_copy
    nullptr,               // dxpl_free
    open_file,             // open
    close_file,            // close
    compare_files,         // cmp
    query,                 // query
    nullptr,               // get_type_map
    nullptr,               // alloc
    nullptr,               // free
    get_eoa,               // get_eoa
    set_eoa,               // set_eoa
    get_eof,               // get_eof
    get_handle,            // get_handle
    read_file,             // read
    write_file,            // write
    nullptr,               // flush: every write is a system call already
    truncate_file,         // truncate
    lock_file,             // lock
    unlock_file,           // unlock
    H5FD_FLMAP_DICHOTOMY,  // fl_map
};

}  // namespace

hid_t direct_writes_driver() {
  static const hid_t driver = H5FDregister(&kDriver);
  return check(driver, "registering the direct-write file driver", "HDF5");
}

void wait_for_direct_writes(int fd, const std::string& where) {
  std::shared_ptr<WriteQueue> queue;
  {
    std::lock_guard<std::mutex> lock(queues_mutex);
    const auto found = queues().find(fd);
    if (found == queues().end()) return;
    queue = found->second;
  }
  if (const auto failure = queue->wait()) {
    throw IoError("writing " + where + " to disk failed: " + failure->what() + ": " +
                  std::strerror(failure->error));
  }
}

BorrowedPayload::BorrowedPayload(const void* data) : previous_(borrowed_payload) {
  borrowed_payload = data;
}
BorrowedPayload::~BorrowedPayload() { borrowed_payload = previous_; }

void use_direct_writes(hid_t fapl) {
  check(H5Pset_driver(fapl, direct_writes_driver(), nullptr),
        "setting the direct-write file driver", "HDF5");
  check(H5Pset_alignment(fapl, kDirectThreshold, kDirectAlignment), "setting the file's alignment",
        "HDF5");
}

}  // namespace dynaprobe::formats::h5

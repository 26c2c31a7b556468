#include "direct_driver.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "h5.h"

namespace dynaprobe::formats::h5 {
namespace {

// A file open through the driver. `pub` comes first: HDF5 passes &pub to the callbacks.
struct DirectFile {
  H5FD_t pub;
  int fd = -1;         // reads, and every write that is not direct
  int direct_fd = -1;  // the same file with O_DIRECT; -1 where the file system refuses it
  haddr_t eoa = 0;     // end of the address space HDF5 has allocated
  haddr_t eof = 0;     // end of the file as written
  dev_t device = 0;
  ino_t inode = 0;
  void* bounce = nullptr;  // kBounceBytes, aligned: direct writes of a buffer that is not
};

constexpr std::size_t kBounceBytes = std::size_t{1} << 20;
constexpr haddr_t kMaxAddress = (haddr_t{1} << 62) - 1;

DirectFile* of(H5FD_t* file) { return reinterpret_cast<DirectFile*>(file); }
const DirectFile* of(const H5FD_t* file) { return reinterpret_cast<const DirectFile*>(file); }

// Pushes an error with errno's text onto HDF5's stack (h5::error_stack() reports it).
void push_error(const char* function, hid_t minor, const std::string& what, int error) {
  const std::string message = what + ": " + std::strerror(error);
  H5Epush2(H5E_DEFAULT, __FILE__, function, __LINE__, H5E_ERR_CLS, H5E_VFL, minor, "%s",
           message.c_str());
}

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

// Writes whole aligned pages past the page cache, through the bounce buffer when `data` is not
// aligned. False with errno set; EINVAL: the file system refused O_DIRECT for this write.
bool write_direct(DirectFile& file, const void* data, std::size_t size, off_t offset) {
  if (reinterpret_cast<std::uintptr_t>(data) % kDirectAlignment == 0) {
    return write_all(file.direct_fd, data, size, offset);
  }
  const auto* bytes = static_cast<const std::byte*>(data);
  for (std::size_t done = 0; done < size; done += kBounceBytes) {
    const std::size_t piece = std::min(kBounceBytes, size - done);
    std::memcpy(file.bounce, bytes + done, piece);
    if (!write_all(file.direct_fd, file.bounce, piece, offset + static_cast<off_t>(done))) {
      return false;
    }
  }
  return true;
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
    file->bounce = std::aligned_alloc(kDirectAlignment, kBounceBytes);
    if (file->bounce) file->direct_fd = ::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  }
  return &file->pub;
}

herr_t close_file(H5FD_t* handle) {
  DirectFile* file = of(handle);
  const int direct = file->direct_fd >= 0 ? ::close(file->direct_fd) : 0;
  const int error = direct != 0 ? errno : 0;
  const int buffered = ::close(file->fd);
  const int buffered_error = buffered != 0 ? errno : 0;
  std::free(file->bounce);
  delete file;
  if (direct != 0 || buffered != 0) {
    push_error(__func__, H5E_CANTCLOSEFILE, "cannot close the file",
               buffered != 0 ? buffered_error : error);
    return -1;
  }
  return 0;
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
  // written both ways.
  std::size_t direct = 0;
  if (file->direct_fd >= 0 && type == H5FD_MEM_DRAW && address % kDirectAlignment == 0) {
    direct = size - size % kDirectAlignment;
  }
  if (direct > 0 && !write_direct(*file, buffer, direct, offset)) {
    if (errno != EINVAL) return write_error();
    ::close(file->direct_fd);  // refused after all: buffered from now on
    file->direct_fd = -1;
    direct = 0;
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
  if (file->eoa == file->eof) return 0;
  if (::ftruncate(file->fd, static_cast<off_t>(file->eoa)) != 0) {
    push_error(__func__, H5E_SEEKERROR, "cannot set the file's size", errno);
    return -1;
  }
  file->eof = file->eoa;
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

void use_direct_writes(hid_t fapl) {
  check(H5Pset_driver(fapl, direct_writes_driver(), nullptr),
        "setting the direct-write file driver", "HDF5");
  check(H5Pset_alignment(fapl, kDirectThreshold, kDirectAlignment), "setting the file's alignment",
        "HDF5");
}

}  // namespace dynaprobe::formats::h5

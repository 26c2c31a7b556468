#include "dynaprobe/formats/dump_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

namespace dynaprobe::formats {
namespace fs = std::filesystem;

namespace {

// What the lock file says of its holder, for the message of a writer that cannot take it.
std::string read_holder(int fd) {
  char buffer[512];
  const ssize_t got = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  std::string text = got > 0 ? std::string(buffer, static_cast<std::size_t>(got)) : "";
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  return text.empty() ? "a writer that has not said who it is" : text;
}

}  // namespace

DumpLock::DumpLock(const fs::path& dump, const std::string& holder) {
  std::error_code error;
  fs::create_directories(dump, error);
  const fs::path path = dump / kFileName;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) {
    throw IoError("cannot open the lock file " + path.string() + ": " + std::strerror(errno));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int code = errno;
    const std::string held_by = read_holder(fd_);
    ::close(fd_);
    fd_ = -1;
    if (code == EWOULDBLOCK) {
      throw DumpBusyError("the dump folder " + dump.string() +
                          " is being written by another process (" + held_by +
                          "); give each run its own dump_dir");
    }
    throw IoError("cannot lock " + path.string() + ": " + std::strerror(code));
  }
  const std::string line = holder + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) {
    const int code = errno;
    ::close(fd_);
    fd_ = -1;
    throw IoError("cannot write the lock file " + path.string() + ": " + std::strerror(code));
  }
}

DumpLock::~DumpLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace dynaprobe::formats

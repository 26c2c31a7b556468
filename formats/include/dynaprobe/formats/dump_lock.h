// One writer per dump folder. A writer holds an advisory lock (flock) on <dump>/.dynaprobe.lock,
// a file naming its holder (host, process, run). A second writer of the same folder cannot take
// it and writes nothing there: it neither removes nor renames what the first writes. The kernel
// releases the lock when its holder exits, however it exits, so a .partial file in a folder whose
// lock is free belongs to a writer that is gone, and may be removed.
#pragma once

#include <filesystem>
#include <string>

#include "dynaprobe/formats/error.h"

namespace dynaprobe::formats {

// The folder's lock is held by another writer (what.() names the folder and the holder).
class DumpBusyError : public IoError {
 public:
  using IoError::IoError;
};

class DumpLock {
 public:
  inline static const char* const kFileName = ".dynaprobe.lock";

  // Takes the lock of `dump` (creating the folder and the lock file if needed) and writes
  // `holder` into the lock file. Throws DumpBusyError when another writer holds it, IoError when
  // the folder or the file cannot be made.
  DumpLock(const std::filesystem::path& dump, const std::string& holder);
  ~DumpLock();  // releases the lock (the file stays: removing it would race a new holder)
  DumpLock(const DumpLock&) = delete;
  DumpLock& operator=(const DumpLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace dynaprobe::formats

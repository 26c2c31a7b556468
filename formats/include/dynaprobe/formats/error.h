// The one exception hierarchy of dynaprobe. Messages say what failed, on which file or record,
// what was expected and what was received, and what to do about it.
#pragma once

#include <stdexcept>
#include <string>

namespace dynaprobe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The file exists and could be read, but its content is not what dynaprobe expects
// (not HDF5, a newer format version, a wrong dtype attribute, a missing record, ...).
class FormatError : public Error {
 public:
  using Error::Error;
};

// The operating system or HDF5 could not read or write (missing path, permission, disk full).
class IoError : public Error {
 public:
  using Error::Error;
};

// The caller passed arguments that cannot work (bad module name, inconsistent shapes, ...).
class UsageError : public Error {
 public:
  using Error::Error;
};

}  // namespace dynaprobe

// The phases of opening a step file (StepReader's constructor runs them in order) that do not
// touch HDF5: the format version, the step attribute, and /index rows as RecordInfo. Private to
// formats; tests/formats includes it for white-box tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dynaprobe/formats/stored_tensor.h"
#include "hdf5_types.h"

namespace dynaprobe::formats {

// A file's format_version attribute, "<major>.<minor>" ("<major>" alone means minor 0).
struct FormatVersion {
  std::string text;
  int major = 0;
  int minor = 0;

  // Written by a newer dynaprobe of the same major version: may hold kinds, sides or dtypes this
  // reader does not know. In a file of a version it knows, an unknown name is damage.
  bool newer() const;
};

// Throws FormatError (naming `where`) for text that is not "<major>[.<minor>]" and for a major
// version this reader cannot read (telling the user to upgrade).
FormatVersion parse_format_version(const std::string& text, const std::string& where);

// The step attribute; throws FormatError unless it is an integer.
std::int64_t parse_step(const std::string& text, const std::string& where);

// /index row `i` as a RecordInfo of `step`, its chunk hashes taken from `chunk_hashes` (the file's
// /chunk_hashes). A row whose kind, side or dtype this reader does not know gives nullopt and
// says which in `unknown` ("index row 3 (module 'm'): unknown kind 'k'"). Throws FormatError for
// a row whose chunk hashes lie past the end of `chunk_hashes`.
std::optional<RecordInfo> record_of_row(const IndexRow& row, std::size_t i, std::int64_t step,
                                        const std::vector<std::uint64_t>& chunk_hashes,
                                        const std::string& where, std::string& unknown);

}  // namespace dynaprobe::formats

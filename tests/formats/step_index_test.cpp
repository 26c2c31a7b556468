// The phases of opening a step file that do not touch HDF5 (formats/src/step_index.h): the
// format version, the step attribute and /index rows, called directly.
#include "step_index.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"
#include "error_of.h"

namespace dynaprobe::formats {
namespace {

template <typename F>
std::string format_error_of(F&& call) {
  return testing_helpers::error_of<FormatError>(call);
}

TEST(StepIndex, FormatVersionIsMajorDotMinor) {
  const FormatVersion full = parse_format_version("1.2", "f.h5");
  EXPECT_EQ(full.text, "1.2");
  EXPECT_EQ(full.major, 1);
  EXPECT_EQ(full.minor, 2);
  const FormatVersion major_only = parse_format_version("1", "f.h5");
  EXPECT_EQ(major_only.major, 1);
  EXPECT_EQ(major_only.minor, 0);
  for (const char* bad : {"banana", "", "-1.0", "1.x", "1.-2"}) {
    const std::string message = format_error_of([&] { parse_format_version(bad, "f.h5"); });
    EXPECT_EQ(message,
              "f.h5: format version '" + std::string(bad) + "' is not of the form <major>.<minor>")
        << bad;
  }
}

// A newer major version cannot be read; a newer minor version can, skipping what it adds.
TEST(StepIndex, NewerMajorVersionIsRefusedNewerMinorIsRead) {
  const std::string next_major = std::to_string(schema::kFormatMajor + 1) + ".0";
  const std::string message = format_error_of([&] { parse_format_version(next_major, "f.h5"); });
  EXPECT_NE(message.find("upgrade dynaprobe"), std::string::npos) << message;
  const std::string current =
      std::to_string(schema::kFormatMajor) + "." + std::to_string(schema::kFormatMinor);
  const std::string next_minor =
      std::to_string(schema::kFormatMajor) + "." + std::to_string(schema::kFormatMinor + 1);
  EXPECT_FALSE(parse_format_version(current, "f.h5").newer());
  EXPECT_FALSE(parse_format_version("1.0", "f.h5").newer());
  EXPECT_TRUE(parse_format_version(next_minor, "f.h5").newer());
}

TEST(StepIndex, StepAttributeIsAnInteger) {
  EXPECT_EQ(parse_step("42", "f.h5"), 42);
  EXPECT_EQ(parse_step("-3", "f.h5"), -3);
  EXPECT_EQ(format_error_of([] { parse_step("x", "f.h5"); }),
            "f.h5: step attribute 'x' is not an integer");
}

IndexRow row(const char* kind, const char* side, const char* dtype,
             std::vector<std::int64_t>& dims) {
  IndexRow r{};
  r.module = "layers.0";
  r.call = 2;
  r.kind = kind;
  r.tensor_index = 1;
  r.side = side;
  r.label = "weight";
  r.dtype = dtype;
  r.shape = {dims.size(), dims.data()};
  r.stored_bytes = 100;
  r.chunk_offset = 4096;
  r.chunk_filter_mask = 3;
  r.chunk_hash = 7;
  return r;
}

TEST(StepIndex, IndexRowBecomesARecordOfTheStep) {
  std::vector<std::int64_t> dims = {4, 8};
  IndexRow r = row("grad_input", "compiled", "bfloat16", dims);
  r.chunk_hashes_first = 1;
  r.chunk_count = 2;
  std::string unknown;
  const auto info = record_of_row(r, 0, 5, {10, 11, 12, 13}, "f.h5", unknown);
  ASSERT_TRUE(info);
  EXPECT_EQ(info->key, (RecordKey{5, "layers.0", 2, Kind::kGradInput, 1, Side::kCompiled}));
  EXPECT_EQ(info->label, "weight");
  EXPECT_EQ(info->dtype, DType::kBFloat16);
  EXPECT_EQ(info->shape, dims);
  EXPECT_EQ(info->stored_bytes, 100u);
  EXPECT_EQ(info->chunk_offset, 4096u);
  EXPECT_EQ(info->chunk_filter_mask, 3u);
  EXPECT_EQ(info->chunk_hash, 7u);
  EXPECT_EQ(info->chunk_hashes, (std::vector<std::uint64_t>{11, 12}));
  EXPECT_TRUE(unknown.empty());
}

// Unknown names are reported, not guessed: the caller skips them (newer file) or calls the file
// damaged.
TEST(StepIndex, UnknownKindSideOrDtypeIsNamed) {
  std::vector<std::int64_t> dims = {3};
  const std::pair<IndexRow, std::string> cases[] = {
      {row("kind_from_the_future", "eager", "float32", dims),
       "unknown kind 'kind_from_the_future'"},
      {row("fwd_output", "sideways", "float32", dims), "unknown side 'sideways'"},
      {row("fwd_output", "eager", "float4", dims), "unknown dtype 'float4'"},
  };
  for (const auto& [r, expected] : cases) {
    std::string unknown;
    EXPECT_FALSE(record_of_row(r, 3, 0, {}, "f.h5", unknown));
    EXPECT_EQ(unknown, "index row 3 (module 'layers.0'): " + expected);
  }
}

TEST(StepIndex, ChunkHashesPastTheEndAreDamage) {
  std::vector<std::int64_t> dims = {3};
  IndexRow r = row("fwd_output", "eager", "float32", dims);
  r.chunk_hashes_first = 3;
  r.chunk_count = 2;
  std::string unknown;
  EXPECT_EQ(format_error_of([&] {
              record_of_row(r, 1, 0, {1, 2, 3, 4}, "f.h5", unknown);
            }),
            "f.h5: damaged /index: row 1 points past the end of /chunk_hashes");
}

}  // namespace
}  // namespace dynaprobe::formats

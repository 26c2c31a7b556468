// Bad input (DESIGN.md "Errors"): a truncated, corrupt, tampered or foreign file gets its own
// clear error naming the file, the record and the problem, never a crash or silent garbage.
// Files are damaged with the raw HDF5 C API, as another tool or a bad disk would damage them.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/writer.h"
#include "error_of.h"
#include "h5.h"  // formats/src: private, for white-box tests and benchmarks
#include "test_util.h"

namespace dynaprobe::formats {
namespace {

namespace fs = std::filesystem;

// Writes and commits one step holding `content`; returns the committed file.
fs::path write_step(const fs::path& dir, const testing::FixtureStep& content,
                    WriterOptions options = {}) {
  StepWriter writer(dir, content.records.front().key.step, {{"scenario", "bad_input"}}, options);
  writer.write(content.records);
  return writer.commit();
}

// 4 KiB chunks: the fixture's 16 KiB records span four, so they are read through their datasets.
// (A single-chunk record is read at the file offset /index gives, verified by its hash: see
// LocatedChunk* below; its dataset's attributes are not consulted.)
constexpr WriterOptions kSeveralChunks{.chunk_bytes = 4096};

// Raw HDF5 access for damaging files, outside dynaprobe's writer.
h5::Handle open_for_tampering(const fs::path& file) {
  h5::init();  // silences HDF5's own error printing
  return h5::file_handle(H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "opening",
                         file.string());
}

// Replaces (or creates) the string attribute `name` of the object at `object` in `file`.
void set_string_attribute(const fs::path& file, const std::string& object, std::string_view name,
                          std::string_view value) {
  h5::Handle handle = open_for_tampering(file);
  const hid_t target = H5Oopen(handle.get(), object.c_str(), H5P_DEFAULT);
  ASSERT_GE(target, 0) << object;
  if (h5::has_attribute(target, name)) {
    ASSERT_GE(H5Adelete(target, std::string(name).c_str()), 0);
  }
  h5::write_string_attribute(target, name, value, object);
  H5Oclose(target);
  handle.close(file.string());
}

using testing_helpers::error_of;

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, needle, haystack)

TEST(BadInput, TruncatedFileIsFormatErrorOnOpen) {
  const testing::TempDir tmp;
  // 4 MiB in 1 MiB chunks: the file is mostly chunk data, so half of it ends inside the data.
  const testing::FixtureStep content = testing::fixture_step(0, 4 << 20);
  const fs::path file = write_step(tmp.path(), content);
  const auto full_size = fs::file_size(file);
  ASSERT_GT(full_size, 1u << 20);
  for (const std::uintmax_t size : {full_size / 2, std::uintmax_t{100}}) {
    SCOPED_TRACE("truncated to " + std::to_string(size) + " bytes");
    fs::resize_file(file, size);
    // HDF5 compares the end of file recorded in the superblock with the real one, so the damage
    // is found when the file is opened, before any record is trusted.
    const std::string message = error_of<FormatError>([&] { StepReader reader(file); });
    EXPECT_CONTAINS(message, file.string());
    EXPECT_CONTAINS(message, "truncated");
  }
}

TEST(BadInput, RandomBytesAreNotAnHdf5File) {
  const testing::TempDir tmp;
  const fs::path file = tmp.path() / "step_00000000.h5";
  const std::vector<std::byte> bytes = testing::random_bytes(64 << 10, 7);
  testing::write_file(file,
                      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  const std::string message = error_of<FormatError>([&] { StepReader reader(file); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, "not an HDF5 file");
}

TEST(BadInput, GarbageAfterTheHdf5SignatureIsFormatError) {
  // Passes the signature check, so the HDF5 library itself must reject the superblock.
  const testing::TempDir tmp;
  const fs::path file = tmp.path() / "step_00000000.h5";
  const std::vector<std::byte> bytes = testing::random_bytes(64 << 10, 11);
  testing::write_file(file,
                      std::string("\x89HDF\r\n\x1a\n", 8) +
                          std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  const std::string message = error_of<FormatError>([&] { StepReader reader(file); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, "cannot open as HDF5");
}

TEST(BadInput, WrongDtypeAttributeIsFormatErrorNamingTheDataset) {
  const testing::TempDir tmp;
  const testing::FixtureStep content = testing::fixture_step(0, 64 << 10);
  const fs::path file = write_step(tmp.path(), content, kSeveralChunks);
  const RecordKey& key = content.records[1].key;
  const std::string dataset = dataset_path(key);
  struct Case {
    std::string attribute;
    std::string problem;
  };
  for (const Case& c : {Case{"float16",
                             "dtype attribute says 'float16', but the dataset stores "
                             "float32 values"},
                        Case{"complex64",
                             "dtype attribute says 'complex64', but the dataset stores "
                             "float32 values"},
                        Case{"float128", "unknown dtype attribute 'float128'"}}) {
    SCOPED_TRACE("dtype attribute " + c.attribute);
    set_string_attribute(file, dataset, schema::kDtypeAttr, c.attribute);
    const StepReader reader(file);  // the index alone is intact
    const RecordInfo* info = reader.find(key);
    ASSERT_NE(info, nullptr);
    const std::string message = error_of<FormatError>([&] { reader.read(*info); });
    EXPECT_CONTAINS(message, file.string());
    EXPECT_CONTAINS(message, dataset);
    EXPECT_CONTAINS(message, c.problem);
    // The damage stays local: the other records still read back.
    EXPECT_EQ(reader.read(*reader.find(content.records[0].key)), content.data[0]);
  }
}

// Replaces the dtype attribute of `dataset` by one of HDF5 type `type` holding `value`.
void replace_dtype_attribute(const fs::path& file, const std::string& dataset, hid_t type,
                             const void* value) {
  h5::Handle handle = open_for_tampering(file);
  const hid_t target = H5Dopen2(handle.get(), dataset.c_str(), H5P_DEFAULT);
  ASSERT_GE(target, 0);
  ASSERT_GE(H5Adelete(target, std::string(schema::kDtypeAttr).c_str()), 0);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t attribute = H5Acreate2(target, std::string(schema::kDtypeAttr).c_str(), type, space,
                                     H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(H5Awrite(attribute, type, value), 0);
  H5Aclose(attribute);
  H5Sclose(space);
  H5Dclose(target);
}

TEST(BadInput, NonStringDtypeAttributeIsFormatError) {
  const testing::TempDir tmp;
  const testing::FixtureStep content = testing::fixture_step(0, 64 << 10);
  const fs::path file = write_step(tmp.path(), content, kSeveralChunks);
  const std::string dataset = dataset_path(content.records[0].key);
  const int value = 32;
  replace_dtype_attribute(file, dataset, H5T_NATIVE_INT, &value);
  const StepReader reader(file);
  const std::string message =
      error_of<FormatError>([&] { reader.open(*reader.find(content.records[0].key)); });
  EXPECT_CONTAINS(message, dataset);
  EXPECT_CONTAINS(message, "expected a string");
}

// Format 2.0 has nothing variable-length: a variable-length string (whose bytes would live in
// HDF5's global heap, which has no checksum) is damage, refused before it is read.
TEST(BadInput, Format2RefusesAVariableLengthStringBeforeReadingIt) {
  const testing::TempDir tmp;
  const testing::FixtureStep content = testing::fixture_step(0, 64 << 10);
  const fs::path file = write_step(tmp.path(), content, kSeveralChunks);
  const std::string dataset = dataset_path(content.records[0].key);
  const char* value = "float32";
  replace_dtype_attribute(file, dataset, h5::string_type(dataset), &value);
  const StepReader reader(file);
  const std::string message =
      error_of<FormatError>([&] { reader.open(*reader.find(content.records[0].key)); });
  EXPECT_CONTAINS(message, dataset);
  EXPECT_CONTAINS(message, "variable-length");
}

// Format 2.0 checksums /modules and /graphs: an attribute changed in place is damage, named.
TEST(BadInput, Format2ModulesAndGraphsAreChecksummed) {
  const testing::TempDir tmp;
  const auto written = [&](const fs::path& dir) {
    StepWriter writer(dir, 0, {{"mode", "single_pass"}});
    writer.write_module({"layers.0", {{"role", "wrapped"}, {"calls", "1"}}});
    writer.write_graph({"__compiled_fn_1.Forward_Graph.0", "forward", "def forward(x):\n", {}});
    return writer.commit();
  };
  for (const std::string object :
       {"/modules/layers.0", "/graphs/__compiled_fn_1.Forward_Graph.0"}) {
    SCOPED_TRACE(object);
    const fs::path file = written(tmp.path() / object.substr(1, 7));
    {
      const StepReader reader(file);
      EXPECT_EQ(reader.modules().size(), 1u);
      EXPECT_EQ(reader.graphs().size(), 1u);
    }
    set_string_attribute(file, object, object.starts_with("/modules") ? "role" : "kind", "ignored");
    const StepReader reader(file);  // the index does not cover them: it still opens
    const bool module = object.starts_with("/modules");
    const std::string message = error_of<FormatError>([&] {
      if (module) {
        reader.modules();
      } else {
        reader.graphs();
      }
    });
    EXPECT_CONTAINS(message, file.string());
    EXPECT_CONTAINS(message, module ? "damaged /modules" : "damaged /graphs");
    EXPECT_CONTAINS(message, "XXH3");
  }
}

TEST(BadInput, NewerFormatVersionTellsTheUserToUpgrade) {
  const testing::TempDir tmp;
  const fs::path file = write_step(tmp.path(), testing::fixture_step(0, 4096));
  set_string_attribute(file, "/", schema::kFormatVersionAttr, "3.0");
  const std::string message = error_of<FormatError>([&] { StepReader reader(file); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, "format 3.0");
  EXPECT_CONTAINS(message, "upgrade dynaprobe");
}

TEST(BadInput, MalformedFormatVersionIsFormatError) {
  const testing::TempDir tmp;
  const fs::path file = write_step(tmp.path(), testing::fixture_step(0, 4096));
  set_string_attribute(file, "/", schema::kFormatVersionAttr, "banana");
  const std::string message = error_of<FormatError>([&] { StepReader reader(file); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, "'banana' is not of the form <major>.<minor>");
}

TEST(BadInput, MissingRecordIsFormatErrorNamingTheRecord) {
  const testing::TempDir tmp;
  const testing::FixtureStep content = testing::fixture_step(0, 64 << 10);
  const fs::path file = write_step(tmp.path(), content, kSeveralChunks);
  const RecordKey& deleted = content.records[2].key;
  {
    h5::Handle handle = open_for_tampering(file);
    ASSERT_GE(H5Ldelete(handle.get(), dataset_path(deleted).c_str(), H5P_DEFAULT), 0);
  }
  const StepReader reader(file);
  const RecordInfo* info = reader.find(deleted);
  ASSERT_NE(info, nullptr) << "the index still lists the deleted record";
  for (const bool read_data : {false, true}) {
    const std::string message = error_of<FormatError>([&] {
      if (read_data) {
        reader.read(*info);
      } else {
        reader.open(*info);
      }
    });
    EXPECT_CONTAINS(message, file.string());
    EXPECT_CONTAINS(message, to_string(deleted));
    EXPECT_CONTAINS(message, "dataset is missing from the file");
  }
  EXPECT_EQ(reader.read(*reader.find(content.records[3].key)), content.data[3]);

  // A key that was never written is no error: find() says there is no such record.
  RecordKey never_written = deleted;
  never_written.module = "layers.99";
  EXPECT_EQ(reader.find(never_written), nullptr);
}

TEST(BadInput, CorruptCompressedChunkIsFormatErrorNotGarbage) {
  const testing::TempDir tmp;
  const testing::FixtureStep content = testing::fixture_step(0, 1 << 20);
  WriterOptions options;
  options.chunk_bytes = 64 << 10;
  const fs::path file = write_step(tmp.path(), content, options);
  const RecordKey& key = content.records[1].key;

  // Where the middle chunk of the record lies in the file (H5Dget_chunk_info, HDF5 >= 1.10.5).
  haddr_t address = HADDR_UNDEF;
  hsize_t stored = 0;
  hsize_t chunk = 0;
  {
    h5::init();
    h5::Handle handle = h5::file_handle(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT),
                                        "opening", file.string());
    h5::Handle dataset = h5::dataset_handle(
        H5Dopen2(handle.get(), dataset_path(key).c_str(), H5P_DEFAULT), "opening", "dataset");
    h5::Handle space = h5::space_handle(H5Dget_space(dataset.get()), "space", "dataset");
    hsize_t chunks = 0;
    ASSERT_GE(H5Dget_num_chunks(dataset.get(), space.get(), &chunks), 0);
    ASSERT_GE(chunks, 3u);
    chunk = chunks / 2;
    hsize_t offset[1];
    unsigned filter_mask = 0;
    ASSERT_GE(H5Dget_chunk_info(dataset.get(), space.get(), chunk, offset, &filter_mask, &address,
                                &stored),
              0);
    ASSERT_EQ(filter_mask, 0u) << "the chunk must be compressed (no filter skipped)";
    ASSERT_LT(stored, options.chunk_bytes);
  }
  {
    // Flip every bit of 64 bytes in the middle of the compressed chunk, as a bad sector would.
    std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
    const auto middle = static_cast<std::streamoff>(address + stored / 2);
    std::vector<char> bytes(64);
    stream.seekg(middle);
    stream.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    for (char& byte : bytes) byte = static_cast<char>(~byte);
    stream.seekp(middle);
    stream.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(stream.good());
  }
  const StepReader reader(file);
  const std::string message = error_of<FormatError>([&] { reader.read(*reader.find(key)); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, dataset_path(key));
  EXPECT_CONTAINS(message, "chunk " + std::to_string(chunk) + " is corrupt");
  EXPECT_EQ(reader.read(*reader.find(content.records[0].key)), content.data[0]);
}

// A record stored as one chunk is read at the offset /index gives. Damaged bytes there are an
// error, whether zstd compressed them or they were stored as they are (no zstd checksum then).
TEST(BadInput, CorruptSingleChunkRecordIsFormatErrorNotGarbage) {
  for (const bool compressible : {true, false}) {
    SCOPED_TRACE(compressible ? "compressed chunk" : "chunk stored as it is");
    const testing::TempDir tmp;
    const auto data = testing::random_bytes(16 << 10, 5, compressible);
    const auto other = testing::random_bytes(16 << 10, 6, compressible);
    const std::vector<Record> records{
        testing::make_record(0, "layers.0", Kind::kFwdOutput, 0, Side::kEager, DType::kFloat32,
                             {64, 64}, data),
        testing::make_record(0, "layers.1", Kind::kFwdOutput, 0, Side::kEager, DType::kFloat32,
                             {64, 64}, other)};
    StepWriter writer(tmp.path(), 0, {});
    writer.write(records);
    const fs::path file = writer.commit();
    RecordInfo info = *StepReader(file).find(records[0].key);
    ASSERT_NE(info.chunk_offset, 0u);
    ASSERT_EQ(info.chunk_filter_mask, compressible ? 0u : 0b11u);
    {
      std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
      const auto middle = static_cast<std::streamoff>(info.chunk_offset + info.stored_bytes / 2);
      char byte = 0;
      stream.seekg(middle);
      stream.read(&byte, 1);
      byte = static_cast<char>(byte ^ 0x10);  // one bit, as a bad sector or a bit flip would
      stream.seekp(middle);
      stream.write(&byte, 1);
      ASSERT_TRUE(stream.good());
    }
    const StepReader reader(file);
    const std::string message =
        error_of<FormatError>([&] { reader.read(*reader.find(records[0].key)); });
    EXPECT_CONTAINS(message, file.string());
    EXPECT_CONTAINS(message, dataset_path(records[0].key));
    EXPECT_CONTAINS(message, "chunk 0 is corrupt");
    EXPECT_EQ(reader.read(*reader.find(records[1].key)), other);
  }
}

TEST(BadInput, MissingFileIsIoError) {
  const testing::TempDir tmp;
  const fs::path file = tmp.path() / "step_00000007.h5";
  const std::string message = error_of<IoError>([&] { StepReader reader(file); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, "no such file");
}

TEST(BadInput, PlainHdf5FileIsNotADynaprobeStepFile) {
  const testing::TempDir tmp;
  const fs::path file = tmp.path() / "other.h5";
  {
    h5::init();
    h5::Handle handle = h5::file_handle(
        H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), "creating", "other.h5");
    h5::group_handle(H5Gcreate2(handle.get(), "data", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                     "creating", "group");
  }
  const std::string message = error_of<FormatError>([&] { StepReader reader(file); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, "not a dynaprobe step file");
}

TEST(BadInput, StepFileWithoutIndexIsFormatError) {
  // A file that has the attributes but no /index was never committed (or lost its index).
  const testing::TempDir tmp;
  const testing::FixtureStep content = testing::fixture_step(0, 4096);
  const fs::path file = write_step(tmp.path(), content);
  {
    h5::Handle handle = open_for_tampering(file);
    ASSERT_GE(H5Ldelete(handle.get(), std::string(schema::kIndexDataset).c_str(), H5P_DEFAULT), 0);
  }
  const std::string message = error_of<FormatError>([&] { StepReader reader(file); });
  EXPECT_CONTAINS(message, file.string());
  EXPECT_CONTAINS(message, "not a complete dynaprobe step file");
}

}  // namespace
}  // namespace dynaprobe::formats

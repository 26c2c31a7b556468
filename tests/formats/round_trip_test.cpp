// Every dtype and shape case written by StepWriter reads back bit for bit through StepReader.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <zstd.h>

#include <bit>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <type_traits>
#include <utility>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/writer.h"
#include "h5.h"  // formats/src: private, for white-box tests and benchmarks
#include "test_util.h"

namespace dynaprobe::formats {
namespace {

using testing::make_record;
using testing::random_bytes;
using testing::TempDir;

struct Written {
  Record record;
  std::vector<std::byte> data;
};

// Writes `tensors` as step 0 of a fresh dump, reads every record back and compares bytes.
void expect_round_trip(std::vector<Written>& tensors, WriterOptions options = {}) {
  TempDir dir;
  std::vector<Record> records;
  for (auto& t : tensors) {
    t.record.tensor.data = t.data.empty() ? nullptr : t.data.data();
    records.push_back(t.record);
  }
  StepWriter writer(dir.path(), 0, {{"torch_version", "2.13.0"}}, options);
  writer.write(records);
  const auto path = writer.commit();
  EXPECT_EQ(path, dir.path() / "step_00000000.h5");
  EXPECT_FALSE(std::filesystem::exists(writer.partial_path()));

  StepReader reader(path);
  EXPECT_EQ(reader.step(), 0);
  EXPECT_EQ(reader.provenance().at("torch_version"), "2.13.0");
  ASSERT_EQ(reader.records().size(), tensors.size());
  for (const auto& t : tensors) {
    const RecordInfo* info = reader.find(t.record.key);
    ASSERT_NE(info, nullptr) << to_string(t.record.key);
    EXPECT_EQ(info->dtype, t.record.tensor.dtype);
    EXPECT_EQ(info->shape, t.record.tensor.shape);
    EXPECT_EQ(info->label, t.record.label);
    const auto data = reader.read(*info);
    ASSERT_EQ(data.size(), t.data.size()) << to_string(t.record.key);
    if (!data.empty()) {
      EXPECT_EQ(std::memcmp(data.data(), t.data.data(), data.size()), 0) << to_string(t.record.key);
    }
  }
}

Written make(std::string module, DType dtype, std::vector<std::int64_t> shape, std::uint32_t seed,
             bool compressible = true) {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  Written w{make_record(0, std::move(module), Kind::kFwdOutput, 0, Side::kEager, dtype, shape, {}),
            random_bytes(n * dtype_size(dtype), seed, compressible)};
  if (dtype == DType::kBool) {
    for (auto& b : w.data) b = static_cast<std::byte>(static_cast<unsigned>(b) & 1);
  }
  return w;
}

TEST(RoundTrip, EveryDTypeBitForBit) {
  std::vector<Written> tensors;
  std::uint32_t seed = 1;
  for (DType dtype : kAllDTypes) {
    tensors.push_back(make("m_" + std::string(dtype_name(dtype)), dtype, {37, 129}, seed++));
  }
  expect_round_trip(tensors);
}

// A loop over the index of a reader made for it, `for (auto& info : StepReader(file).records())`,
// gets a copy: a reference would outlive the reader, which dies before the loop's first step.
static_assert(!std::is_reference_v<decltype(std::declval<StepReader>().records())>);
static_assert(!std::is_reference_v<decltype(std::declval<StepReader>().stored_metrics())>);
static_assert(!std::is_reference_v<decltype(std::declval<StepReader>().skipped_records())>);
static_assert(!std::is_reference_v<decltype(std::declval<StepReader>().provenance())>);
static_assert(!std::is_reference_v<decltype(std::declval<StepReader>().path())>);
static_assert(!std::is_reference_v<decltype(std::declval<StepReader>().format_version())>);
static_assert(std::is_reference_v<decltype(std::declval<const StepReader&>().records())>);

TEST(RoundTrip, ATemporaryReadersIndexOutlivesIt) {
  TempDir dir;
  std::vector<Written> tensors = {make("a", DType::kFloat32, {3, 5}, 1),
                                  make("b", DType::kBFloat16, {7}, 2)};
  std::vector<Record> records;
  for (auto& t : tensors) {
    t.record.tensor.data = t.data.data();
    records.push_back(t.record);
  }
  StepWriter writer(dir.path(), 0, {{"torch_version", "2.13.0"}});
  writer.write(records);
  const auto path = writer.commit();
  std::vector<std::string> modules;
  for (const RecordInfo& info : StepReader(path).records()) modules.push_back(info.key.module);
  EXPECT_EQ(modules, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(StepReader(path).provenance().at("torch_version"), "2.13.0");
}

TEST(RoundTrip, ZeroDimEmptyAndOddShapes) {
  std::vector<Written> tensors;
  tensors.push_back(make("scalar", DType::kFloat32, {}, 1));
  tensors.push_back(make("scalar_bf16", DType::kBFloat16, {}, 2));
  tensors.push_back(make("empty", DType::kFloat32, {0}, 3));
  tensors.push_back(make("empty_2d", DType::kInt64, {4, 0, 3}, 4));
  tensors.push_back(make("vector", DType::kFloat16, {1}, 5));
  tensors.push_back(make("rank5", DType::kFloat32, {2, 3, 5, 7, 11}, 6));
  expect_round_trip(tensors);
}

TEST(RoundTrip, SizesThatAreNotAMultipleOfTheChunkSize) {
  // 4 KiB chunks: rows split across chunks with a partial edge chunk, a last dimension longer than
  // a chunk, and the split falling in a middle dimension.
  WriterOptions options;
  options.chunk_bytes = 4096;
  std::vector<Written> tensors;
  tensors.push_back(make("rows", DType::kFloat32, {1001, 7}, 1));
  tensors.push_back(make("long_last_dim", DType::kFloat32, {3, 100003}, 2));
  tensors.push_back(make("middle_split", DType::kBFloat16, {5, 333, 9}, 3));
  tensors.push_back(make("one_element_per_row", DType::kFloat64, {9999}, 4));
  tensors.push_back(make("bytes", DType::kUInt8, {65537}, 5));
  expect_round_trip(tensors, options);
}

TEST(RoundTrip, IncompressibleChunksAreStoredAsTheyAre) {
  std::vector<Written> tensors;
  tensors.push_back(make("noise", DType::kFloat32, {3, 300000}, 7, /*compressible=*/false));
  tensors.push_back(make("text", DType::kFloat32, {3, 300000}, 8, /*compressible=*/true));
  expect_round_trip(tensors);
}

// The contract readers in other languages may rely on: /index locates every record stored as one
// chunk (compressed or not), and the XXH64 it gives is that of the bytes at that offset.
TEST(RoundTrip, SingleChunkRecordsAreLocatedInTheIndex) {
  std::vector<Written> tensors;
  tensors.push_back(make("small", DType::kFloat32, {8, 128}, 21));
  tensors.push_back(make("noise", DType::kBFloat16, {3, 70}, 22, /*compressible=*/false));
  tensors.push_back(make("large", DType::kFloat32, {4, 300000}, 23));
  tensors.push_back(make("scalar", DType::kFloat32, {}, 24));
  tensors.push_back(make("empty", DType::kFloat32, {4, 0}, 25));
  expect_round_trip(tensors);  // reads every record back, located or not

  TempDir dir;
  std::vector<Record> records;
  for (auto& t : tensors) {
    t.record.tensor.data = t.data.empty() ? nullptr : t.data.data();
    records.push_back(t.record);
  }
  StepWriter writer(dir.path(), 0, {});
  writer.write(records);
  const auto path = writer.commit();
  const StepReader reader(path);
  std::ifstream file(path, std::ios::binary);
  for (const auto& t : tensors) {
    SCOPED_TRACE(t.record.key.module);
    const RecordInfo& info = *reader.find(t.record.key);
    const bool one_chunk = t.record.key.module == "small" || t.record.key.module == "noise";
    if (!one_chunk) {
      EXPECT_EQ(info.chunk_offset, 0u);
      continue;
    }
    ASSERT_NE(info.chunk_offset, 0u);
    std::vector<std::byte> stored(info.stored_bytes);
    file.seekg(static_cast<std::streamoff>(info.chunk_offset));
    file.read(reinterpret_cast<char*>(stored.data()), static_cast<std::streamsize>(stored.size()));
    ASSERT_TRUE(file.good());
    EXPECT_EQ(xxh3(stored.data(), stored.size()), info.chunk_hash);
    EXPECT_EQ(info.chunk_hashes, std::vector<std::uint64_t>{info.chunk_hash});
    // Incompressible bytes are stored as they are: both filters skipped.
    if (t.record.key.module == "noise") {
      EXPECT_EQ(info.chunk_filter_mask, 0b11u);
      EXPECT_EQ(stored, t.data);
    } else {
      EXPECT_EQ(info.chunk_filter_mask, 0u);
      EXPECT_LT(stored.size(), t.data.size());
    }
  }
}

// Records of one write() with the same dtype, shape and bytes are stored once: one dataset holds
// the bytes (that of a record in page-aligned memory where there is one, written from there past
// the page cache), the others are hard links to it, their index rows point at its chunk. Anything
// that differs (one byte, the dtype, the shape) is stored on its own.
TEST(RoundTrip, RecordsWithTheSameBytesAreStoredOnce) {
  const auto data = random_bytes(64 << 10, 41, /*compressible=*/false);
  auto changed = data;
  changed[data.size() / 3] ^= std::byte{1};
  const auto record = [](std::string module, Side side, DType dtype,
                         std::vector<std::int64_t> shape, const std::vector<std::byte>& bytes) {
    return make_record(0, std::move(module), Kind::kFwdOutput, 0, side, dtype, std::move(shape),
                       bytes);
  };
  std::vector<Record> records{
      record("a", Side::kEager, DType::kFloat32, {128, 128}, data),
      record("a", Side::kCompiled, DType::kFloat32, {128, 128}, data),     // repeat of a/eager
      record("b", Side::kEager, DType::kFloat32, {128, 128}, changed),     // one bit differs
      record("c", Side::kEager, DType::kInt32, {128, 128}, data),          // another dtype
      record("d", Side::kEager, DType::kFloat32, {64, 256}, data),         // another shape
      record("e", Side::kEager, DType::kFloat32, {4, 128, 32}, data),      // several chunks
      record("e", Side::kCompiled, DType::kFloat32, {4, 128, 32}, data)};  // repeat of e/eager
  // a/compiled in page-aligned memory (a snapshot), a/eager not (a tensor of torch's): the later
  // record holds the bytes, the earlier links to it.
  std::unique_ptr<std::byte, decltype(&std::free)> memory(
      static_cast<std::byte*>(std::aligned_alloc(4096, 2 * data.size() + 4096)), &std::free);
  std::byte* const aligned = memory.get();
  std::byte* const unaligned = memory.get() + data.size() + 64;
  std::memcpy(aligned, data.data(), data.size());
  std::memcpy(unaligned, data.data(), data.size());
  records[0].tensor.data = unaligned;
  records[1].tensor.data = aligned;
  TempDir dir;
  WriterOptions options;
  options.chunk_bytes = 16 << 10;  // e spans four chunks; the others do too, as 2-D (128, 128)
  StepWriter writer(dir.path(), 0, {}, options);
  writer.write(records);
  const auto path = writer.commit();
  const StepReader reader(path);
  for (const Record& r : records) {
    const auto* bytes = static_cast<const std::byte*>(r.tensor.data);
    EXPECT_EQ(reader.read(*reader.find(r.key)),
              std::vector<std::byte>(bytes, bytes + r.tensor.nbytes()))
        << to_string(r.key);
  }
  // Which records share one dataset: HDF5's object addresses tell.
  h5::init();
  h5::Handle file =
      h5::file_handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "opening", path.string());
  const auto address = [&](const Record& r) {
    H5O_info_t info;
    EXPECT_GE(H5Oget_info_by_name(file.get(), dataset_path(r.key).c_str(), &info, H5P_DEFAULT), 0);
    return info.addr;
  };
  EXPECT_EQ(address(records[1]), address(records[0]));
  EXPECT_EQ(address(records[6]), address(records[5]));
  for (std::size_t i : {2, 3, 4, 5}) EXPECT_NE(address(records[i]), address(records[0])) << i;
  EXPECT_EQ(reader.find(records[1].key)->stored_bytes, reader.find(records[0].key)->stored_bytes);
  ASSERT_EQ(reader.records().size(), records.size());
  for (std::size_t i = 0; i < records.size(); ++i) {  // the index lists records as written
    EXPECT_EQ(reader.records()[i].key, records[i].key) << i;
  }
}

// Across write() calls, a repeat is found when the earlier record was stored as it is in one
// chunk (its bytes are read back from the file to compare): float32 activations and gradients
// that do not compress, the bulk of a capture.
TEST(RoundTrip, RepeatsOfRecordsOfEarlierWritesAreStoredOnce) {
  const auto noise = random_bytes(64 << 10, 43, /*compressible=*/false);
  const auto text = random_bytes(64 << 10, 44, /*compressible=*/true);
  const auto record = [](std::string module, Side side, const std::vector<std::byte>& bytes) {
    return make_record(0, std::move(module), Kind::kParamGrad, 0, side, DType::kFloat32, {128, 128},
                       bytes);
  };
  TempDir dir;
  StepWriter writer(dir.path(), 0, {});
  writer.write(record("a", Side::kEager, noise));
  writer.write(record("b", Side::kEager, text));
  writer.write(record("a", Side::kCompiled, noise));  // repeat of a/eager, stored as it is
  writer.write(record("b", Side::kCompiled, text));   // repeat of a compressed record: stored
  const auto path = writer.commit();
  const StepReader reader(path);
  const auto info = [&](const char* module, Side side) {
    return *reader.find(RecordKey{0, module, 0, Kind::kParamGrad, 0, side});
  };
  EXPECT_EQ(info("a", Side::kEager).chunk_filter_mask, 0b11u);
  EXPECT_EQ(info("a", Side::kCompiled).chunk_offset, info("a", Side::kEager).chunk_offset);
  EXPECT_NE(info("b", Side::kCompiled).chunk_offset, info("b", Side::kEager).chunk_offset);
  EXPECT_EQ(reader.read(info("a", Side::kCompiled)), noise);
  EXPECT_EQ(reader.read(info("b", Side::kCompiled)), text);
}

// Bytes of `path` in the page cache (mincore over a mapping of the whole file).
std::size_t cached_bytes(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  const auto size = static_cast<std::size_t>(std::filesystem::file_size(path));
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  EXPECT_NE(mapped, MAP_FAILED) << path;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((size + page - 1) / page);
  EXPECT_EQ(::mincore(mapped, size, resident.data()), 0) << std::strerror(errno);
  ::munmap(mapped, size);
  std::size_t pages = 0;
  for (const unsigned char r : resident) pages += r & 1;
  return pages * page;
}

// Whether files in `dir` can be opened with O_DIRECT (not on tmpfs, nor on some network file
// systems).
bool direct_io_works(const std::filesystem::path& dir) {
  const std::filesystem::path probe = dir / "direct-io-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  std::filesystem::remove(probe);
  return fd >= 0;
}

// A dump is written once and read later. The chunks of a step go to the disk past the page cache
// (O_DIRECT, direct_driver.h) where the file system allows it; elsewhere the writer streams the
// step to disk and out of the page cache while writing it (durable_file.h, WritebackStream). Either
// way a run's steps do not fill the host's memory, and a committed step reads back bit for bit.
TEST(RoundTrip, AStepLeavesThePageCacheAsItIsWrittenAndReadsBackFromDisk) {
  TempDir dir;
  struct statfs filesystem {};
  ASSERT_EQ(::statfs(dir.path().c_str(), &filesystem), 0);
  if (filesystem.f_type == TMPFS_MAGIC) {
    GTEST_SKIP() << dir.path() << " is on tmpfs, whose pages are the file itself";
  }
  // 910 x 2,304 float32, about 8 MiB: as rows (chunks of 113 rows, 254.25 pages, as a GPT-2
  // c_attn weight's gradient) or flat (chunks of 1 MiB, whole pages).
  constexpr std::int64_t kRows = 910, kColumns = 2304;
  constexpr std::size_t kTensorBytes = kRows * kColumns * 4;
  constexpr int kTensors = 12;  // 96 MiB, incompressible: stored as they are
  std::vector<std::vector<std::byte>> data;
  // Half of them in page-aligned memory (written from there), half not (through a copy).
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> aligned;
  std::vector<Record> records;
  for (int i = 0; i < kTensors; ++i) {
    data.push_back(random_bytes(kTensorBytes, 100 + i, /*compressible=*/false));
    const std::vector<std::int64_t> shape = i % 4 < 2 ? std::vector<std::int64_t>{kRows, kColumns}
                                                      : std::vector<std::int64_t>{kRows * kColumns};
    records.push_back(make_record(0, "m" + std::to_string(i), Kind::kFwdOutput, 0, Side::kEager,
                                  DType::kFloat32, shape, data.back()));
    if (i % 2 == 0) {
      // aligned_alloc takes a whole number of alignments (C11; ASan refuses another size).
      const std::size_t pages = (kTensorBytes + 4095) / 4096;
      aligned.emplace_back(static_cast<std::byte*>(std::aligned_alloc(4096, pages * 4096)),
                           &std::free);
      std::memcpy(aligned.back().get(), data.back().data(), kTensorBytes);
      records.back().tensor.data = aligned.back().get();
    }
  }
  StepWriter writer(dir.path(), 0, {});
  writer.write(records);
  if (direct_io_works(dir.path())) {
    // Only HDF5's own metadata and the last part-pages of chunks went through the page cache.
    EXPECT_LE(cached_bytes(writer.partial_path()), std::size_t{1} << 20);
  } else {
    // At most the last windows of 16 MiB are still cached while the step is open.
    EXPECT_LE(cached_bytes(writer.partial_path()), std::size_t{48} << 20);
  }
  const auto path = writer.commit();
  EXPECT_LE(cached_bytes(path), std::size_t{1} << 20);
  // The file was given room ahead of its direct writes (direct_driver.cpp), and its true size at
  // the end: the tensors and HDF5's metadata, not a whole reservation.
  EXPECT_LT(std::filesystem::file_size(path), kTensors * kTensorBytes + (std::size_t{1} << 20));

  const StepReader reader(path);
  for (int i = 0; i < kTensors; ++i) {
    EXPECT_EQ(reader.read(*reader.find(records[i].key)), data[i]) << records[i].key.module;
  }
}

// xxh64() is XXH64: zstd stores the low 32 bits of the XXH64 of a frame's content as its content
// checksum, an independent implementation to check ours against, at every tail length.
TEST(RoundTrip, Xxh64AgreesWithZstdContentChecksums) {
  const auto data = random_bytes(4096 + 64, 31, /*compressible=*/false);
  ZSTD_CCtx* context = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(context, ZSTD_c_checksumFlag, 1);
  std::vector<std::byte> frame(ZSTD_compressBound(data.size()));
  for (std::size_t size : {0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 100, 4096, 4096 + 61}) {
    const std::size_t framed =
        ZSTD_compress2(context, frame.data(), frame.size(), data.data(), size);
    ASSERT_FALSE(ZSTD_isError(framed));
    std::uint32_t checksum = 0;
    std::memcpy(&checksum, frame.data() + framed - 4, 4);
    EXPECT_EQ(static_cast<std::uint32_t>(xxh64(data.data(), size)), checksum) << size << " bytes";
  }
  ZSTD_freeCCtx(context);
}

// Files of format 1, written by dynaprobe's writer before 2.0 (tests/data/format_1.4 holds one of
// 1.4, tests/data/format_1.2 three of 1.2), still read: every record, checked by its XXH64 where
// the file has one, the modules and the graphs.
TEST(RoundTrip, FilesOfFormat1StillRead) {
  std::set<std::string> versions;
  for (const char* folder : {"format_1.2", "format_1.4"}) {
    for (const auto& entry : std::filesystem::directory_iterator(
             std::filesystem::path(DYNAPROBE_TEST_DATA_DIR) / folder)) {
      const StepReader reader(entry.path());
      SCOPED_TRACE(entry.path().string());
      versions.insert(reader.format_version());
      ASSERT_FALSE(reader.records().empty());
      for (const RecordInfo& record : reader.records()) {
        if (record.stored) EXPECT_EQ(reader.read(record).size(), record.nbytes());
      }
      (void)reader.modules();
      (void)reader.graphs();
    }
  }
  EXPECT_EQ(versions, (std::set<std::string>{"1.2", "1.4"}));
}

TEST(RoundTrip, NegativeAndHighZstdLevels) {
  for (int level : {-5, 1, 19}) {
    WriterOptions options;
    options.zstd_level = level;
    std::vector<Written> tensors;
    tensors.push_back(make("x", DType::kFloat32, {2048, 33}, 11));
    expect_round_trip(tensors, options);
  }
}

// bfloat16 activations (Gaussian values of one scale): their shuffled exponent bytes take about a
// third of the bytes they fill, their mantissa bytes do not compress. At zstd's fast levels only
// Huffman-coded literals shrink the exponents (by 1.006x without them: stored as they are); the
// default level and a user's negative level both store such a tensor compressed.
TEST(RoundTrip, FloatExponentsAreCompressedAtFastZstdLevels) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::byte> values(2 * (std::size_t{1} << 20));  // 1M bfloat16: two 1 MiB chunks
  for (std::size_t i = 0; i < values.size() / 2; ++i) {
    const auto bits = std::bit_cast<std::uint32_t>(normal(rng));
    const auto rounded = static_cast<std::uint16_t>((bits + 0x8000u) >> 16);
    std::memcpy(values.data() + 2 * i, &rounded, 2);
  }
  for (int level : {kDefaultZstdLevel, -5}) {
    SCOPED_TRACE(level);
    TempDir dir;
    WriterOptions options;
    options.zstd_level = level;
    StepWriter writer(dir.path(), 0, {}, options);
    const Record record = make_record(0, "act", Kind::kFwdOutput, 0, Side::kEager, DType::kBFloat16,
                                      {1024, 1024}, values);
    writer.write(std::vector<Record>{record});
    const StepReader reader(writer.commit());
    const RecordInfo& info = *reader.find(record.key);
    EXPECT_LT(static_cast<double>(info.stored_bytes), static_cast<double>(values.size()) / 1.35);
    EXPECT_EQ(reader.read(info), values);
  }
}

TEST(RoundTrip, AGraphWithAReservedAttributeIsRefusedBeforeAnythingIsWritten) {
  TempDir dir;
  StepWriter writer(dir.path(), 0, {});
  const Graph bad{"g", "forward", "text", {{"kind", "backward"}}};
  EXPECT_THROW(writer.write_graph(bad), UsageError);
  // Nothing of it was written: the same name can still be written, correctly.
  writer.write_graph({"g", "forward", "text", {}});
  const auto graphs = StepReader(writer.commit()).graphs();
  ASSERT_EQ(graphs.size(), 1u);
  EXPECT_EQ(graphs[0].kind, "forward");
}

TEST(RoundTrip, KeysLabelsGraphsAndProvenance) {
  TempDir dir;
  const auto data = random_bytes(64, 3);
  std::vector<Record> records;
  for (std::uint32_t call = 0; call < 2; ++call) {
    for (Side side : {Side::kEager, Side::kCompiled}) {
      Record r =
          make_record(4, "layers.0.mlp", Kind::kGradInput, 1, side, DType::kFloat32, {16}, data);
      r.key.call = call;
      r.label = "grad of x";
      records.push_back(r);
    }
  }
  records.push_back(make_record(4, std::string(kLossModule), Kind::kLoss, 0, Side::kCompiled,
                                DType::kFloat32, {}, data));
  StepWriter writer(dir.path(), 4, {{"backend", "aot_eager"}, {"rank", "1"}});
  writer.write(records);
  writer.write_graph({"__compiled_fn_3.Forward_Graph.0a1b2c3d",
                      "forward",
                      "def forward(x):\n  return x\n",
                      {{"modules", "layers.0.mlp"}}});
  // Written out of name order: readers must list modules in the order they were written.
  writer.write_module({"layers.1", {{"role", "ignored"}}});
  writer.write_module({"layers.0.mlp", {{"role", "wrapped"}, {"graph_breaks", "0"}}});
  EXPECT_THROW(writer.write_module({"layers.1", {}}), UsageError);
  const auto path = writer.commit();

  StepReader reader(path);
  EXPECT_EQ(reader.step(), 4);
  EXPECT_EQ(reader.format_version(), "2.0");
  EXPECT_EQ(reader.provenance(), (Provenance{{"backend", "aot_eager"}, {"rank", "1"}}));
  EXPECT_EQ(reader.records().size(), 5u);
  for (const Record& r : records) {
    const RecordInfo* info = reader.find(r.key);
    ASSERT_NE(info, nullptr) << to_string(r.key);
    EXPECT_EQ(info->label, r.label);
  }
  const auto graphs = reader.graphs();
  ASSERT_EQ(graphs.size(), 1u);
  EXPECT_EQ(graphs[0].name, "__compiled_fn_3.Forward_Graph.0a1b2c3d");
  EXPECT_EQ(graphs[0].kind, "forward");
  EXPECT_EQ(graphs[0].text, "def forward(x):\n  return x\n");
  EXPECT_EQ(graphs[0].attributes.at("modules"), "layers.0.mlp");
  const auto modules = reader.modules();
  ASSERT_EQ(modules.size(), 2u);
  EXPECT_EQ(modules[0].module, "layers.1");
  EXPECT_EQ(modules[0].attributes, (std::map<std::string, std::string>{{"role", "ignored"}}));
  EXPECT_EQ(modules[1].module, "layers.0.mlp");
  EXPECT_EQ(modules[1].attributes.at("graph_breaks"), "0");
}

TEST(RoundTrip, StreamingDeliversChunksInElementOrder) {
  TempDir dir;
  const auto data = random_bytes(4 << 20, 9, true);
  WriterOptions options;
  options.chunk_bytes = 64 << 10;
  StepWriter writer(dir.path(), 0, {}, options);
  writer.write(
      make_record(0, "x", Kind::kFwdInput, 0, Side::kEager, DType::kFloat32, {1 << 20}, data));
  StepReader reader(writer.commit());
  const TensorStream stream = reader.open(reader.records().at(0));
  EXPECT_EQ(stream.chunk_count(), 64u);
  std::uint64_t expected_first = 0;
  stream_chunks(stream, [&](ChunkExtent extent, const std::byte* chunk) {
    EXPECT_EQ(extent.first_element, expected_first);
    EXPECT_EQ(std::memcmp(chunk, data.data() + extent.first_element * 4, extent.element_count * 4),
              0);
    expected_first += extent.element_count;
  });
  EXPECT_EQ(expected_first, 1u << 20);
}

TEST(RoundTrip, TensorLargerThanTwoGiB) {
  TempDir dir;
  const std::uint64_t bytes = (std::uint64_t{2} << 30) + 12345;
  std::vector<std::byte> data(bytes);
  for (std::uint64_t i = 0; i < bytes; ++i)
    data[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  {
    StepWriter writer(dir.path(), 0, {});
    writer.write(make_record(0, "big", Kind::kFwdOutput, 0, Side::kCompiled, DType::kUInt8,
                             {static_cast<std::int64_t>(bytes)}, data));
    writer.commit();
  }
  StepReader reader(dir.path() / step_file_name(0));
  const auto back = reader.read(reader.records().at(0));
  ASSERT_EQ(back.size(), bytes);
  EXPECT_EQ(std::memcmp(back.data(), data.data(), bytes), 0);
}

TEST(RoundTrip, RejectsBadKeys) {
  TempDir dir;
  const auto data = random_bytes(16, 1);
  StepWriter writer(dir.path(), 0, {});
  auto record = make_record(0, "a/b", Kind::kFwdInput, 0, Side::kEager, DType::kFloat32, {4}, data);
  EXPECT_THROW(writer.write(record), UsageError);
  record.key.module = "a";
  record.key.step = 1;
  EXPECT_THROW(writer.write(record), UsageError);
  record.key.step = 0;
  writer.write(record);
  EXPECT_THROW(writer.write(record), UsageError);  // duplicate key
}

}  // namespace
}  // namespace dynaprobe::formats

namespace dynaprobe::formats {
namespace {

TEST(RoundTrip, NiceWriterKeepsTheCallersPriority) {
  // A capture writer runs its work at a lower priority; the calling (training) thread must come
  // out of write() with the priority it went in with.
  testing::TempDir dir;
  const auto data = testing::random_bytes(4 << 20, 5, true);
  WriterOptions options;
  options.nice = 7;
  options.chunk_bytes = 64 << 10;
  const int before = getpriority(PRIO_PROCESS, 0);
  StepWriter writer(dir.path(), 0, {}, options);
  writer.write(testing::make_record(0, "x", Kind::kFwdOutput, 0, Side::kEager, DType::kFloat32,
                                    {1 << 20}, data));
  EXPECT_EQ(getpriority(PRIO_PROCESS, 0), before);
  StepReader reader(writer.commit());
  const auto back = reader.read(reader.records().at(0));
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

}  // namespace
}  // namespace dynaprobe::formats

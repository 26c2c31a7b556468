// The write pipeline's stages that need no HDF5 (formats/src/chunk_pipeline.h), called directly:
// the order of the items and what compressing a chunk stores.
#include "chunk_pipeline.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/schema.h"
#include "test_util.h"

namespace dynaprobe::formats {
namespace {

Record float_record(std::vector<std::int64_t> shape, const void* data) {
  Record record;
  record.tensor = {DType::kFloat32, std::move(shape), data};
  return record;
}

WritePlan chunked(const Record& record, std::size_t chunk_bytes) {
  return {&record, ChunkLayout::plan(record.tensor.shape, 4, chunk_bytes)};
}

// HDF5 stores an edge chunk at full size, padded: the layout avoids edge chunks where a division
// of the rows allows, and keeps their padding small where it does not, with chunks of at most the
// target and no more chunks than a quarter above the fewest that fit.
TEST(ChunkLayoutPlan, ChunksFitTheTargetAndEdgeChunksCarryLittlePadding) {
  // A GPT-2 MLP weight's gradient: 12 chunks of 256 rows instead of 9 of 341 and one of 3.
  const ChunkLayout mlp = ChunkLayout::plan({3072, 768}, 4, 1 << 20);
  EXPECT_EQ(mlp.chunk_dims(), (std::vector<hsize_t>{256, 768}));
  EXPECT_EQ(mlp.chunk_count(), 12u);
  // A vocabulary of 50,257 rows (29 x 1733) has no such division: 148 chunks of 340 rows, the last
  // of 277 (341 rows per chunk would leave 130 rows in a chunk of 341).
  const ChunkLayout vocabulary = ChunkLayout::plan({50257, 768}, 4, 1 << 20);
  EXPECT_EQ(vocabulary.chunk_dims(), (std::vector<hsize_t>{340, 768}));
  EXPECT_EQ(vocabulary.extent(147).element_count, 277u * 768);

  constexpr std::uint64_t kInner = 7, kTargetElements = 64;  // at most 9 rows per chunk
  for (std::int64_t rows = 1; rows <= 3000; ++rows) {
    SCOPED_TRACE("rows " + std::to_string(rows));
    const ChunkLayout layout = ChunkLayout::plan({rows, kInner}, 4, kTargetElements * 4);
    const std::uint64_t fewest = (rows + 8) / 9;
    EXPECT_LE(layout.chunk_elements(), kTargetElements);
    EXPECT_GE(layout.chunk_count(), fewest);
    EXPECT_LE(layout.chunk_count(), fewest + fewest / 4);
    std::uint64_t next = 0;
    for (std::size_t chunk = 0; chunk < layout.chunk_count(); ++chunk) {
      const ChunkExtent extent = layout.extent(chunk);
      EXPECT_EQ(extent.first_element, next);
      next += extent.element_count;
      if (chunk + 1 < layout.chunk_count()) {
        EXPECT_EQ(extent.element_count, layout.chunk_elements());
      }
    }
    EXPECT_EQ(next, static_cast<std::uint64_t>(rows) * kInner);
    const std::uint64_t padding_rows =
        (layout.chunk_count() * layout.chunk_elements() - next) / kInner;
    EXPECT_LT(padding_rows, layout.chunk_count());
  }
}

// Every chunk of every record in order; a record without chunks is one item, first and last.
TEST(ChunkSequence, ItemsAreEveryChunkOfEveryRecordInOrder) {
  const std::vector<float> values(10, 1.0f);
  const Record three = float_record({10}, values.data());  // 16-byte chunks: 3 of them
  const Record scalar = float_record({}, values.data());
  const Record one = float_record({2}, values.data());
  const std::vector<WritePlan> plans = {
      chunked(three, 16), {&scalar, std::nullopt}, chunked(one, 16)};
  ChunkSequence sequence(plans);
  struct Expected {
    const WritePlan* plan;
    std::size_t chunk;
    bool has_chunk, first, last;
  };
  const Expected expected[] = {{&plans[0], 0, true, true, false},
                               {&plans[0], 1, true, false, false},
                               {&plans[0], 2, true, false, true},
                               {&plans[1], 0, false, true, true},
                               {&plans[2], 0, true, true, true}};
  for (const Expected& e : expected) {
    const std::optional<ChunkItem> item = sequence.next();
    ASSERT_TRUE(item);
    EXPECT_EQ(item->plan, e.plan);
    EXPECT_EQ(item->chunk, e.chunk);
    EXPECT_EQ(item->has_chunk, e.has_chunk);
    EXPECT_EQ(item->first, e.first);
    EXPECT_EQ(item->last, e.last);
    EXPECT_EQ(item->buffers, nullptr);
  }
  EXPECT_FALSE(sequence.next());
  EXPECT_FALSE(sequence.next());
}

ChunkItem first_item(const std::vector<WritePlan>& plans, ChunkBuffers& buffers) {
  ChunkSequence sequence(plans);
  ChunkItem item = *sequence.next();
  item.buffers = &buffers;
  return item;
}

// A compressible chunk is shuffled and zstd-compressed; decoding the payload gives the bytes back.
TEST(CompressChunk, CompressibleChunkIsShuffledAndCompressed) {
  std::vector<float> values(4096);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 7);
  const Record record = float_record({4096}, values.data());
  const std::vector<WritePlan> plans = {chunked(record, 1 << 20)};
  ChunkBuffers buffers;
  ChunkItem item = first_item(plans, buffers);
  compress_chunk(item, 1, 1.25);
  EXPECT_EQ(item.filter_mask, 0u);
  EXPECT_LT(item.payload_size, values.size() * 4 / 2);
  EXPECT_EQ(item.payload, buffers.compressed.data());
  EXPECT_EQ(item.payload_hash, xxh3(item.payload, item.payload_size));
  std::vector<std::byte> shuffled(values.size() * 4), decoded(values.size() * 4);
  ASSERT_EQ(ZSTD_decompress(shuffled.data(), shuffled.size(), item.payload, item.payload_size),
            shuffled.size());
  unshuffle_bytes(shuffled.data(), decoded.data(), decoded.size(), 4);
  EXPECT_EQ(std::memcmp(decoded.data(), values.data(), decoded.size()), 0);
}

// Bytes zstd cannot shrink enough are stored as they are, both filters skipped, hashed for
// /chunk_hashes; a partial edge chunk is zero-padded to the full chunk size.
TEST(CompressChunk, IncompressibleEdgeChunkIsStoredAsItIsZeroPadded) {
  const std::vector<std::byte> random = testing::random_bytes(4 * 1901, 7);
  const Record record = float_record({1901}, random.data());  // prime: an edge chunk is needed
  const std::vector<WritePlan> plans = {chunked(record, 4 * 1000)};  // 951 + 950 elements
  ASSERT_EQ(plans[0].layout->chunk_count(), 2u);
  ChunkSequence sequence(plans);
  sequence.next();
  ChunkItem edge = *sequence.next();
  ChunkBuffers buffers;
  edge.buffers = &buffers;
  compress_chunk(edge, 1, 1.25);
  EXPECT_EQ(edge.filter_mask, schema::kAllFiltersSkipped);
  ASSERT_EQ(edge.payload_size, 4u * 951);
  EXPECT_EQ(std::memcmp(edge.payload, random.data() + 4 * 951, 4 * 950), 0);
  const std::vector<std::byte> zeros(4 * 1);
  EXPECT_EQ(std::memcmp(edge.payload + 4 * 950, zeros.data(), zeros.size()), 0);
  EXPECT_EQ(edge.payload_hash, xxh3(edge.payload, edge.payload_size));
}

// Format 2.0: a compressed chunk of several has its hash too (zstd's content checksum covers the
// decompressed bytes only after decompressing them).
TEST(CompressChunk, CompressedChunkOfSeveralIsHashedToo) {
  const std::vector<float> zeros(2000, 0.0f);
  const Record record = float_record({2000}, zeros.data());
  const std::vector<WritePlan> plans = {chunked(record, 4 * 1000)};
  ChunkBuffers buffers;
  ChunkItem item = first_item(plans, buffers);
  compress_chunk(item, 1, 1.25);
  EXPECT_EQ(item.filter_mask, 0u);
  EXPECT_EQ(item.payload_hash, xxh3(item.payload, item.payload_size));
}

TEST(CompressChunk, ItemWithoutAChunkIsLeftAsItIs) {
  const float value = 1.0f;
  const Record record = float_record({}, &value);
  const std::vector<WritePlan> plans = {{&record, std::nullopt}};
  ChunkSequence sequence(plans);
  ChunkItem item = *sequence.next();
  compress_chunk(item, 1, 1.25);
  EXPECT_EQ(item.payload, nullptr);
  EXPECT_EQ(item.payload_size, 0u);
}

}  // namespace
}  // namespace dynaprobe::formats

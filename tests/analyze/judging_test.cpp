// Judging in memory (analyze/judging.h) gives the engine's metrics bit for bit, and the engine
// takes the metrics a capture stored, re-judges only what the stored tensors allow, and says so
// when they do not.
#include "dynaprobe/analyze/judging.h"

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/writer.h"
#include "formats/test_util.h"

namespace dynaprobe::analyze {
namespace {

using formats::DType;
using formats::Kind;
using formats::Side;
using formats::testing::TempDir;

std::vector<float> noise(std::size_t n, std::uint32_t seed, float scale = 1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> values(n);
  for (auto& v : values) v = scale * normal(rng);
  return values;
}

formats::Record record(Side side, std::vector<std::int64_t> shape, const void* data,
                       DType dtype = DType::kFloat32, Kind kind = Kind::kFwdOutput) {
  formats::Record r;
  r.key = {0, "layers.0", 0, kind, 0, side};
  r.tensor = {dtype, std::move(shape), data};
  return r;
}

const formats::Provenance kSinglePass = {
    {"mode", "single_pass"}, {"atol", "0.0001"}, {"rtol", "0.001"}};

std::vector<std::uint16_t> to_bfloat16(const std::vector<float>& values) {
  std::vector<std::uint16_t> half(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &values[i], 4);
    half[i] = static_cast<std::uint16_t>(bits >> 16);  // truncated
  }
  return half;
}

// Sums in the same order: equal bits (NaN included, where a metric is not computed).
void expect_same_metrics(const TensorMetrics& x, const TensorMetrics& y) {
  EXPECT_EQ(x.elements, y.elements);
  EXPECT_EQ(std::memcmp(&x.max_abs, &y.max_abs, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&x.mean_abs, &y.mean_abs, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&x.rmse, &y.rmse, sizeof(double)), 0);
  EXPECT_EQ(x.rms_eager, y.rms_eager);
  EXPECT_EQ(x.rms_compiled, y.rms_compiled);
  EXPECT_EQ(std::memcmp(&x.cosine, &y.cosine, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&x.max_rel, &y.max_rel, sizeof(double)), 0);
  EXPECT_EQ(x.mismatches, y.mismatches);
  EXPECT_EQ(x.nan_eager, y.nan_eager);
  EXPECT_EQ(x.inf_compiled, y.inf_compiled);
  EXPECT_EQ(x.worst_index, y.worst_index);
  EXPECT_EQ(x.histogram, y.histogram);
  EXPECT_EQ(x.allclose, y.allclose);
}

TEST(Judging, InMemoryMetricsAreTheEnginesBitForBit) {
  // Several chunks per side, and a bfloat16 side whose chunks hold twice the elements: the
  // accumulation order is the engine's only if the chunking is reproduced.
  const std::size_t n = 3 * 65536 + 123;
  const auto eager = noise(n, 1);
  auto compiled = eager;
  for (std::size_t i = 0; i < n; ++i) compiled[i] *= 1 + 1e-2f * static_cast<float>(i % 7);
  const auto compiled_half = to_bfloat16(compiled);
  TempDir dir;
  formats::WriterOptions options;
  options.chunk_bytes = 64 << 10;
  {
    formats::StepWriter writer(dir.path(), 0, kSinglePass, options);
    writer.write(record(Side::kEager, {static_cast<std::int64_t>(n)}, eager.data()));
    writer.write(record(Side::kCompiled, {static_cast<std::int64_t>(n)}, compiled_half.data(),
                        DType::kBFloat16));
    writer.commit();
  }
  CompareOptions compare_options;
  const Comparison from_dump = compare(dir.path(), dir.path(), compare_options);
  ASSERT_EQ(from_dump.steps.at(0).rows.size(), 1u);
  const TensorMetrics& expected = *from_dump.steps[0].rows[0].metrics;

  const formats::TensorView a{DType::kFloat32, {static_cast<std::int64_t>(n)}, eager.data()};
  const formats::TensorView b{
      DType::kBFloat16, {static_cast<std::int64_t>(n)}, compiled_half.data()};
  const Tolerances tolerances = dump_judging(kSinglePass, dir.path())
                                    .row_tolerances("layers.0", Kind::kFwdOutput, a.dtype, b.dtype);
  const TensorMetrics got = compare_in_memory(a, b, tolerances, options.chunk_bytes);
  expect_same_metrics(got, expected);
  EXPECT_FALSE(got.allclose);
  // Its chunks are compared on every thread of the caller's arena: one thread, the same bits.
  tbb::task_arena one_thread(1);
  expect_same_metrics(
      one_thread.execute([&] { return compare_in_memory(a, b, tolerances, options.chunk_bytes); }),
      got);
}

TEST(Judging, APairAndItsReferenceComparedTogetherGiveTheBitsOfThreeComparisons) {
  // A float32 reference of gradients at a real scale (1e-3), a bfloat16 pair that differs from
  // it by rounding and in a few elements by more, over several chunks, with a NaN and an
  // infinity: the fused comparison (the pair's chunks drive all three) and, with a float32 eager
  // side whose chunks differ from the compiled side's, the comparisons apart.
  const std::size_t n = 5 * 65536 + 77;
  auto reference = noise(n, 3, 1e-3f);
  auto eager = reference, compiled = reference;
  const auto jitter = noise(n, 4, 1e-5f);
  for (std::size_t i = 0; i < n; i += 97) compiled[i] += jitter[i];
  for (std::size_t i = 5; i < n; i += 89) eager[i] -= jitter[i];
  compiled[70001] = std::numeric_limits<float>::quiet_NaN();
  eager[200003] = std::numeric_limits<float>::infinity();
  const auto eager_half = to_bfloat16(eager), compiled_half = to_bfloat16(compiled);
  const std::vector<std::int64_t> shape = {static_cast<std::int64_t>(n)};
  const formats::TensorView r{DType::kFloat32, shape, reference.data()};
  const formats::TensorView c{DType::kBFloat16, shape, compiled_half.data()};
  const Tolerances tolerances{1e-5, 1.6e-2};
  const std::size_t chunk_bytes = 64 << 10;
  for (const formats::TensorView& e :
       {formats::TensorView{DType::kBFloat16, shape, eager_half.data()},
        formats::TensorView{DType::kFloat32, shape, eager.data()}}) {
    SCOPED_TRACE(formats::dtype_name(e.dtype));
    const ReferenceComparisons together =
        compare_with_reference_in_memory(e, c, r, tolerances, chunk_bytes);
    expect_same_metrics(together.pair, compare_in_memory(e, c, tolerances, chunk_bytes));
    expect_same_metrics(together.reference_eager,
                        compare_in_memory(r, e, tolerances, chunk_bytes, MetricSet::kVerdict));
    expect_same_metrics(together.reference_compiled,
                        compare_in_memory(r, c, tolerances, chunk_bytes, MetricSet::kVerdict));
    EXPECT_FALSE(together.pair.allclose);
    EXPECT_EQ(together.reference_compiled.nan_compiled, 1u);
    EXPECT_GT(together.reference_eager.mismatches, 0u);
    // A pair judged before: only its reference comparisons, the same bits.
    const ReferenceComparisons without_pair =
        compare_with_reference_in_memory(e, c, r, tolerances, chunk_bytes, false);
    EXPECT_EQ(without_pair.pair.elements, 0u);
    expect_same_metrics(without_pair.reference_compiled, together.reference_compiled);
  }
}

// A dump as PrecisionChecker(dump="stats") writes it: index rows and metrics, no tensors.
void write_stats_dump(const std::filesystem::path& dir, const formats::StoredMetrics& metrics) {
  formats::StepWriter writer(dir, 0, kSinglePass);
  const std::vector<formats::Record> records = {record(Side::kEager, {4, 8}, nullptr),
                                                record(Side::kCompiled, {4, 8}, nullptr)};
  writer.describe(records);
  writer.write_metrics(std::span(&metrics, 1));
  writer.commit();
}

formats::StoredMetrics passing_metrics() {
  formats::StoredMetrics stored;
  stored.key = {0, "layers.0", 0, Kind::kFwdOutput, 0, Side::kCompiled};
  stored.tolerances = {1e-4, 1e-3};
  stored.metrics.max_abs = 3e-5;
  stored.metrics.elements = 32;
  stored.metrics.worst_index = 17;
  stored.metrics.histogram[0] = 30;  // exact zeros
  stored.metrics.histogram[5] = 2;
  return stored;
}

TEST(Judging, StatsDumpReadsBackItsMetricsAndNoTensor) {
  TempDir dir;
  write_stats_dump(dir.path(), passing_metrics());
  const formats::StepReader reader(dir.path() / formats::step_file_name(0));
  ASSERT_EQ(reader.records().size(), 2u);
  for (const auto& info : reader.records()) {
    EXPECT_FALSE(info.stored);
    EXPECT_EQ(info.shape, (std::vector<std::int64_t>{4, 8}));
    EXPECT_THROW(reader.open(info), FormatError);
  }
  ASSERT_EQ(reader.stored_metrics().size(), 1u);
  EXPECT_EQ(reader.stored_metrics()[0].key.module, "layers.0");
  EXPECT_EQ(reader.stored_metrics()[0].metrics.worst_index, 17);
  EXPECT_EQ(reader.stored_metrics()[0].metrics.histogram, passing_metrics().metrics.histogram);

  const Comparison result = compare(dir.path(), dir.path(), CompareOptions{});
  const Row& row = result.steps.at(0).rows.at(0);
  EXPECT_EQ(row.status, Status::kPass);
  EXPECT_EQ(row.metrics->max_abs, 3e-5);
  EXPECT_TRUE(result.all_pass());
}

TEST(Judging, WiderTolerancesKeepAPassNarrowerOnesNeedTheTensors) {
  TempDir dir;
  write_stats_dump(dir.path(), passing_metrics());
  CompareOptions wider;
  wider.atol = 1e-3;
  EXPECT_EQ(compare(dir.path(), dir.path(), wider).steps.at(0).rows.at(0).status, Status::kPass);
  CompareOptions narrower;
  narrower.atol = 1e-6;
  try {
    compare(dir.path(), dir.path(), narrower);
    FAIL() << "judging a stats dump with narrower tolerances must be refused";
  } catch (const UsageError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("did not store their tensors"), std::string::npos) << message;
    EXPECT_NE(message.find("layers.0 fwd_output[0]"), std::string::npos) << message;
    // Tolerances as the report spells them (RESULT: ... atol=1e-4 rtol=1e-3).
    EXPECT_NE(message.find("judged at capture with atol=1e-4 rtol=1e-3, asked for atol=1e-6 "),
              std::string::npos)
        << message;
  }
}

TEST(Judging, EngineTakesStoredMetricsAndRecomputeChecksThemAgainstTheTensors) {
  // Stored metrics that disagree with the stored tensors (as a damaged or forged /metrics
  // would): compare() reports them, recompute reports the tensors' own.
  const std::vector<float> a = {1, 2, 3, 4}, b = {1, 2, 3, 5};
  TempDir dir;
  {
    formats::StepWriter writer(dir.path(), 0, kSinglePass);
    writer.write(record(Side::kEager, {4}, a.data()));
    writer.write(record(Side::kCompiled, {4}, b.data()));
    formats::StoredMetrics stored = passing_metrics();
    writer.write_metrics(std::span(&stored, 1));
    writer.commit();
  }
  EXPECT_EQ(compare(dir.path(), dir.path(), {}).steps.at(0).rows.at(0).status, Status::kPass);
  CompareOptions recompute;
  recompute.recompute = true;
  const Row row = compare(dir.path(), dir.path(), recompute).steps.at(0).rows.at(0);
  EXPECT_EQ(row.status, Status::kFail);
  EXPECT_EQ(row.metrics->max_abs, 1.0);
}

TEST(Judging, MetricsOfARecordNotInTheStepAreRefused) {
  TempDir dir;
  formats::StepWriter writer(dir.path(), 0, kSinglePass);
  const formats::StoredMetrics stored = passing_metrics();
  writer.write_metrics(std::span(&stored, 1));
  EXPECT_THROW(writer.commit(), UsageError);
}

TEST(Judging, RowTolerancesApplyTheFloorThenTheLastMatchingRule) {
  Judging judging;
  judging.rules = {{"layers.*", {1, 2}}, {"grad_*", {3, 4}}};
  EXPECT_EQ(
      judging.row_tolerances("head", Kind::kFwdOutput, DType::kFloat32, DType::kBFloat16).rtol,
      1.6e-2);
  EXPECT_EQ(
      judging.row_tolerances("layers.0", Kind::kGradInput, DType::kFloat32, DType::kFloat32).atol,
      3);
  EXPECT_EQ(
      judging.row_tolerances("layers.0", Kind::kFwdOutput, DType::kFloat32, DType::kFloat32).atol,
      1);
}

// Dumps written by the Python capture hold Python's repr of each tolerance: the text stays the
// same now that the capture hands the tolerances over typed and C++ writes them.
TEST(Judging, ToleranceTextIsPythonsReprOfTheFloat) {
  const std::vector<std::pair<double, std::string>> cases = {
      {1e-5, "1e-05"},
      {1e-4, "0.0001"},
      {1e-3, "0.001"},
      {1.6e-2, "0.016"},
      {0.1, "0.1"},
      {0.125, "0.125"},
      {1.0, "1.0"},
      {0.0, "0.0"},
      {100.0, "100.0"},
      {1e15, "1000000000000000.0"},
      {1e16, "1e+16"},
      {123456789012345678.0, "1.2345678901234568e+17"},
      {12345.678, "12345.678"},
      {5e-324, "5e-324"},
      {1.5e-7, "1.5e-07"}};
  for (const auto& [value, text] : cases) EXPECT_EQ(tolerance_text(value), text) << text;
}

TEST(Judging, ProvenanceWrittenFromAJudgingReadsBackAsIt) {
  Judging judging;
  judging.tolerances = {1e-4, 1e-3};
  judging.rules = {{"layers.*.mlp", {1e-3, 1e-2}}, {"grad_*", {1.0, 0.0}}};
  judging.dtype_aware = false;
  const formats::Provenance provenance = judging_provenance(judging);
  EXPECT_EQ(provenance,
            (formats::Provenance{{"atol", "0.0001"},
                                 {"rtol", "0.001"},
                                 {"tolerance_rules", "0.001 0.01 layers.*.mlp\n1.0 0.0 grad_*\n"},
                                 {"dtype_aware_tolerances", "false"}}));
  const Judging read = dump_judging(provenance, "dump");
  EXPECT_EQ(read.tolerances.atol, judging.tolerances.atol);
  EXPECT_EQ(read.tolerances.rtol, judging.tolerances.rtol);
  ASSERT_EQ(read.rules.size(), 2u);
  EXPECT_EQ(read.rules[1].pattern, "grad_*");
  EXPECT_EQ(read.rules[0].tolerances.rtol, 1e-2);
  EXPECT_FALSE(read.dtype_aware);
  EXPECT_EQ(judging_provenance(Judging{}).at("tolerance_rules"), "");
}

TEST(Judging, ProvenanceOfAnInvalidJudgingIsRefused) {
  Judging negative;
  negative.tolerances.atol = -1;
  EXPECT_THROW(judging_provenance(negative), UsageError);
  Judging not_a_number;
  not_a_number.rules = {{"m", {NAN, 0}}};
  EXPECT_THROW(judging_provenance(not_a_number), UsageError);
  Judging two_lines;
  two_lines.rules = {{"a\nb", {0, 0}}};
  EXPECT_THROW(judging_provenance(two_lines), UsageError);
}

}  // namespace
}  // namespace dynaprobe::analyze

#include "dynaprobe/analyze/metrics.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace dynaprobe::analyze {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Block {
  float max_abs = 0;
  float max_rel = 0;
  float max_ratio = 0;
  double sum_abs = 0;
  double sum_squares = 0;
  double dot = 0;
  double norm_a = 0;
  double norm_b = 0;
  std::uint64_t mismatches = 0;
  std::uint64_t nan_diff = 0;
  std::uint64_t nan_unequal = 0;  // NaN differences of unequal elements (not equal infinities)
  std::uint64_t nan_rel = 0;
  std::uint64_t nan_ratio = 0;
  std::uint64_t nan_a = 0;
  std::uint64_t nan_b = 0;
  std::uint64_t inf_a = 0;
  std::uint64_t inf_b = 0;
  std::uint64_t nonfinite_only_b = 0;
};

// The hot loop: branch-free, so it vectorises (checked with -fopt-info-vec); built for AVX-512,
// AVX2 and baseline x86-64, picked at run time (AVX-512: 1.07 against 1.37 ns an element with
// AVX2 on bf16-rounded gradients, docs/performance.md). Each build sums its double lanes in its own
// order, so the last bits of the sums depend on the machine, never on the number of threads.
// Arithmetic is float32 like torch's on float32 tensors; sums are double. NaNs never enter the
// max/sum lanes: they are counted and applied afterwards.
__attribute__((target_clones("avx512f", "avx2", "default"))) void compare_block(
    const float* a, const float* b, std::size_t n, float atol, float rtol, Block& out) {
  float max_abs = 0, max_rel = 0, max_ratio = 0;
  double sum_abs = 0, sum_squares = 0, dot = 0, norm_a = 0, norm_b = 0;
  std::uint64_t mismatches = 0, nan_diff = 0, nan_unequal = 0, nan_rel = 0, nan_ratio = 0,
                nan_a = 0, nan_b = 0, inf_a = 0, inf_b = 0, nonfinite_only_b = 0;
#pragma omp simd reduction(max : max_abs, max_rel, max_ratio)                                   \
    reduction(+ : sum_abs, sum_squares, dot, norm_a, norm_b, mismatches, nan_diff, nan_unequal, \
                  nan_rel, nan_ratio, nan_a, nan_b, inf_a, inf_b, nonfinite_only_b)
  for (std::size_t i = 0; i < n; ++i) {
    const float x = a[i];
    const float y = b[i];
    const float diff = std::fabs(x - y);
    const float rel = diff / (std::fabs(x) + 1e-8f);
    const bool diff_is_nan = diff != diff;
    const bool rel_is_nan = rel != rel;
    // torch.isclose: equal, or a finite error within atol + |rtol * b|.
    const float allowed = atol + std::fabs(rtol * y);
    const bool close = (x == y) | ((diff < kInf) & (diff <= allowed));
    // The error in units of the allowed one: above 1 exactly when not close. Equal elements
    // (equal infinities too, whose difference is NaN) are 0; an infinite difference stays inf
    // (inf / inf would be NaN); a NaN difference otherwise is NaN.
    const float ratio = x == y ? 0.0f : diff < kInf ? diff / allowed : diff;
    const bool ratio_is_nan = ratio != ratio;
    const float finite_ratio = ratio_is_nan ? 0.0f : ratio;
    max_ratio = finite_ratio > max_ratio ? finite_ratio : max_ratio;
    const float finite_diff = diff_is_nan ? 0.0f : diff;
    max_abs = finite_diff > max_abs ? finite_diff : max_abs;
    const float finite_rel = rel_is_nan ? 0.0f : rel;
    max_rel = finite_rel > max_rel ? finite_rel : max_rel;
    const double d = finite_diff;
    sum_abs += d;
    sum_squares += d * d;
    const bool a_nan = x != x, b_nan = y != y;
    const bool a_inf = std::fabs(x) == kInf, b_inf = std::fabs(y) == kInf;
    // The norms and their dot product are over finite elements: an infinity on both sides
    // (log(0) in T5's position buckets) would make every rms infinite.
    const double finite_x = (a_nan | a_inf) ? 0.0 : x, finite_y = (b_nan | b_inf) ? 0.0 : y;
    dot += finite_x * finite_y;
    norm_a += finite_x * finite_x;
    norm_b += finite_y * finite_y;
    mismatches += !close;
    nan_diff += diff_is_nan;
    nan_unequal += diff_is_nan & !(x == y);
    nan_rel += rel_is_nan;
    nan_ratio += ratio_is_nan;
    nan_a += a_nan;
    nan_b += b_nan;
    inf_a += a_inf;
    inf_b += b_inf;
    nonfinite_only_b += (b_nan | b_inf) & !(a_nan | a_inf);
  }
  out = {max_abs,   max_rel, max_ratio,  sum_abs,  sum_squares, dot,
         norm_a,    norm_b,  mismatches, nan_diff, nan_unequal, nan_rel,
         nan_ratio, nan_a,   nan_b,      inf_a,    inf_b,       nonfinite_only_b};
}

// compare_block for blocks whose inputs are all finite, the usual case. With finite inputs no
// difference or ratio is NaN and every NaN/Inf counter is zero, so only two counters remain:
// mismatches and `nonfinite` (elements with a NaN or Inf input; when it is not zero the caller
// discards this result and runs compare_block). Fewer accumulators fit in the 16 vector registers
// of AVX2: compare_block's 8 uint64 counters take 16 registers on their own, and the spills made
// it 35% of a large comparison's time (AVX-512 has 32). The loop body is compare_block's, minus
// what finite inputs make constant, so both vectorise alike (same lanes, same order of the double
// sums) and give the same bits; counters are 32-bit, so n must be below 2^32.
__attribute__((target_clones("avx512f", "avx2", "default"))) std::uint64_t compare_finite_block(
    const float* a, const float* b, std::size_t n, float atol, float rtol, Block& out) {
  float max_abs = 0, max_rel = 0, max_ratio = 0;
  double sum_abs = 0, sum_squares = 0, dot = 0, norm_a = 0, norm_b = 0;
  std::uint32_t mismatches = 0, nonfinite = 0;
#pragma omp simd reduction(max : max_abs, max_rel, max_ratio) \
    reduction(+ : sum_abs, sum_squares, dot, norm_a, norm_b, mismatches, nonfinite)
  for (std::size_t i = 0; i < n; ++i) {
    const float x = a[i];
    const float y = b[i];
    const float diff = std::fabs(x - y);
    const float rel = diff / (std::fabs(x) + 1e-8f);
    const float allowed = atol + std::fabs(rtol * y);
    const bool close = (x == y) | ((diff < kInf) & (diff <= allowed));
    const float ratio = x == y ? 0.0f : diff < kInf ? diff / allowed : diff;
    max_abs = diff > max_abs ? diff : max_abs;
    max_rel = rel > max_rel ? rel : max_rel;
    max_ratio = ratio > max_ratio ? ratio : max_ratio;
    const double d = diff;
    sum_abs += d;
    sum_squares += d * d;
    dot += static_cast<double>(x) * y;
    norm_a += static_cast<double>(x) * x;
    norm_b += static_cast<double>(y) * y;
    mismatches += !close;
    nonfinite += !((std::fabs(x) < kInf) & (std::fabs(y) < kInf));
  }
  out = {max_abs, max_rel, max_ratio, sum_abs, sum_squares, dot, norm_a, norm_b, mismatches};
  return nonfinite;
}

// compare_finite_block for MetricSet::kVerdict: the largest difference, the elements outside
// tolerance, the squared differences and each side's squares, on finite inputs. Returns the number
// of elements with a NaN or Inf input; when it is not zero the caller discards this result and
// runs compare_block.
__attribute__((target_clones("avx512f", "avx2", "default"))) std::uint64_t verdict_finite_block(
    const float* a, const float* b, std::size_t n, float atol, float rtol, Block& out) {
  float max_abs = 0;
  double sum_squares = 0, norm_a = 0, norm_b = 0;
  std::uint32_t mismatches = 0, nonfinite = 0;
#pragma omp simd reduction(max : max_abs) \
    reduction(+ : sum_squares, norm_a, norm_b, mismatches, nonfinite)
  for (std::size_t i = 0; i < n; ++i) {
    const float x = a[i];
    const float y = b[i];
    const float diff = std::fabs(x - y);
    const float allowed = atol + std::fabs(rtol * y);
    mismatches += !((x == y) | ((diff < kInf) & (diff <= allowed)));
    max_abs = diff > max_abs ? diff : max_abs;
    const double d = diff;
    sum_squares += d * d;
    norm_a += static_cast<double>(x) * x;
    norm_b += static_cast<double>(y) * y;
    nonfinite += !((std::fabs(x) < kInf) & (std::fabs(y) < kInf));
  }
  out = {};
  out.max_abs = max_abs;
  out.sum_squares = sum_squares;
  out.norm_a = norm_a;
  out.norm_b = norm_b;
  out.mismatches = mismatches;
  return nonfinite;
}

// Whether element i is the one searched for: its difference is NaN (kNaN) or equals `target`.
template <bool kNaN>
__attribute__((always_inline)) inline bool is_match(const float* a, const float* b, std::size_t i,
                                                    float target) {
  const float diff = std::fabs(a[i] - b[i]);
  return kNaN ? diff != diff : diff == target;
}

// The first element that is_match(), or n. A scalar loop with an early exit does not vectorise and
// cost 2% of a large comparison (it runs on every chunk), so blocks of 64 elements are tested with
// vector code first and only the block that holds the element is searched element by element.
template <bool kNaN>
__attribute__((always_inline)) inline std::size_t find_first_impl(const float* a, const float* b,
                                                                  std::size_t n, float target) {
  constexpr std::size_t kBlock = 64;
  std::size_t start = 0;
  for (; start + kBlock <= n; start += kBlock) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (std::size_t i = start; i < start + kBlock; ++i) hit |= is_match<kNaN>(a, b, i, target);
    if (hit) break;
  }
  for (std::size_t i = start; i < n; ++i) {
    if (is_match<kNaN>(a, b, i, target)) return i;
  }
  return n;
}

__attribute__((target_clones("avx2", "default"))) std::size_t find_first(const float* a,
                                                                         const float* b,
                                                                         std::size_t n, bool nan,
                                                                         float target) {
  return nan ? find_first_impl<true>(a, b, n, target) : find_first_impl<false>(a, b, n, target);
}

// The histogram bin of each |a - b| (metrics.h): from the float32 exponent field e of the
// difference, 2 + (e - e0) / 2 where e0 is the field of the first edge (4^-20 = 2^-40), clamped to
// "below the first edge" and "at or above the last"; 0 for zero, kNanBin for NaN. Integer
// operations only, so it vectorises. The histogram's three passes are built for AVX-512 (with its
// byte instructions: x86-64-v4) as well as AVX2: judging a pair in memory with every metric took
// 8-10% less time on an AVX-512 machine (docs/performance.md); integer counts, the same bits.
constexpr std::int32_t kFirstEdgeExponent = 127 + 2 * kHistogramFirstPower;
constexpr std::uint8_t kNanBin = kHistogramBins;
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) void histogram_bins(
    const float* a, const float* b, std::size_t n, std::uint8_t* bins) {
  for (std::size_t i = 0; i < n; ++i) {
    const float diff = std::fabs(a[i] - b[i]);
    const std::uint32_t bits = std::bit_cast<std::uint32_t>(diff);
    const auto exponent = static_cast<std::int32_t>(bits >> 23);
    std::int32_t bin = 2 + ((exponent - kFirstEdgeExponent) >> 1);
    bin = bin < 1 ? 1 : bin;
    bin = bin > static_cast<std::int32_t>(kHistogramBins) - 1 ? kHistogramBins - 1 : bin;
    bin = bits == 0 ? 0 : bin;
    bin = diff != diff ? kNanBin : bin;
    bins[i] = static_cast<std::uint8_t>(bin);
  }
}

// How many of the n bytes are `bin`, n a multiple of 32 and at most 255 * 32: one byte counter
// per vector lane, which cannot overflow, so the compiler compares and counts 32 bins at a time.
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) std::uint32_t count_bin(
    const std::uint8_t* bins, std::size_t n, std::uint8_t bin) {
  std::uint8_t lanes[32] = {};
  for (std::size_t i = 0; i < n; i += 32) {
    for (std::size_t k = 0; k < 32; ++k) lanes[k] += bins[i + k] == bin;
  }
  std::uint32_t total = 0;
  for (std::uint8_t count : lanes) total += count;
  return total;
}

// The smallest bin other than 0 (exact zeros) and the largest bin among n bins; with all 0, low
// is 0 and high 0.
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) void nonzero_bin_range(
    const std::uint8_t* bins, std::size_t n, std::uint8_t& low, std::uint8_t& high) {
  // bin - 1 wraps 0 round to 255: a plain minimum, which vectorises (a test of bin != 0 did not).
  std::uint8_t lo = 255, hi = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto below = static_cast<std::uint8_t>(bins[i] - 1);
    lo = below < lo ? below : lo;
    hi = bins[i] > hi ? bins[i] : hi;
  }
  low = static_cast<std::uint8_t>(lo + 1);  // 0 when all are 0
  high = hi;
}

// Adds |a - b| of n elements to `histogram`, block by block: the bins of a block, then a count of
// each bin between the block's smallest other than 0 and its largest, and the exact zeros as what
// is left. Most differences of a compiled run are zeros; counting every bin from 0 up took 13% of
// comparing bf16-rounded data that differs in 1 element of 64 (a ulp spans 7 bins, the range 16).
// All vector code. Measured on 1 MiB tensors in cache, accumulate() took 1.6 times as long as
// without the histogram; one scalar increment per element (four interleaved tables) took 1.9
// times, and half-decade bins through a table by exponent 3.1 times (on 4 MiB tensors).
void add_histogram(const float* a, const float* b, std::size_t n, Histogram& histogram) {
  constexpr std::size_t kBlock = 32 * 255;
  alignas(32) std::uint8_t bins[kBlock];
  for (std::size_t start = 0; start < n; start += kBlock) {
    const std::size_t m = std::min(kBlock, n - start);
    histogram_bins(a + start, b + start, m, bins);
    const std::size_t padded = (m + 31) / 32 * 32;
    std::fill(bins + m, bins + padded, std::uint8_t{0});  // zeros are never counted
    std::uint8_t low = 0, high = 0;
    nonzero_bin_range(bins, m, low, high);
    std::size_t counted = 0;  // NaN differences (kNanBin) included: they are not zeros
    for (unsigned bin = std::max<unsigned>(low, 1); bin <= high; ++bin) {
      const std::uint32_t count = count_bin(bins, padded, static_cast<std::uint8_t>(bin));
      if (bin < kHistogramBins) histogram[bin] += count;
      counted += count;
    }
    histogram[0] += m - counted;
  }
}

}  // namespace

float histogram_edge(std::size_t i) {
  if (i >= kHistogramEdges) {
    throw std::out_of_range("histogram_edge: expected an index below kHistogramEdges");
  }
  return std::ldexp(1.0f, 2 * (kHistogramFirstPower + static_cast<int>(i)));
}

void MetricsAccumulator::accumulate(const float* a, const float* b, std::size_t n,
                                    std::uint64_t first_index, const Tolerances& tolerances) {
  if (n == 0) return;
  Block block;
  const auto atol = static_cast<float>(tolerances.atol);
  const auto rtol = static_cast<float>(tolerances.rtol);
  const bool all = set_ == MetricSet::kAll;
  if (n >= (std::uint64_t{1} << 32) ||
      (all ? compare_finite_block(a, b, n, atol, rtol, block)
           : verdict_finite_block(a, b, n, atol, rtol, block)) != 0) {
    compare_block(a, b, n, atol, rtol, block);
  }
  // The worst element of this block: the first NaN difference, else the first maximum. Only
  // searched when it can beat the current worst, which is rare after the first blocks.
  const bool have_nan_worst = worst_index_ >= 0 && worst_diff_ != worst_diff_;
  MetricsAccumulator partial(set_);
  if (all && (block.nan_diff > 0 || block.max_abs > worst_diff_ || worst_index_ < 0)) {
    if (!have_nan_worst) {
      const std::size_t i = find_first(a, b, n, block.nan_diff > 0, block.max_abs);
      if (i < n) {
        partial.worst_index_ = static_cast<std::int64_t>(first_index + i);
        partial.worst_a_ = a[i];
        partial.worst_b_ = b[i];
        partial.worst_diff_ = std::fabs(a[i] - b[i]);
      }
    }
  }
  if (all) add_histogram(a, b, n, partial.histogram_);
  partial.count_ = n;
  partial.max_abs_ = block.max_abs;
  partial.max_rel_ = block.max_rel;
  partial.max_ratio_ = block.max_ratio;
  partial.sum_abs_ = block.sum_abs;
  partial.sum_squares_ = block.sum_squares;
  partial.dot_ = block.dot;
  partial.norm_a_ = block.norm_a;
  partial.norm_b_ = block.norm_b;
  partial.mismatches_ = block.mismatches;
  partial.nan_diff_ = block.nan_diff;
  partial.nan_unequal_ = block.nan_unequal;
  partial.nan_rel_ = block.nan_rel;
  partial.nan_ratio_ = block.nan_ratio;
  partial.nan_a_ = block.nan_a;
  partial.nan_b_ = block.nan_b;
  partial.inf_a_ = block.inf_a;
  partial.inf_b_ = block.inf_b;
  partial.nonfinite_only_b_ = block.nonfinite_only_b;
  merge(partial);
}

void MetricsAccumulator::merge(const MetricsAccumulator& other) {
  if (other.worst_index_ >= 0) {
    const bool mine_nan = worst_index_ >= 0 && worst_diff_ != worst_diff_;
    const bool theirs_nan = other.worst_diff_ != other.worst_diff_;
    // Worst = NaN before any number, then larger difference, then smaller index: the result does
    // not depend on the order partials are merged in.
    bool take = worst_index_ < 0;
    if (!take && theirs_nan != mine_nan) take = theirs_nan;
    if (!take && theirs_nan == mine_nan) {
      take = (!mine_nan && other.worst_diff_ > worst_diff_) ||
             ((mine_nan || other.worst_diff_ == worst_diff_) && other.worst_index_ < worst_index_);
    }
    if (take) {
      worst_index_ = other.worst_index_;
      worst_a_ = other.worst_a_;
      worst_b_ = other.worst_b_;
      worst_diff_ = other.worst_diff_;
    }
  }
  count_ += other.count_;
  max_abs_ = std::fmax(max_abs_, other.max_abs_);
  max_rel_ = std::fmax(max_rel_, other.max_rel_);
  max_ratio_ = std::fmax(max_ratio_, other.max_ratio_);
  sum_abs_ += other.sum_abs_;
  sum_squares_ += other.sum_squares_;
  dot_ += other.dot_;
  norm_a_ += other.norm_a_;
  norm_b_ += other.norm_b_;
  mismatches_ += other.mismatches_;
  nan_diff_ += other.nan_diff_;
  nan_unequal_ += other.nan_unequal_;
  nan_rel_ += other.nan_rel_;
  nan_ratio_ += other.nan_ratio_;
  nan_a_ += other.nan_a_;
  nan_b_ += other.nan_b_;
  inf_a_ += other.inf_a_;
  inf_b_ += other.inf_b_;
  nonfinite_only_b_ += other.nonfinite_only_b_;
  for (std::size_t bin = 0; bin < kHistogramBins; ++bin) histogram_[bin] += other.histogram_[bin];
}

TensorMetrics MetricsAccumulator::result() const {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  TensorMetrics m;
  m.elements = count_;
  m.max_abs = nan_diff_ ? kNaN : max_abs_;
  // torch's mean of a float32 tensor is a float32.
  m.mean_abs = nan_diff_ ? kNaN
               : count_  ? static_cast<float>(sum_abs_ / static_cast<double>(count_))
                         : 0.0;
  m.max_rel = nan_rel_ ? kNaN : max_rel_;
  m.max_tol_ratio = nan_ratio_ ? kNaN : max_ratio_;
  m.allclose = mismatches_ == 0;
  m.cosine = norm_a_ == 0 && norm_b_ == 0 ? 1.0 : dot_ / std::sqrt(norm_a_ * norm_b_);
  const auto rms = [&](double sum_squares) {
    return count_ ? std::sqrt(sum_squares / static_cast<double>(count_)) : 0.0;
  };
  // Equal elements differ by 0, equal infinities too (their difference is NaN, as the spec's
  // abs(a - b).max() has it): the rmse is NaN only where a NaN makes two elements unequal.
  m.rmse = nan_unequal_ ? kNaN : rms(sum_squares_);
  m.rms_eager = rms(norm_a_);
  m.rms_compiled = rms(norm_b_);
  m.mismatches = mismatches_;
  m.nan_eager = nan_a_;
  m.nan_compiled = nan_b_;
  m.inf_eager = inf_a_;
  m.inf_compiled = inf_b_;
  m.nonfinite_only_compiled = nonfinite_only_b_;
  m.worst_index = worst_index_;
  m.worst_eager = worst_a_;
  m.worst_compiled = worst_b_;
  m.histogram = histogram_;
  if (set_ == MetricSet::kVerdict) {  // what it did not compute (metrics.h)
    m.mean_abs = m.max_rel = m.max_tol_ratio = m.cosine = kNaN;
  }
  return m;
}

}  // namespace dynaprobe::analyze

// How a row is judged: the tolerances of a step and of each row, and a pair's metrics computed
// from tensors in memory exactly as the engine computes them from a dump. The engine judges dumps
// with it, and the capture judges rows in memory with it (PrecisionChecker(dump="failing" or
// "stats")), so that both reach the same verdict, bit for bit.
#pragma once

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dynaprobe/analyze/metrics.h"
#include "dynaprobe/formats/metrics.h"
#include "dynaprobe/formats/record.h"

namespace dynaprobe::analyze {

// Tolerances for the rows a pattern selects: shell-style glob matched against the module
// ("layers.*.mlp"), the check type ("grad_*") or the report's row name ("layers.0.grad_input").
// The last matching rule wins.
struct ToleranceRule {
  std::string pattern;
  Tolerances tolerances;
};

// The dtype-aware floor (docs/user-guide.md, Tolerances): a row whose lower-precision side is
// bfloat16, float16 or a float8 is judged with tolerances at least these (bf16: atol 1e-2, rtol
// 1.6e-2; fp16: 1e-3, 2e-3; float8 e4m3: 0.125, 0.25; e5m2: 0.25, 0.5, about one and two of the
// dtype's steps at magnitude 1); float32 and float64 keep the spec's. Zeros for those.
Tolerances dtype_tolerance_floor(formats::DType dtype);

// A tolerance must be a finite number >= 0: NaN would fail every element and infinity pass
// every one, silently.
bool valid_tolerance(double value);

struct Judging {
  Tolerances tolerances;  // the step's
  std::vector<ToleranceRule> rules;
  bool dtype_aware = true;
  bool reference_decides = true;  // a row's reference verdict decides its status

  // What a row is judged with: the step's tolerances, raised to the dtype-aware floor of either
  // side, then the last rule whose pattern matches it.
  Tolerances row_tolerances(const std::string& module, formats::Kind kind, formats::DType eager,
                            formats::DType compiled) const;
  // The fp32 screen of a row without a reference verdict: the largest relative error
  // (relative_error) that is fp32 noise, max(relative_screen, the step's rtol: what the tolerances
  // allow relative to a value, asked of the whole tensor). NaN, no screen, unless the reference
  // decides (verdict="reference"), the row is float32 or float64 and no rule of the user's
  // matches it (a rule is the user's own word on that row).
  double screen(const std::string& module, formats::Kind kind, formats::DType eager,
                formats::DType compiled) const;
  // Whether a row that the tolerances pass FAILs as beyond fp32 noise: its relative error is
  // beyond its screen, and it is not at the rounding level of its module: its magnitude above
  // kRoundingLevel times `module_magnitude`, the largest rms_eager of the module's rows in the
  // same pass (a gradient that is mathematically zero, such as attention's key bias, is pure
  // rounding noise of its module's arithmetic: 100% "relative" error). 0: not known (each row by
  // itself, as the capture judges).
  bool beyond_screen(const std::string& module, formats::Kind kind, formats::DType eager,
                     formats::DType compiled, const TensorMetrics& metrics,
                     double module_magnitude = 0) const;
};

// The judging a dump's provenance asks for (atol, rtol, tolerance_rules, dtype_aware_tolerances,
// verdict),
// each value given here replacing the dump's, which is then not read (so a damaged one can be
// replaced). Throws FormatError naming `dump` for a damaged value.
Judging dump_judging(const formats::Provenance& provenance, const std::filesystem::path& dump,
                     std::optional<double> atol = std::nullopt,
                     std::optional<double> rtol = std::nullopt,
                     std::optional<bool> dtype_aware = std::nullopt,
                     std::optional<bool> reference_decides = std::nullopt);

// The provenance entries dump_judging reads `judging` back from: atol, rtol, tolerance_rules and
// dtype_aware_tolerances (the verdict stays the writer's word). A capture given typed tolerances
// (capture::RecorderOptions::judging) writes them with this, so that a dump's text is formatted in
// this one place. Throws UsageError for a tolerance that is not a finite number >= 0, or a rule
// pattern that is empty or holds a line break.
formats::Provenance judging_provenance(const Judging& judging);

// A tolerance as provenance stores it: the shortest text that reads back as the same double, in
// the form of Python's repr(float) ("0.001", "1e-05", "1.0", "1e+16"), the text dumps have always
// held.
std::string tolerance_text(double value);

// The noise rule (docs/guide/diagnosis.md, "Is it noise? The reference decides"), the one judge of
// the module rows, the op rows of `bisect --ops` and the capture's in-memory judging. Every term is
// relative to the tensors judged, so that multiplying a loss (or a linear module's inputs) by any
// constant changes no verdict:
//   noise      = max(rmse(reference, eager), max(roundoff, kLibraryRoundoff) * rms(reference))
//   units      = rmse(reference, compiled) / noise     (the report's "N x noise")
//   divergence = units > kReferenceFactor, or NaN/Inf in compiled where eager has none
// `roundoff` is the unit roundoff of the dtype the call computes in: the floor is one rounding of
// that dtype at the reference's magnitude, for rows that eager gets exactly, and never below
// kLibraryRoundoff (math libraries' vectorised erf, exp, tanh are accurate to a few float32 ulps,
// inductor's as eager's: in float32 their difference, not the rounding, is the noise).
inline constexpr double kReferenceFactor = 2.0;
inline constexpr double kLibraryRoundoff = 0x1p-21;  // 8 float32 roundings

// The unit roundoff of a dtype (half its machine epsilon): bfloat16 2^-8, float16 2^-11,
// float32 2^-24, float64 2^-53, the float8s 2^-4 (e4m3) and 2^-3 (e5m2); 0 for others.
double unit_roundoff(formats::DType dtype);
// The unit roundoff of a torch dtype's name ("torch.bfloat16", as a capture's cast_dtype and
// autocast say it); 0 for a name it does not know.
double unit_roundoff_of_name(std::string_view torch_dtype);

// A row's noise against its reference, and its compiled error in units of it.
struct NoiseMeasure {
  double noise = 0;  // max(eager's own RMSE, the floor)
  double units = 0;  // compiled RMSE / noise: 0 when both are 0, inf when only noise is
  bool divergence = false;
};
// The rule on both sides' metrics against the reference (reference = a, eager or compiled = b).
// A reference magnitude not stored (a dump from before rms_eager) takes the step's atol / 20 as
// the floor: an absolute one, as such dumps were judged.
NoiseMeasure measure_noise(const TensorMetrics& reference_eager,
                           const TensorMetrics& reference_compiled, double roundoff,
                           double step_atol);

// The relative error of a row, rmse / rms(eager): what the fp32 screen (Judging::screen, measured
// on the suite: docs/guide/diagnosis.md) holds a float32 row without a reference to. NaN when it
// cannot be told: eager all zeros, or a dump without rms_eager.
inline constexpr double kRelativeScreenRoundings = 0x1p12;  // of float32: about 2.4e-4
inline constexpr double kRoundingLevel = 0x1p-14;           // 2^10 float32 roundings
double relative_error(const TensorMetrics& metrics);
// kRelativeScreenRoundings float32 roundings for a row whose sides are float32 or float64 (real
// or complex); NaN (no screen) for others: reduced precision, integers, bool.
double relative_screen(formats::DType eager, formats::DType compiled);

// Single-pass records a fwd_input and a grad_output once, for both sides (the eager re-run gets
// the very inputs and grad_output of the compiled call): such a record is compared with itself.
bool recorded_once(formats::Kind kind, bool single_pass);

// The metrics of two tensors in memory (same element count, any dtypes), as the engine computes
// them from a dump written with this chunk_bytes: the same chunks, merged in the same order, so
// the same bits.
TensorMetrics compare_in_memory(const formats::TensorView& eager,
                                const formats::TensorView& compiled, const Tolerances& tolerances,
                                std::size_t chunk_bytes, MetricSet set = MetricSet::kAll);

// The comparisons of a pair with its reference, as compare_in_memory() computes each, the same
// bits: eager against compiled with every metric (`pair`; not computed, default, unless
// `with_pair`) and the reference against each side with the verdict's (MetricSet::kVerdict;
// `reference` is the first tensor of both). Where the three compare in the same chunks (the
// usual case: a wider reference has more chunks, so the pair's drive all three), each block of
// each tensor is read and converted once for the three, a third less time than three calls.
struct ReferenceComparisons {
  TensorMetrics pair, reference_eager, reference_compiled;
};
ReferenceComparisons compare_with_reference_in_memory(const formats::TensorView& eager,
                                                      const formats::TensorView& compiled,
                                                      const formats::TensorView& reference,
                                                      const Tolerances& tolerances,
                                                      std::size_t chunk_bytes,
                                                      bool with_pair = true);

// Whether metrics judged at capture with `stored.tolerances` are what judging with `tolerances`
// gives: the same tolerances, or wider ones for a pair that had no element outside the narrower
// (closeness only grows with atol and rtol).
bool stored_metrics_hold(const formats::StoredMetrics& stored, const Tolerances& tolerances);

}  // namespace dynaprobe::analyze

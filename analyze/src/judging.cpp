#include "dynaprobe/analyze/judging.h"

#include <fnmatch.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::analyze {
namespace fs = std::filesystem;
namespace vocabulary = formats::vocabulary;

namespace {

bool matches(const std::string& glob, const std::string& name) {
  return fnmatch(glob.c_str(), name.c_str(), 0) == 0;
}

// A rule matches a row by its module, its check type or its name ("layers.0.grad_input").
bool rule_matches(const ToleranceRule& rule, const std::string& module, formats::Kind kind) {
  const std::string kind_text(formats::kind_name(kind));
  return matches(rule.pattern, module) || matches(rule.pattern, kind_text) ||
         matches(rule.pattern, module + "." + kind_text);
}

// The dump's own tolerance (its provenance), if it has one. One that is not a valid tolerance is
// damage, reported as such rather than replaced by a default.
std::optional<double> dump_tolerance(const formats::Provenance& provenance,
                                     std::string_view key_name, const fs::path& dump) {
  const std::string key(key_name);
  auto found = provenance.find(key);
  if (found == provenance.end()) return std::nullopt;
  double value = NAN;
  const std::string& text = found->second;
  const auto parsed = std::from_chars(text.data(), text.data() + text.size(), value);
  if (parsed.ec != std::errc() || parsed.ptr != text.data() + text.size() ||
      !valid_tolerance(value)) {
    throw FormatError(dump.string() + ": provenance " + key + "=" + formats::quoted_name(text) +
                      " is not a finite number >= 0 (a damaged dump); `dynaprobe compare --" + key +
                      " X` judges it with a tolerance of your own");
  }
  return value;
}

// The dump's tolerance rules (PrecisionChecker(tolerances=...)): one rule a line,
// "<atol> <rtol> <pattern>". Damage is reported as such.
std::vector<ToleranceRule> dump_tolerance_rules(const formats::Provenance& provenance,
                                                const fs::path& dump) {
  std::vector<ToleranceRule> rules;
  const std::string text =
      formats::provenance_value(provenance, vocabulary::provenance::kToleranceRules);
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    ToleranceRule rule;
    const char* first = line.data();
    const char* last = line.data() + line.size();
    auto atol = std::from_chars(first, last, rule.tolerances.atol);
    auto rtol = atol.ec == std::errc() && atol.ptr < last && *atol.ptr == ' '
                    ? std::from_chars(atol.ptr + 1, last, rule.tolerances.rtol)
                    : std::from_chars_result{first, std::errc::invalid_argument};
    if (rtol.ec != std::errc() || rtol.ptr >= last || *rtol.ptr != ' ' ||
        !valid_tolerance(rule.tolerances.atol) || !valid_tolerance(rule.tolerances.rtol)) {
      throw FormatError(dump.string() + ": provenance tolerance_rules line " +
                        formats::quoted_name(line) +
                        " is not '<atol> <rtol> <pattern>' with tolerances >= 0");
    }
    rule.pattern = std::string(rtol.ptr + 1, last);
    rules.push_back(std::move(rule));
  }
  return rules;
}

}  // namespace

bool valid_tolerance(double value) { return std::isfinite(value) && value >= 0; }

Tolerances dtype_tolerance_floor(formats::DType dtype) {
  switch (dtype) {
    case formats::DType::kBFloat16:
      return {1e-2, 1.6e-2};
    case formats::DType::kFloat16:
    case formats::DType::kComplex32:  // float16 parts
      return {1e-3, 2e-3};
    case formats::DType::kFloat8E4M3FN:
    case formats::DType::kFloat8E4M3FNUZ:
      return {0.125, 0.25};
    case formats::DType::kFloat8E5M2:
    case formats::DType::kFloat8E5M2FNUZ:
      return {0.25, 0.5};
    default:
      return {0, 0};
  }
}

Tolerances Judging::row_tolerances(const std::string& module, formats::Kind kind,
                                   formats::DType eager, formats::DType compiled) const {
  Tolerances result = tolerances;
  if (dtype_aware) {
    for (const formats::DType dtype : {eager, compiled}) {
      const Tolerances floor = dtype_tolerance_floor(dtype);
      result.atol = std::max(result.atol, floor.atol);
      result.rtol = std::max(result.rtol, floor.rtol);
    }
  }
  for (const ToleranceRule& rule : rules) {
    if (rule_matches(rule, module, kind)) result = rule.tolerances;
  }
  return result;
}

double Judging::screen(const std::string& module, formats::Kind kind, formats::DType eager,
                       formats::DType compiled) const {
  const bool ruled = std::any_of(rules.begin(), rules.end(), [&](const ToleranceRule& rule) {
    return rule_matches(rule, module, kind);
  });
  if (!reference_decides || ruled) return NAN;
  return std::max(relative_screen(eager, compiled), tolerances.rtol);  // NaN stays NaN
}

bool Judging::beyond_screen(const std::string& module, formats::Kind kind, formats::DType eager,
                            formats::DType compiled, const TensorMetrics& metrics,
                            double module_magnitude) const {
  return relative_error(metrics) > screen(module, kind, eager, compiled) &&
         metrics.rms_eager > kRoundingLevel * module_magnitude;
}

Judging dump_judging(const formats::Provenance& provenance, const fs::path& dump,
                     std::optional<double> atol, std::optional<double> rtol,
                     std::optional<bool> dtype_aware, std::optional<bool> reference_decides) {
  Judging judging;
  judging.tolerances.atol = atol ? *atol
                                 : dump_tolerance(provenance, vocabulary::provenance::kAtol, dump)
                                       .value_or(judging.tolerances.atol);
  judging.tolerances.rtol = rtol ? *rtol
                                 : dump_tolerance(provenance, vocabulary::provenance::kRtol, dump)
                                       .value_or(judging.tolerances.rtol);
  judging.rules = dump_tolerance_rules(provenance, dump);
  judging.dtype_aware = dtype_aware.value_or(
      formats::provenance_value(provenance, vocabulary::provenance::kDtypeAwareTolerances) !=
      "false");
  judging.reference_decides = reference_decides.value_or(
      formats::provenance_value(provenance, vocabulary::provenance::kVerdict) != "tolerances");
  return judging;
}

std::string tolerance_text(double value) {
  if (!std::isfinite(value)) return std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf";
  // std::to_chars gives the shortest round-trip digits, as Python's repr does; Python writes them
  // in fixed notation for decimal exponents -4 to 15 (an integer with ".0"), in scientific
  // notation with a two-digit exponent otherwise, as to_chars does.
  char buffer[32];
  char* end =
      std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::scientific).ptr;
  const std::string scientific(buffer, end);  // "[-]d[.ddd]e(+|-)XX"
  const std::size_t e = scientific.find('e');
  const int exponent = std::atoi(scientific.c_str() + e + 1);
  if (exponent < -4 || exponent >= 16) return scientific;
  const bool negative = scientific.front() == '-';
  std::string digits = scientific.substr(negative ? 1 : 0, e - (negative ? 1 : 0));
  if (digits.size() > 1) digits.erase(1, 1);  // the '.'
  const std::string sign = negative ? "-" : "";
  if (exponent < 0) return sign + "0." + std::string(-exponent - 1, '0') + digits;
  const std::size_t point = static_cast<std::size_t>(exponent) + 1;
  if (digits.size() <= point) {
    return sign + digits + std::string(point - digits.size(), '0') + ".0";
  }
  return sign + digits.substr(0, point) + "." + digits.substr(point);
}

formats::Provenance judging_provenance(const Judging& judging) {
  const auto checked = [](const std::string& name, double value) {
    if (!valid_tolerance(value)) {
      throw UsageError(name + " must be a finite number >= 0, but received " +
                       tolerance_text(value));
    }
    return tolerance_text(value);
  };
  formats::Provenance provenance;
  provenance[std::string(vocabulary::provenance::kAtol)] = checked("atol", judging.tolerances.atol);
  provenance[std::string(vocabulary::provenance::kRtol)] = checked("rtol", judging.tolerances.rtol);
  std::string rules;  // one a line, "<atol> <rtol> <pattern>", as dump_tolerance_rules reads them
  for (const ToleranceRule& rule : judging.rules) {
    if (rule.pattern.empty() || rule.pattern.find('\n') != std::string::npos) {
      throw UsageError("a tolerance rule's pattern must be a non-empty line, but received " +
                       formats::quoted_name(rule.pattern));
    }
    const std::string name = "tolerance rule " + formats::quoted_name(rule.pattern);
    rules += checked(name + " atol", rule.tolerances.atol) + " " +
             checked(name + " rtol", rule.tolerances.rtol) + " " + rule.pattern + "\n";
  }
  provenance[std::string(vocabulary::provenance::kToleranceRules)] = std::move(rules);
  provenance[std::string(vocabulary::provenance::kDtypeAwareTolerances)] =
      judging.dtype_aware ? "true" : "false";
  return provenance;
}

double unit_roundoff(formats::DType dtype) {
  switch (dtype) {
    case formats::DType::kBFloat16:
      return 0x1p-8;
    case formats::DType::kFloat16:
    case formats::DType::kComplex32:
      return 0x1p-11;
    case formats::DType::kFloat32:
    case formats::DType::kComplex64:
      return 0x1p-24;
    case formats::DType::kFloat64:
    case formats::DType::kComplex128:
      return 0x1p-53;
    case formats::DType::kFloat8E4M3FN:
    case formats::DType::kFloat8E4M3FNUZ:
      return 0x1p-4;
    case formats::DType::kFloat8E5M2:
    case formats::DType::kFloat8E5M2FNUZ:
      return 0x1p-3;
    default:
      return 0;
  }
}

double unit_roundoff_of_name(std::string_view torch_dtype) {
  if (torch_dtype == "torch.bfloat16") return unit_roundoff(formats::DType::kBFloat16);
  if (torch_dtype == "torch.float16") return unit_roundoff(formats::DType::kFloat16);
  return 0;
}

NoiseMeasure measure_noise(const TensorMetrics& reference_eager,
                           const TensorMetrics& reference_compiled, double roundoff,
                           double step_atol) {
  NoiseMeasure measure;
  const double eager = reference_eager.rmse, compiled = reference_compiled.rmse;
  const double magnitude = reference_eager.rms_eager;  // the reference's (side a)
  const double floor = magnitude == formats::kMetricNotStored
                           ? step_atol / 20
                           : std::max(roundoff, kLibraryRoundoff) * magnitude;
  if (!std::isfinite(compiled)) {
    measure.noise = eager;
    measure.units = INFINITY;
    measure.divergence = true;
    return measure;
  }
  if (!std::isfinite(eager)) {  // eager has NaN/Inf and compiled none: it cannot be beaten
    measure.noise = eager;
    return measure;
  }
  measure.noise = std::max(eager, std::isfinite(floor) ? floor : 0.0);
  measure.units = compiled == 0 ? 0 : measure.noise > 0 ? compiled / measure.noise : INFINITY;
  measure.divergence = measure.units > kReferenceFactor;
  return measure;
}

double relative_error(const TensorMetrics& metrics) {
  const double magnitude = metrics.rms_eager;
  if (magnitude == formats::kMetricNotStored || !(magnitude > 0) || !std::isfinite(magnitude)) {
    return NAN;
  }
  return metrics.rmse / magnitude;
}

double relative_screen(formats::DType eager, formats::DType compiled) {
  const double roundoff = std::max(unit_roundoff(eager), unit_roundoff(compiled));
  if (roundoff == 0 || roundoff > unit_roundoff(formats::DType::kFloat32)) return NAN;
  return kRelativeScreenRoundings * unit_roundoff(formats::DType::kFloat32);
}

bool recorded_once(formats::Kind kind, bool single_pass) {
  return single_pass && (kind == formats::Kind::kFwdInput || kind == formats::Kind::kGradOutput);
}

bool stored_metrics_hold(const formats::StoredMetrics& stored, const Tolerances& tolerances) {
  const Tolerances& judged = stored.tolerances;
  if (judged.atol == tolerances.atol && judged.rtol == tolerances.rtol) return true;
  return stored.metrics.allclose && stored.metrics.mismatches == 0 &&
         tolerances.atol >= judged.atol && tolerances.rtol >= judged.rtol;
}

}  // namespace dynaprobe::analyze

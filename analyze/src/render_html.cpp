// The HTML report (docs/report-format.md#html): one self-contained page. The page's template
// (html/report.html: layout, style and the script that draws it) and Chart.js are compiled into
// the library (html/embed.cmake); the report model and each rank's graphs are embedded as
// gzip-compressed, base64-encoded JSON, so the page needs no file and no network when it is
// opened (the browser's own DecompressionStream unpacks it).
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/report_model.h"

namespace dynaprobe::analyze {
namespace html {
extern const std::string_view kTemplate;
extern const std::string_view kChartJs;
}  // namespace html

namespace {

constexpr std::string_view kChartMarker = "/*{{CHART_JS}}*/";
constexpr std::string_view kDataMarker = "{{DATA}}";

// gzip (RFC 1952) of `text`, as the browser's DecompressionStream("gzip") reads it. JSON of
// rows and graph code shrinks about 20 times: a report of 1,000 modules with their graphs is about
// 1 MB instead of 17.
std::string gzip(const std::string& text) {
  z_stream stream{};
  // windowBits 15 + 16: a gzip header and trailer instead of zlib's.
  if (deflateInit2(&stream, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw std::runtime_error("zlib: deflateInit2 failed");
  }
  std::string out(deflateBound(&stream, text.size()), '\0');
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  stream.avail_in = static_cast<uInt>(text.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  const int status = deflate(&stream, Z_FINISH);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  if (status != Z_STREAM_END) throw std::runtime_error("zlib: deflate did not finish");
  return out;
}

// RFC 4648 base64, as the browser's atob() reads it. Its alphabet has no '<', so the data can
// never close its <script> element, whatever text the dump holds.
std::string base64(const std::string& bytes) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (std::size_t i = 0; i < bytes.size(); i += 3) {
    const std::size_t n = std::min<std::size_t>(3, bytes.size() - i);
    std::uint32_t group = 0;
    for (std::size_t k = 0; k < 3; ++k) {
      group = (group << 8) | (k < n ? static_cast<unsigned char>(bytes[i + k]) : 0u);
    }
    for (std::size_t k = 0; k < 4; ++k) {
      out += k <= n ? kAlphabet[(group >> (18 - 6 * k)) & 63] : '=';
    }
  }
  return out;
}

// The template with the library and the data put in at their markers (the library's marker
// comes first). Both markers are found in the template before anything is put in, so neither the
// library nor the data can hold a marker that is replaced again.
std::string fill_template(std::string_view chart_js, const std::string& data) {
  const std::string_view page = html::kTemplate;
  const std::size_t chart = page.find(kChartMarker);
  const std::size_t at = page.find(kDataMarker, chart);
  std::string out(page.substr(0, chart));
  out += chart_js;
  out += page.substr(chart + kChartMarker.size(), at - chart - kChartMarker.size());
  out += data;
  out += page.substr(at + kDataMarker.size());
  return out;
}

// The page holds the whole run (its rows and each rank's graphs), so it is written at the end;
// until then the writer keeps every step it was given.
class HtmlWriter : public ReportWriter {
 public:
  explicit HtmlWriter(std::ostream& out) : out_(out) {}
  void add_step(const RankComparison& rank, const StepReport& step) override {
    if (ranks_.empty() || !open_) {
      RankComparison kept = rank;
      kept.comparison.steps.clear();
      ranks_.push_back(std::move(kept));
      open_ = true;
    }
    ranks_.back().comparison.steps.push_back(step);
  }
  void end_rank(const RankComparison& rank, bool) override {
    if (!open_) {
      ranks_.push_back(rank);
      ranks_.back().comparison.steps.clear();
    }
    ranks_.back().comparison.warnings = rank.comparison.warnings;
    open_ = false;
  }
  void finish(const RunTotals& totals) override {
    Value::Array graphs;  // per rank: {graph name: source text}
    for (const RankComparison& rank : ranks_) {
      Value::Object by_name;
      for (const formats::Graph& graph : rank.graphs) by_name.emplace_back(graph.name, graph.text);
      graphs.emplace_back(std::move(by_name));
    }
    // The verdict words, for the page's own labels ("rank 1 (FAILED)"): from report.h, not the
    // template's spelling.
    const Value verdicts = Value::Object{{"all_pass", kVerdictAllPass}, {"failed", kVerdictFailed}};
    const std::string data = "{\"report\": " + to_json(report_model(ranks_, totals)) +
                             ",\n\"graphs\": " + to_json(Value(std::move(graphs)), true) +
                             ",\n\"verdicts\": " + to_json(verdicts) + "}";
    out_ << fill_template(html::kChartJs, base64(gzip(data)));
    out_.flush();
  }

 private:
  std::ostream& out_;
  std::vector<RankComparison> ranks_;
  bool open_ = false;  // ranks_.back() is the rank being given
};

}  // namespace

std::unique_ptr<ReportWriter> open_html(std::ostream& out, const RunShape&) {
  return std::make_unique<HtmlWriter>(out);
}

}  // namespace dynaprobe::analyze

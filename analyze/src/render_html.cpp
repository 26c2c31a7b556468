// The HTML report (docs/report-format.md#html): one self-contained page. The page's template
// (html/report.html: layout, style and the script that draws it) and Chart.js are compiled into
// the library (html/embed.cmake); the report model and each rank's graphs are embedded as JSON,
// so the page needs no file and no network when it is opened.
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

// JSON inside a <script> element: a '<' only occurs inside strings, and written as \u003c it
// can never close the element ("</script>" in graph code) or open a comment.
std::string script_safe(const std::string& json) {
  std::string out;
  out.reserve(json.size());
  for (char c : json) {
    if (c == '<') {
      out += "\\u003c";
    } else {
      out += c;
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

}  // namespace

std::string render_html(const std::vector<RankComparison>& ranks) {
  Value::Array graphs;  // per rank: {graph name: source text}
  for (const RankComparison& rank : ranks) {
    Value::Object by_name;
    for (const formats::Graph& graph : rank.graphs) by_name.emplace_back(graph.name, graph.text);
    graphs.emplace_back(std::move(by_name));
  }
  const std::string data = "{\"report\": " + to_json(report_model(ranks)) +
                           ",\n\"graphs\": " + to_json(Value(std::move(graphs)), true) + "}";
  return fill_template(html::kChartJs, script_safe(data));
}

}  // namespace dynaprobe::analyze

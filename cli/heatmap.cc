// `qkv heatmap`: attention weights from a .npy file drawn as d2l's heatmaps
// through gnuplot (qkv::heatmaps). weights: (Nq, Nk) one panel, (B, Nq, Nk)
// B panels in a row, or (rows, cols, Nq, Nk) a grid; --out FIG.png|svg|pdf.
#include <CLI/CLI.hpp>
#include <memory>

#include "common.h"
#include "qkv/plot.h"

namespace qkv::cli {
namespace {

struct HeatmapArgs {
  std::string weights, out;
  std::string xlabel = "Keys", ylabel = "Queries", titles, cmap = "Reds";
};

std::vector<std::string> split_titles(const std::string& text) {
  std::vector<std::string> titles;
  if (text.empty()) return titles;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    titles.push_back(text.substr(start, comma - start));
    if (comma == std::string::npos) return titles;
    start = comma + 1;
  }
}

template <class T>
void draw(Tensor<T> weights, const Input& input, const std::string& out,
          const HeatmapOptions& options) {
  const Shape s = weights.shape();
  if (s.rank() == 2) {
    weights = std::move(weights).reshaped(Shape{1, 1, s[0], s[1]});
  } else if (s.rank() == 3) {
    weights = std::move(weights).reshaped(Shape{1, s[0], s[1], s[2]});
  } else if (s.rank() != 4) {
    throw UsageError(input.describe() + " has shape " + s.str() +
                     "; expected (Nq, Nk), (B, Nq, Nk) or (rows, cols, Nq, Nk)");
  }
  const int64_t cols = weights.size(1);
  if (!options.titles.empty() && static_cast<int64_t>(options.titles.size()) != cols) {
    throw UsageError("--titles has " + std::to_string(options.titles.size()) + " titles but " +
                     input.describe() + " of shape " + s.str() + " has " + std::to_string(cols) +
                     " column" + (cols == 1 ? "" : "s") + " of panels; give one title per column");
  }
  heatmaps(weights.view(), out, options);
}

void run_heatmap(const HeatmapArgs& args) {
  check_output_paths({{"--out", args.out}});
  HeatmapOptions options;
  options.xlabel = args.xlabel;
  options.ylabel = args.ylabel;
  options.titles = split_titles(args.titles);
  options.cmap = args.cmap;
  const Input input{"--weights", args.weights};
  FloatTensor weights = load_float(input);
  if (auto* f = std::get_if<Tensor<float>>(&weights)) {
    draw(std::move(*f), input, args.out, options);
  } else {
    draw(std::move(std::get<Tensor<double>>(weights)), input, args.out, options);
  }
}

}  // namespace

Command add_heatmap_command(CLI::App& parent) {
  auto args = std::make_shared<HeatmapArgs>();
  CLI::App* app = parent.add_subcommand(
      "heatmap", "Draw attention weights as heatmaps (d2l's show_heatmaps) with gnuplot");
  require_path(app->add_option("--weights", args->weights,
                               "Weights W.npy, float32 or float64: (Nq, Nk) one panel, (B, Nq, "
                               "Nk) B panels in a row, or (rows, cols, Nq, Nk)"))
      ->type_name("W.npy")
      ->required();
  app->add_option("--xlabel", args->xlabel, "Label under the bottom row")
      ->type_name("LABEL")
      ->capture_default_str();
  app->add_option("--ylabel", args->ylabel, "Label left of the first column")
      ->type_name("LABEL")
      ->capture_default_str();
  app->add_option("--titles", args->titles, "Comma-separated titles, one per column of panels")
      ->type_name("A,B,..");
  app->add_option("--cmap", args->cmap, "Colour map: Reds, Blues, viridis or gray")
      ->type_name("MAP")
      ->capture_default_str()
      ->check(CLI::IsMember({"Reds", "Blues", "viridis", "gray"}));
  require_path(
      app->add_option("--out", args->out,
                      "Output figure; the format follows the extension: .png, .svg or .pdf"))
      ->type_name("FIG.png|svg|pdf")
      ->required();
  set_help_footer(*app,
                  {"qkv heatmap --weights weights.npy --out weights.png",
                   "qkv heatmap --weights weights.npy --cmap viridis --titles softmax --out "
                   "weights.svg"},
                  "docs/cli.md#qkv-heatmap");
  return {app, [args] { run_heatmap(*args); }};
}

}  // namespace qkv::cli

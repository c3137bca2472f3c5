// Figures of the chapter, rendered by gnuplot (Debian gnuplot-nox) through a
// pipe: qkv writes the data and the script, gnuplot draws axes, ticks, fonts
// and colour bars. The format follows the path's extension: .png (pngcairo),
// .svg (svg) or .pdf (pdfcairo). Each figure is written to a temporary name
// beside `path` and renamed into place only when gnuplot succeeded.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "qkv/tensor.h"

namespace qkv {

// gnuplot is looked up on PATH. Missing, it is an Error naming the package to
// install ("gnuplot not found: install Debian package gnuplot-nox"); if it
// fails, the Error holds what it wrote on stderr.

struct HeatmapOptions {
  std::string xlabel = "Keys";              // under the bottom row only
  std::string ylabel = "Queries";           // left of the first column only
  std::vector<std::string> titles;          // empty, or one per column of panels
  std::array<double, 2> figsize{2.5, 2.5};  // inches per panel (width, height)
  std::string cmap = "Reds";  // Reds, Blues (white to dark), viridis, gray (black to white)
  bool colorbar = true;       // one colour bar for the whole grid
};

// d2l's show_heatmaps. matrices: (rows, cols, Nq, Nk), one panel per (row,
// col); queries run top to bottom, keys left to right. All panels share one
// colour range (the minimum to the maximum of all the values, which must be
// finite).
void heatmaps(ConstView<double> matrices, const std::string& path,
              const HeatmapOptions& options = {});
void heatmaps(ConstView<float> matrices, const std::string& path,
              const HeatmapOptions& options = {});

struct RegressionPlotOptions {
  std::array<double, 2> xlim{0.0, 5.0};
  std::array<double, 2> ylim{-1.0, 5.0};
  std::string xlabel = "x";
  std::string ylabel = "y";
  std::array<std::string, 2> labels{"Truth", "Pred"};  // legend of the two lines
  std::array<double, 2> figsize{3.5, 2.5};             // inches
};

// d2l §11.2's regression figure: the truth and the prediction as lines over
// x_test (all three (n)), the training points (x_train, y_train, both (m)) as
// translucent dots.
void plot_kernel_regression(ConstView<double> x_test, ConstView<double> truth,
                            ConstView<double> prediction, ConstView<double> x_train,
                            ConstView<double> y_train, const std::string& path,
                            const RegressionPlotOptions& options = {});
void plot_kernel_regression(ConstView<float> x_test, ConstView<float> truth,
                            ConstView<float> prediction, ConstView<float> x_train,
                            ConstView<float> y_train, const std::string& path,
                            const RegressionPlotOptions& options = {});

// The training curve: losses (n) against epochs (n).
void plot_loss(ConstView<double> epochs, ConstView<double> losses, const std::string& path);
void plot_loss(ConstView<float> epochs, ConstView<float> losses, const std::string& path);

}  // namespace qkv

// Figures of the chapter, rendered by gnuplot (Debian gnuplot-nox), run
// without a shell: qkv writes the data and the script to its stdin, gnuplot
// draws axes, ticks, fonts and colour bars to its stdout. The format follows
// the path's extension: .png (pngcairo), .svg (svg) or .pdf (pdfcairo). Each
// figure is a StagedFile (qkv/staged_file.h): written to a temporary file
// beside `path` and renamed into place only when gnuplot succeeded and the
// figure is complete (PNG ends with IEND, PDF with %%EOF, SVG with </svg>;
// gnuplot reports no failed write); a symlink's target is replaced, a device
// or FIFO written through.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "qkv/tensor.h"

namespace qkv {

// gnuplot is looked up on PATH. Missing, it is an Error naming the package to
// install ("gnuplot not found: install Debian package gnuplot-nox"); if it
// fails or writes an incomplete figure (a full disk), an IoError, holding what
// it wrote on stderr. Labels, titles and legend entries must be one line of
// UTF-8 text: a control character (a line end would end the gnuplot command
// and run the rest as the next) or bytes that are not UTF-8 are an Error.

// The gnuplot the figures run, the first on PATH (the same Error when there
// is none): for a program that checks before long work that it can draw.
std::string gnuplot_path();

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
// translucent dots. truth of shape [0] draws no truth line (a fit to data).
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

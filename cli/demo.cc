// `qkv demo`: the worked examples of d2l §11.1-11.3 run through the library on
// embedded data: a printed report, the chapter's figures (gnuplot PNGs) and an
// index.html that shows them all, written into one output folder. Random
// inputs are drawn from <random>, seeded by --seed.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numbers>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "qkv/kernel_regression.h"
#include "qkv/lookup.h"
#include "qkv/masked_softmax.h"
#include "qkv/modules.h"
#include "qkv/plot.h"
#include "qkv/version.h"

namespace qkv::cli {
namespace {

struct DemoArgs {
  uint64_t seed = 0;
  std::optional<int> threads;
  std::string out = "qkv-demo";
};

// Prints a (B, Nq, N) tensor one row per (b, i), labelled "b=0 q=1", with the
// numbers right-aligned in columns of one width.
void print_rows(std::ostream& os, ConstView<float> t) {
  size_t width = 0;
  for (int64_t b = 0; b < t.size(0); ++b) {
    for (int64_t i = 0; i < t.size(1); ++i) {
      for (int64_t j = 0; j < t.size(2); ++j)
        width = std::max(width, format_number(t(b, i, j), "%.4f").size());
    }
  }
  for (int64_t b = 0; b < t.size(0); ++b) {
    for (int64_t i = 0; i < t.size(1); ++i) {
      os << "     b=" << b << " q=" << i << ' ';
      for (int64_t j = 0; j < t.size(2); ++j) {
        const std::string x = format_number(t(b, i, j), "%.4f");
        os << std::string(width + 2 - x.size(), ' ') << x;
      }
      os << '\n';
    }
  }
}

Tensor<float> random_tensor(Shape shape, std::mt19937_64& rng, bool normal) {
  Tensor<float> t(shape);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  for (float& x : t.values()) x = normal ? gaussian(rng) : uniform(rng);
  return t;
}

// Everything written to the report goes to stdout as it is printed and is kept
// for index.html.
class TeeBuf : public std::streambuf {
 public:
  TeeBuf(std::ostream& first, std::ostringstream& second) : first_(first), second_(second) {}

 protected:
  int overflow(int c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    first_.put(static_cast<char>(c));
    second_.put(static_cast<char>(c));
    return first_ ? c : traits_type::eof();
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    first_.write(s, n);
    second_.write(s, n);
    return first_ ? n : 0;
  }
  int sync() override {
    first_.flush();
    return first_ ? 0 : -1;
  }

 private:
  std::ostream& first_;
  std::ostringstream& second_;
};

// One figure on the page: what it shows (its caption) and a sentence on what
// to see in it.
struct Figure {
  std::string file;
  std::string caption;
  std::string see;
};

// A numbered step of a section: the report's text for it beside its figures.
struct Step {
  size_t begin = 0;  // offsets into the report
  size_t end = 0;
  std::vector<Figure> figures;
  // Figures not shown because their file is byte for byte an earlier one:
  // the page says which, and why (`see`).
  std::vector<std::pair<Figure, std::string>> repeats;
};

struct Section {
  std::string title;
  std::vector<Step> steps;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// The walkthrough page as the report is printed: sections (11.1, 11.2, 11.3),
// each cut into steps at step(); a step's text is what the report printed
// between its step() and the next, and its figures are those added meanwhile.
// The "figure: FILE" lines go to stdout only, as the page shows the figure.
class Page {
 public:
  Page(std::filesystem::path dir, std::ostream& report, const std::ostringstream& kept)
      : dir_(std::move(dir)), report_(report), kept_(kept) {}
  std::string path(const std::string& file) const { return (dir_ / file).string(); }

  void section(const std::string& number, const std::string& title) {
    close_step();
    report_ << (sections_.empty() ? "" : "\n") << "d2l " << number << ' ' << title << "\n\n";
    sections_.push_back({number + ' ' + title, {}});
    step();
  }
  void step() {
    close_step();
    sections_.back().steps.push_back({offset(), offset(), {}, {}});
  }
  void figure(const std::string& file, const std::string& caption, const std::string& see) {
    std::cout << "   figure: " << file << '\n';
    Step& current = sections_.back().steps.back();
    const std::string bytes = read_bytes(path(file));
    for (const Section& s : sections_) {
      for (const Step& st : s.steps) {
        for (const Figure& f : st.figures) {
          if (read_bytes(path(f.file)) == bytes) {
            current.repeats.push_back({{file, caption, see}, f.file});
            return;
          }
        }
      }
    }
    current.figures.push_back({file, caption, see});
  }
  std::string html(const std::string& intro) {
    close_step();
    return page_html(intro);
  }

 private:
  size_t offset() const { return kept_.str().size(); }
  void close_step() {
    if (!sections_.empty() && !sections_.back().steps.empty())
      sections_.back().steps.back().end = offset();
  }
  std::string page_html(const std::string& intro) const;

  std::filesystem::path dir_;
  std::ostream& report_;
  const std::ostringstream& kept_;
  std::vector<Section> sections_;
};

std::string html_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Strips a text's leading and trailing blank lines.
std::string trim_lines(const std::string& text) {
  const size_t first = text.find_first_not_of('\n');
  if (first == std::string::npos) return "";
  const size_t last = text.find_last_not_of('\n');
  return text.substr(first, last - first + 1);
}

// A static page: a heading per section, then each step's numbers beside its
// figures, each figure with a sentence on what to see. Nothing has a fixed
// width: the steps wrap into one column on a phone (390 px), images shrink
// to their column (max-width 100%), so no colour bar is cut off, and the
// report's lines wrap rather than hide their ends behind a scroll bar.
std::string Page::page_html(const std::string& intro) const {
  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
       "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
       "<title>qkv demo: d2l 11.1-11.3</title>\n<style>\n"
       "* { box-sizing: border-box; }\n"
       "body { font-family: sans-serif; line-height: 1.4; margin: 0 auto; padding: 1em; "
       "max-width: 80em; }\n"
       ".step { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; "
       "margin: 1em 0 2em; }\n"
       ".step > pre { flex: 1 1 32em; min-width: 0; margin: 0; }\n"
       ".step > .figures { flex: 1 1 24em; min-width: 0; }\n"
       "figure { margin: 0 0 1em; }\n"
       "img { display: block; max-width: 100%; height: auto; }\n"
       "figcaption, .repeat { font-size: 0.9em; }\n"
       "pre { background: #f4f4f4; padding: 0.75em; font-size: 0.85em; white-space: pre-wrap; "
       "overflow-wrap: anywhere; }\n"
       "</style>\n</head>\n<body>\n<h1>qkv demo: d2l 11.1-11.3</h1>\n<p>"
    << html_escape(intro)
    << "</p>\n<p>Each step shows the numbers <code>qkv demo</code> printed, with the "
       "figures it drew and what to see in them.</p>\n";
  const std::string& report = kept_.str();
  for (const Section& s : sections_) {
    h << "<section>\n<h2>" << html_escape(s.title) << "</h2>\n";
    for (const Step& st : s.steps) {
      const std::string text = trim_lines(report.substr(st.begin, st.end - st.begin));
      if (text.empty() && st.figures.empty()) continue;
      h << "<div class=\"step\">\n<pre>" << html_escape(text) << "</pre>\n";
      if (!st.figures.empty() || !st.repeats.empty()) {
        h << "<div class=\"figures\">\n";
        for (const Figure& f : st.figures) {
          h << "<figure><img src=\"" << html_escape(f.file) << "\" alt=\"" << html_escape(f.caption)
            << "\"><figcaption><b>" << html_escape(f.caption) << ".</b> " << html_escape(f.see)
            << " (" << html_escape(f.file) << ")</figcaption></figure>\n";
        }
        for (const auto& [f, first] : st.repeats) {
          h << "<p class=\"repeat\"><b>" << html_escape(f.caption) << ":</b> "
            << html_escape(f.file) << " is byte for byte " << html_escape(first)
            << ", shown above, so it is not shown "
            << "again. " << html_escape(f.see) << "</p>\n";
        }
        h << "</div>\n";
      }
      h << "</div>\n";
    }
    h << "</section>\n";
  }
  h << "</body>\n</html>\n";
  return h.str();
}

// A (rows, cols, Nq, Nk) grid from values laid out in that order.
template <class T>
Tensor<T> grid(Shape shape, const std::vector<T>& values) {
  return Tensor<T>(shape, values);
}

// §11.3's (2, 1, 10) weights drawn as one (2 x 10) panel, a row per batch
// element: a panel of a single row comes out blank in gnuplot's image plot.
HeatmapOptions weights_heat() {
  HeatmapOptions heat;
  heat.ylabel = "Batch element";
  heat.figsize = {4.0, 1.6};
  return heat;
}

void section_11_1(std::ostream& os, Page& page) {
  page.section("11.1", "Queries, Keys, and Values");
  Tensor<double> eye(Shape{1, 1, 10, 10}, 0.0);
  for (int64_t i = 0; i < 10; ++i) eye(0, 0, i, i) = 1.0;
  heatmaps(eye.view(), page.path("identity.png"));
  os << "1. Attention weights that are the identity: query i looks at key i only.\n";
  page.figure("identity.png", "11.1: the 10 x 10 identity matrix as attention weights",
              "One bright cell per row, on the diagonal: each query puts all its weight on one "
              "key, which is an exact lookup.");

  page.step();
  KeyValueDatabase db;
  os << "\n2. The names database (key = surname, value = first name):";
  for (const Record& r : db.records()) os << " (" << r.key << ", " << r.value << ")";
  os << "\n";
  const LookupResult exact = db.exact("Li");
  os << "   exact(\"Li\"): weights";
  for (double w : exact.weights) os << ' ' << format_number(w, "%.4f");
  os << " -> " << (exact.match ? db.records()[*exact.match].value : "no match") << '\n';

  const LookupResult average = db.average();
  os << "   average pooling: weights";
  for (double w : average.weights) os << ' ' << format_number(w, "%.4f");
  os << "\n   top records:";
  for (size_t i : top_k(average.weights, 3)) {
    os << " (" << db.records()[i].key << ", " << db.records()[i].value << ")";
  }
  os << " -- every record counts the same, whatever the query\n";

  db.remove("Li");
  const LookupResult approx = db.approximate("Li");
  os << "   approximate(\"Li\") with (Li, Mu) removed, temperature "
     << KeyValueDatabase::kDefaultTemperature << ":\n     weights";
  for (double w : approx.weights) os << ' ' << format_number(w, "%.4f");
  os << "\n     top records:";
  for (size_t i : top_k(approx.weights, 2)) {
    os << " (" << db.records()[i].key << ", " << db.records()[i].value << ", "
       << format_number(approx.weights[i], "%.4f") << ")";
  }
  os << '\n';
}

double chapter_f(double x) { return 2.0 * std::sin(x) + std::pow(x, 0.8); }

// Leave-one-out squared error of average pooling: the mean of the other n - 1 ys.
double average_loo_error(const std::vector<double>& y) {
  double sum = 0;
  for (double v : y) sum += v;
  const double n = static_cast<double>(y.size());
  double err = 0;
  for (double v : y) {
    const double d = (sum - v) / (n - 1) - v;
    err += d * d;
  }
  return err / n;
}

void section_11_2(std::ostream& os, Page& page, uint64_t seed) {
  page.section("11.2", "Attention Pooling by Similarity");
  constexpr int64_t n = 50;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 5.0);
  std::normal_distribution<double> noise(0.0, 0.5);
  std::vector<double> xs(n), ys(n), qs(n), truth(n);
  for (double& x : xs) x = uniform(rng);
  std::sort(xs.begin(), xs.end());
  for (int64_t i = 0; i < n; ++i) ys[i] = chapter_f(xs[i]) + noise(rng);
  for (int64_t i = 0; i < n; ++i) {
    qs[i] = 0.1 * static_cast<double>(i);
    truth[i] = chapter_f(qs[i]);
  }
  const Tensor<double> x_train(Shape{n}, xs), y_train(Shape{n}, ys), x_test(Shape{n}, qs),
      y_truth(Shape{n}, truth);
  os << "The data: n = " << n << " sorted x ~ U(0, 5), y = 2 sin x + x^0.8 + N(0, 0.5);\n"
     << "queries arange(0, 5, 0.1) (" << n << " of them). First training points:";
  for (int64_t i = 0; i < 3; ++i)
    os << " (" << format_number(xs[i], "%.4f") << ", " << format_number(ys[i], "%.4f") << ")";
  os << '\n';

  HeatmapOptions heat;
  heat.xlabel = "Sorted training inputs";
  heat.ylabel = "Sorted testing inputs";
  // A fit's two figures: the prediction, and its weights with what to see in each.
  auto draw = [&](const std::string& name, const std::string& what,
                  const Tensor<double>& prediction, const std::vector<double>& weights,
                  const std::string& see_fit, const std::string& see_weights) {
    plot_kernel_regression(x_test.view(), y_truth.view(), prediction.view(), x_train.view(),
                           y_train.view(), page.path(name + ".png"));
    page.figure(name + ".png", "11.2 " + what + ": truth, prediction and training points", see_fit);
    heatmaps(grid(Shape{1, 1, n, n}, weights).view(), page.path(name + "-attention.png"), heat);
    page.figure(name + "-attention.png",
                "11.2 " + what + ": attention weights (50 test x 50 training inputs)" +
                    (name == "average-pooling" ? ", all 1/50 (one colour)" : ""),
                see_weights);
  };
  const auto band = [](double h) {
    return "The smaller the bandwidth (here h = " + format_number(h, "%.4f") +
           "), the narrower the bright band along the diagonal: each test input weighs only "
           "the training inputs near it.";
  };

  // (1) Average pooling.
  page.step();
  const Tensor<double> avg = average_pooling_regression(y_train.view(), n);
  os << "\n1. Average pooling: every query gets the mean of y, " << format_number(avg(0), "%.4f")
     << "; bandwidth h = inf, LOO error " << format_number(average_loo_error(ys), "%.4f") << '\n';
  draw("average-pooling", "average pooling", avg,
       std::vector<double>(static_cast<size_t>(n * n), 1.0 / static_cast<double>(n)),
       "The prediction is a flat line at the mean of y: it ignores the query.",
       "One colour everywhere: every training point gets the same weight for every query.");

  // (2) Nonparametric Gaussian kernel, h = 1.
  page.step();
  KernelRegression model(x_train.view(), y_train.view());
  model.set_bandwidth(1.0);
  os << "\n2. Nonparametric Gaussian kernel regression: bandwidth h = 1, LOO error "
     << format_number(model.loo_error(), "%.4f") << '\n';
  draw("nonparametric", "Gaussian kernel, h = 1", model.predict(x_test.view()).values,
       model.weights(x_test.view()).values(),
       "The prediction follows the curve's rise and fall but is smoothed: a wide kernel "
       "averages over neighbours far apart.",
       band(1.0));

  // (3) The parametric model, w learned by SGD on the leave-one-out loss.
  page.step();
  ParametricOptions popt;
  popt.seed = seed;
  const ParametricResult trained = train_parametric(x_train.view(), y_train.view(), popt);
  os << "\n3. Parametric Gaussian kernel, w learned by SGD (lr " << popt.lr << ", " << popt.epochs
     << " epochs) on the leave-one-out loss:\n";
  for (size_t e = 0; e < trained.losses.size(); ++e) {
    os << "   epoch " << e + 1 << ", loss " << format_number(trained.losses[e], "%.4f") << ", w "
       << format_number(trained.ws[e], "%.4f") << '\n';
  }
  const double h_param = 1.0 / std::abs(trained.w);
  os << "   learned w " << format_number(trained.w, "%.4f")
     << ": bandwidth h = 1/|w| = " << format_number(h_param, "%.4f") << ", LOO error "
     << format_number(model.loo_error({h_param}), "%.4f") << '\n';
  std::vector<double> epochs(trained.losses.size());
  for (size_t e = 0; e < epochs.size(); ++e) epochs[e] = static_cast<double>(e + 1);
  const auto num_epochs = static_cast<int64_t>(epochs.size());
  plot_loss(Tensor<double>(Shape{num_epochs}, epochs).view(),
            Tensor<double>(Shape{num_epochs}, trained.losses).view(),
            page.path("parametric-loss.png"));
  page.figure("parametric-loss.png", "11.2 parametric model: training loss per epoch",
              "The loss per epoch, the numbers on the left: w moves most in the first epoch.");
  model.set_bandwidth(h_param);
  draw("parametric", "parametric Gaussian kernel",
       parametric_predict(x_train.view(), y_train.view(), trained.w, x_test.view()),
       model.weights(x_test.view()).values(),
       "With the learned bandwidth h = " + format_number(h_param, "%.4f") +
           " the prediction bends towards single training points, noise included.",
       band(h_param));

  // (4) Cross-validated bandwidth, a fit the book does not have.
  page.step();
  const CvResult cv = cv_bandwidth(model);
  model.set_bandwidth(cv.bandwidth);
  os << "\n4. Cross-validated bandwidth (not in the book): leave-one-out cross-validation\n"
     << "   picks h = " << format_number(cv.bandwidth[0], "%.4f") << ", LOO error "
     << format_number(cv.loo_error, "%.4f") << '\n';
  draw("cross-validated", "Gaussian kernel, cross-validated h", model.predict(x_test.view()).values,
       model.weights(x_test.view()).values(),
       "The bandwidth with the least leave-one-out error of the four fits: compare the "
       "prediction with the truth here and in the fits above.",
       band(cv.bandwidth[0]));
}

// The largest of a (2, 1, 10) weight tensor's second row, for the page's sentence.
float max_weight_of_b1(const Tensor<float>& weights) {
  const std::vector<float>& w = weights.values();
  return *std::max_element(w.begin() + 10, w.end());
}

void section_11_3(std::ostream& os, Page& page, std::mt19937_64& rng, uint64_t seed) {
  page.section("11.3", "Attention Scoring Functions");
  // (1) Masked softmax: a fresh (2, 2, 4) batch for each kind of valid_lens.
  os << "1. Masked softmax of uniform [0, 1) scores of shape (2, 2, 4); positions at or past\n"
        "   a row's valid length get weight 0.\n";
  const Tensor<int64_t> per_batch(Shape{2}, {2, 3});
  const Tensor<int64_t> per_query(Shape{2, 2}, {1, 3, 2, 4});
  const Tensor<float> scores_a = random_tensor(Shape{2, 2, 4}, rng, false);
  os << "   valid_lens [2, 3], one length per batch element:\n";
  print_rows(os, masked_softmax(scores_a.view(), per_batch).view());
  const Tensor<float> scores_b = random_tensor(Shape{2, 2, 4}, rng, false);
  os << "   valid_lens [[1, 3], [2, 4]], one length per query:\n";
  print_rows(os, masked_softmax(scores_b.view(), per_query).view());

  // The keys, values and lengths both attention examples share.
  const Tensor<float> keys(Shape{2, 10, 2}, 1.0f);
  Tensor<float> values(Shape{2, 10, 4});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t k = 0; k < 40; ++k) values.data()[b * 40 + k] = static_cast<float>(k);
  }
  const Tensor<int64_t> valid_lens(Shape{2}, {2, 6});

  // (2) Additive attention, d2l's module in eval mode (dropout inactive).
  page.step();
  os << "\n2. Additive attention: AdditiveAttention(key_size 2, query_size 20, num_hiddens 8,\n"
        "   dropout 0.1) in eval mode, its parameters initialised from the seed.\n"
        "   queries (2, 1, 20) ~ N(0, 1); keys (2, 10, 2) all ones; values (2, 10, 4) =\n"
        "   arange(40) as (10, 4) in both batch elements; valid_lens [2, 6].\n";
  const Tensor<float> queries_a = random_tensor(Shape{2, 1, 20}, rng, true);
  AdditiveAttention<float> additive(2, 20, 8, 0.1, seed);
  additive.eval();
  const Tensor<float> additive_out =
      additive.forward(queries_a.view(), keys.view(), values.view(), valid_lens);
  os << "   output (2, 1, 4):\n";
  print_rows(os, additive_out.view());
  os << "   attention weights (2, 1, 10):\n";
  print_rows(os, additive.attention_weights().view());
  const std::vector<float>& additive_weights = additive.attention_weights().values();
  heatmaps(grid(Shape{1, 1, 2, 10}, additive_weights).view(), page.path("additive-attention.png"),
           weights_heat());
  page.figure(
      "additive-attention.png",
      "11.3 additive attention: weights of the one query over 10 keys, one row per batch element",
      "Uniform over the valid keys (2 in row 0, 6 in row 1) and 0 past them: the mask of "
      "valid_lens, and equal keys that no query can tell apart.");
  os << "   Every key is the same, so every score in a row is the same and the weights are\n"
        "   uniform over the valid keys: each output is the mean of the first 2 (b=0) or 6\n"
        "   (b=1) value rows, [[2, 3, 4, 5]] and [[10, 11, 12, 13]], as in d2l.\n";

  // (3) Scaled dot-product attention on the same keys, values and lengths.
  page.step();
  os << "\n3. Scaled dot-product attention: DotProductAttention(dropout 0.5) in eval mode.\n"
        "   queries (2, 1, 2) ~ N(0, 1); keys, values and valid_lens as in 2.\n";
  const Tensor<float> queries_b = random_tensor(Shape{2, 1, 2}, rng, true);
  DotProductAttention<float> dot(0.5, seed);
  dot.eval();
  const Tensor<float> dot_out =
      dot.forward(queries_b.view(), keys.view(), values.view(), valid_lens);
  os << "   output (2, 1, 4):\n";
  print_rows(os, dot_out.view());
  os << "   attention weights (2, 1, 10):\n";
  print_rows(os, dot.attention_weights().view());
  os << "   Equal keys cannot be told apart by any query: uniform weights again, and the\n"
        "   same output as additive attention.\n";
  const std::vector<float>& dot_weights = dot.attention_weights().values();
  heatmaps(grid(Shape{1, 1, 2, 10}, dot_weights).view(), page.path("dot-product-attention.png"),
           weights_heat());
  page.figure("dot-product-attention.png",
              "11.3 scaled dot-product attention: weights of the one query over 10 keys, one row "
              "per batch element",
              "Over equal keys every score in a row is the same whatever the scoring function, "
              "so both give the same uniform weights, and the same figure.");

  // (4) The exercise's question: with keys that differ, do the two scoring
  // functions still agree? The same two modules and queries over random keys.
  page.step();
  os << "\n4. The same two attentions over random keys (2, 10, 2) ~ N(0, 1), the rest as in\n"
        "   2 and 3 (d2l 11.3's exercise: modify the keys in the toy example).\n";
  const Tensor<float> random_keys = random_tensor(Shape{2, 10, 2}, rng, true);
  additive.forward(queries_a.view(), random_keys.view(), values.view(), valid_lens);
  dot.forward(queries_b.view(), random_keys.view(), values.view(), valid_lens);
  os << "   additive attention weights (2, 1, 10):\n";
  print_rows(os, additive.attention_weights().view());
  os << "   scaled dot-product attention weights (2, 1, 10):\n";
  print_rows(os, dot.attention_weights().view());
  std::vector<float> both = additive.attention_weights().values();
  const std::vector<float>& dot_random = dot.attention_weights().values();
  both.insert(both.end(), dot_random.begin(), dot_random.end());
  HeatmapOptions side_by_side = weights_heat();
  side_by_side.titles = {"additive", "scaled dot-product"};
  heatmaps(grid(Shape{1, 2, 2, 10}, both).view(), page.path("random-keys-attention.png"),
           side_by_side);
  page.figure("random-keys-attention.png",
              "11.3 with random keys: additive (left) and scaled dot-product (right) weights of "
              "the one query over 10 keys, one row per batch element",
              "The two panels no longer agree: the largest weight of batch element 1 is " +
                  format_number(max_weight_of_b1(additive.attention_weights()), "%.4f") +
                  " for additive attention and " +
                  format_number(max_weight_of_b1(dot.attention_weights()), "%.4f") +
                  " for scaled dot-product attention.");
  os << "   Now the weights differ: dot-product scores are linear in the key (q.k / sqrt(2)),\n"
        "   so they grow along q's direction without bound, while additive scores pass the\n"
        "   keys through W_k and a bounded tanh and depend on the 20-dimensional query only\n"
        "   through W_q: the two rank and weigh the same keys differently.\n";
}

void run_demo(const DemoArgs& args) {
  apply_threads(args.threads);
  std::error_code ec;
  std::filesystem::create_directories(args.out, ec);
  if (ec || !std::filesystem::is_directory(args.out)) {
    throw UsageError("--out " + args.out + ": cannot create the directory" +
                     (ec ? ": " + ec.message() : std::string()));
  }
  const std::filesystem::path dir = std::filesystem::absolute(args.out).lexically_normal();
  std::ostringstream kept;
  TeeBuf tee(std::cout, kept);
  std::ostream os(&tee);
  Page page(dir, os, kept);

  std::mt19937_64 rng(args.seed);
  const std::string intro = "qkv " + std::string(kVersion) +
                            " demo: the worked examples of d2l 11.1-11.3 (seed " +
                            std::to_string(args.seed) + ")";
  os << intro << ", figures in " << dir.string() << "\n\n";
  section_11_1(os, page);
  section_11_2(os, page, args.seed);
  section_11_3(os, page, rng, args.seed);

  const std::string index = (dir / "index.html").string();
  const std::string html = page.html(intro + ".");
  os << "\nfigures: " << index << '\n';
  os.flush();
  write_outputs({{"--out", index, html}});
  // A report that did not reach its reader (a full disk, a closed pipe) is a failure.
  std::cout.flush();
  if (!os || !std::cout) throw std::runtime_error("cannot write the report to stdout");
}
}  // namespace

Command add_demo_command(CLI::App& parent) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* app = parent.add_subcommand(
      "demo",
      "Run d2l 11.1-11.3 on embedded data: print the worked examples and draw the "
      "chapter's figures, with an index.html showing them all, into --out");
  add_seed_option(*app, args->seed,
                  "Seeds the random data and inputs, the additive parameters and the parametric "
                  "model's initial w");
  add_threads_option(*app, args->threads);
  require_path(app->add_option("--out", args->out,
                               "Folder for the figures and index.html (created if missing)"))
      ->type_name("DIR")
      ->capture_default_str();
  set_help_footer(*app, {"qkv demo --out qkv-demo"}, "docs/cli.md#qkv-demo");
  return {app, [args] { run_demo(*args); }};
}

}  // namespace qkv::cli

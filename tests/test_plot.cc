// Tests of the gnuplot figures (qkv/plot.h): every figure in every format is a
// valid file (PNG signature and IHDR size, SVG parsed as XML by Debian's
// /usr/bin/python3, PDF header and trailer), the identity heatmap's pixels,
// and the error paths: shapes, extension, titles, missing or failing gnuplot,
// labels and paths that try to run gnuplot commands, a full disk, and
// destinations that are symlinks, FIFOs or devices.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>

#include "qkv/plot.h"
#include "test_util.h"

namespace qkv {
namespace {

namespace fs = std::filesystem;

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

uint32_t be32(const std::string& bytes, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

// Runs a shell command; returns its exit status and stdout.
std::pair<int, std::string> shell(const std::string& command) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) return {-1, out};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class PlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/qkv-plot-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // The figure exists, is complete for its format, and nothing else was left
  // in the directory (no staged temporaries).
  void expect_valid(const std::string& file, int64_t min_w = 100, int64_t min_h = 100) {
    SCOPED_TRACE(file);
    ASSERT_TRUE(fs::exists(file));
    const std::string bytes = read_all(file);
    const std::string ext = fs::path(file).extension().string();
    if (ext == ".png") {
      ASSERT_GE(bytes.size(), 33u);
      EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
      EXPECT_EQ(bytes.substr(12, 4), "IHDR");
      const uint32_t w = be32(bytes, 16), h = be32(bytes, 20);
      EXPECT_GE(w, min_w);
      EXPECT_GE(h, min_h);
      EXPECT_LE(w, 10000u);
      EXPECT_LE(h, 10000u);
      EXPECT_NE(bytes.find("IEND"), std::string::npos);
    } else if (ext == ".svg") {
      EXPECT_NE(bytes.find("<svg"), std::string::npos);
      const auto [status, out] = shell(
          "/usr/bin/python3 -c 'import sys, xml.dom.minidom; "
          "print(xml.dom.minidom.parse(sys.argv[1]).documentElement.tagName)' '" +
          file + "'");
      EXPECT_EQ(status, 0) << out;
      EXPECT_EQ(out, "svg\n");
    } else {
      EXPECT_EQ(bytes.substr(0, 5), "%PDF-");
      EXPECT_NE(bytes.find("%%EOF", bytes.size() > 64 ? bytes.size() - 64 : 0), std::string::npos);
    }
    for (const auto& entry : fs::directory_iterator(fs::path(file).parent_path())) {
      EXPECT_NE(entry.path().filename().string()[0], '.') << "left behind: " << entry.path();
    }
  }

  fs::path dir_;
};

Tensor<double> identity(int64_t rows, int64_t cols, int64_t n) {
  Tensor<double> t(Shape{rows, cols, n, n});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t i = 0; i < n; ++i) t(r, c, i, i) = 1.0;
    }
  }
  return t;
}

const char* const kFormats[] = {"png", "svg", "pdf"};

TEST_F(PlotTest, HeatmapsEveryFormatAndLayout) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_note(seed));
  test::Rng rng(seed);
  for (const char* ext : kFormats) {
    heatmaps(identity(1, 1, 10).view(), path(std::string("one.") + ext));
    expect_valid(path(std::string("one.") + ext), 250, 250);
    // A 2 x 3 grid with titles, random weights, every colour map.
    Tensor<double> w(Shape{2, 3, 4, 6});
    for (double& v : w.values()) v = rng.uniform();
    for (const char* cmap : {"Reds", "Blues", "viridis", "gray"}) {
      HeatmapOptions o;
      o.titles = {"a", "b's", "c"};
      o.cmap = cmap;
      const std::string file = path(std::string("grid-") + cmap + "." + ext);
      heatmaps(w.view(), file, o);
      expect_valid(file, 3 * 250, 2 * 250);
    }
  }
  // float, and a constant map (the colour range must still be usable).
  Tensor<float> f(Shape{1, 2, 3, 3}, 0.25f);
  heatmaps(f.view(), path("float.png"));
  expect_valid(path("float.png"));
}

TEST_F(PlotTest, RegressionAndLossEveryFormat) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_note(seed));
  test::Rng rng(seed);
  std::normal_distribution<double> noise(0.0, 0.5);
  Tensor<double> x_test(Shape{50}), truth(Shape{50}), pred(Shape{50}), x_train(Shape{50}),
      y_train(Shape{50});
  for (int i = 0; i < 50; ++i) {
    const auto f = [](double x) { return 2 * std::sin(x) + std::pow(x, 0.8); };
    x_test(i) = 0.1 * i;
    truth(i) = f(x_test(i));
    pred(i) = truth(i) + 0.3;
    x_train(i) = 5.0 * i / 50;
    y_train(i) = f(x_train(i)) + noise(rng.engine());
  }
  Tensor<double> epochs(Shape{5}, {1, 2, 3, 4, 5}), losses(Shape{5}, {9.1, 4.2, 1.3, 0.8, 0.7});
  for (const char* ext : kFormats) {
    const std::string reg = path(std::string("reg.") + ext);
    plot_kernel_regression(x_test.view(), truth.view(), pred.view(), x_train.view(), y_train.view(),
                           reg);
    expect_valid(reg, 300, 200);
    const std::string loss = path(std::string("loss.") + ext);
    plot_loss(epochs.view(), losses.view(), loss);
    expect_valid(loss, 300, 200);
  }
  Tensor<float> e(Shape{3}, {1, 2, 3}), l(Shape{3}, {3, 2, 1});
  plot_loss(e.view(), l.view(), path("loss-float.png"));
  expect_valid(path("loss-float.png"));
  plot_kernel_regression(e.view(), l.view(), l.view(), e.view(), l.view(), path("reg-float.svg"));
  expect_valid(path("reg-float.svg"));
  // A truth of shape [0]: only the fit's line (qkv regress --plot), its title
  // in the legend and the truth's not.
  RegressionPlotOptions options;
  options.labels = {"the truth", "the fit"};
  plot_kernel_regression(x_test.view(), ConstView<double>(nullptr, Shape{0}), pred.view(),
                         x_train.view(), y_train.view(), path("fit.svg"), options);
  expect_valid(path("fit.svg"));
  std::ifstream svg(path("fit.svg"));
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("the fit"), std::string::npos);
  EXPECT_EQ(text.find("the truth"), std::string::npos);
  // A truth of another length is still an error.
  test::expect_error(
      [&] {
        plot_kernel_regression(x_test.view(), ConstView<double>(truth.data(), Shape{3}),
                               pred.view(), x_train.view(), y_train.view(), path("bad.png"));
      },
      {"plot_kernel_regression", "truth", "[3]", "[50]"});
}

// Decodes an 8-bit RGB/RGBA, non-interlaced PNG (what pngcairo writes), finds
// the plot area as the bounding box of the pixels within 3 of the map's two end
// colours, and prints the colour at the centre of each of n x n cells.
constexpr const char* kCellsPy = R"PY(
import struct, sys, zlib
data = open(sys.argv[1], 'rb').read()
n = int(sys.argv[2]); ends = [tuple(bytes.fromhex(c)) for c in sys.argv[3:5]]
pos, idat = 8, b''
while pos < len(data):
    length, kind = struct.unpack('>I4s', data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + length]
    if kind == b'IHDR':
        w, h, depth, ctype, _, _, interlace = struct.unpack('>IIBBBBB', body)
        assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
    elif kind == b'IDAT':
        idat += body
    pos += 12 + length
bpp = 3 if ctype == 2 else 4
raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
for y in range(h):
    f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    for i in range(stride):
        a = line[i - bpp] if i >= bpp else 0
        b = prev[i]
        c = prev[i - bpp] if i >= bpp else 0
        if f == 1: line[i] = (line[i] + a) & 255
        elif f == 2: line[i] = (line[i] + b) & 255
        elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c; pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append(line); prev = line
px = lambda x, y: tuple(rows[y][x * bpp:x * bpp + 3])
near = lambda p, q: max(abs(u - v) for u, v in zip(p, q)) <= 3
xs, ys = [], []
for y in range(h):
    for x in range(w):
        if any(near(px(x, y), e) for e in ends):
            xs.append(x); ys.append(y)
x0, x1, y0, y1 = min(xs), max(xs) + 1, min(ys), max(ys) + 1
print(w, h, x0, x1, y0, y1)
for i in range(n):
    print(' '.join('%02x%02x%02x' % px(int(x0 + (j + 0.5) * (x1 - x0) / n),
                                        int(y0 + (i + 0.5) * (y1 - y0) / n)) for j in range(n)))
)PY";

// The identity heatmap: diagonal cells in the map's darkest colour, the rest
// in its lightest; queries top to bottom, keys left to right. (Not gray: its
// white top end is the background, which the plot-area search cannot tell apart.)
TEST_F(PlotTest, IdentityHeatmapPixels) {
  std::ofstream(path("cells.py")) << kCellsPy;
  struct Map {
    const char* name;
    const char* high;  // colour of 1 (the diagonal)
    const char* low;   // colour of 0
  };
  for (const Map& map : {Map{"Reds", "67000d", "fff5f0"}, Map{"Blues", "08306b", "f7fbff"},
                         Map{"viridis", "fde725", "440154"}}) {
    SCOPED_TRACE(map.name);
    const std::string png = path(std::string("identity-") + map.name + ".png");
    HeatmapOptions o;
    o.cmap = map.name;
    o.colorbar = false;  // the plot area is then the only region in the map's colours
    heatmaps(identity(1, 1, 10).view(), png, o);
    const auto [status, out] = shell("/usr/bin/python3 " + path("cells.py") + " " + png + " 10 " +
                                     map.high + " " + map.low);
    ASSERT_EQ(status, 0) << out;
    std::istringstream lines(out);
    int w, h, x0, x1, y0, y1;
    lines >> w >> h >> x0 >> x1 >> y0 >> y1;
    // The panel is most of a 2.5 in x 2.5 in figure at 100 px per inch.
    EXPECT_GT(x1 - x0, 150);
    EXPECT_GT(y1 - y0, 150);
    for (int i = 0; i < 10; ++i) {
      for (int j = 0; j < 10; ++j) {
        std::string cell;
        lines >> cell;
        EXPECT_EQ(cell, i == j ? map.high : map.low) << "query " << i << " key " << j;
      }
    }
  }
}

TEST_F(PlotTest, ShapeErrors) {
  Tensor<double> three(Shape{2, 3, 3});
  test::expect_error([&] { heatmaps(three.view(), path("a.png")); },
                     {"heatmaps", "matrices", "[2, 3, 3]", "rank 4"});
  HeatmapOptions o;
  o.titles = {"only one"};
  test::expect_error([&] { heatmaps(identity(1, 2, 3).view(), path("a.png"), o); },
                     {"heatmaps", "titles has 1", "[1, 2, 3, 3]", "expected 2"});
  o = {};
  o.cmap = "jet";
  test::expect_error([&] { heatmaps(identity(1, 1, 3).view(), path("a.png"), o); },
                     {"heatmaps", "jet"});
  Tensor<double> nan(Shape{1, 1, 2, 2}, std::nan(""));
  test::expect_error([&] { heatmaps(nan.view(), path("a.png")); },
                     {"heatmaps", "matrices[0, 0, 0, 0] is nan"});
  Tensor<double> a(Shape{5}), b(Shape{4}), m(Shape{5, 1});
  test::expect_error(
      [&] {
        plot_kernel_regression(a.view(), a.view(), b.view(), a.view(), a.view(), path("r.png"));
      },
      {"plot_kernel_regression", "prediction", "[4]", "[5]"});
  test::expect_error(
      [&] {
        plot_kernel_regression(a.view(), a.view(), a.view(), a.view(), b.view(), path("r.png"));
      },
      {"plot_kernel_regression", "y_train", "[4]", "[5]"});
  test::expect_error(
      [&] {
        plot_kernel_regression(m.view(), a.view(), a.view(), a.view(), a.view(), path("r.png"));
      },
      {"plot_kernel_regression", "x_test", "[5, 1]"});
  test::expect_error([&] { plot_loss(a.view(), b.view(), path("l.png")); },
                     {"plot_loss", "losses", "[4]", "[5]"});
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(PlotTest, BadExtension) {
  Tensor<double> e(Shape{2}, {1, 2});
  for (const char* name : {"fig.jpg", "fig", "fig.PNG.txt"}) {
    test::expect_error([&] { heatmaps(identity(1, 1, 2).view(), path(name)); },
                       {"heatmaps", name, ".png, .svg or .pdf"});
    test::expect_error([&] { plot_loss(e.view(), e.view(), path(name)); }, {"plot_loss", name});
  }
  EXPECT_TRUE(fs::is_empty(dir_));
}

// Sets PATH for one scope.
class ScopedPath {
 public:
  explicit ScopedPath(const std::string& value)
      : old_(std::getenv("PATH") ? std::getenv("PATH") : "") {
    ::setenv("PATH", value.c_str(), 1);
  }
  ~ScopedPath() { ::setenv("PATH", old_.c_str(), 1); }

 private:
  std::string old_;
};

TEST_F(PlotTest, MissingGnuplot) {
  fs::create_directory(dir_ / "empty");
  const std::string out = path("fig.png");
  {
    ScopedPath p((dir_ / "empty").string());
    test::expect_error([&] { heatmaps(identity(1, 1, 2).view(), out); },
                       {"heatmaps", "gnuplot not found: install Debian package gnuplot-nox"});
  }
  EXPECT_FALSE(fs::exists(out));
  {
    ScopedPath p((dir_ / "empty").string());
    test::expect_error([&] { gnuplot_path(); },
                       {"gnuplot_path", "gnuplot not found: install Debian package gnuplot-nox"});
  }
  // After PATH is restored gnuplot is found again.
  EXPECT_EQ(fs::path(gnuplot_path()).filename(), "gnuplot");
  heatmaps(identity(1, 1, 2).view(), out);
  expect_valid(out);
}

TEST_F(PlotTest, FailingGnuplotKeepsOldFile) {
  // A stand-in gnuplot that writes part of a figure and fails like gnuplot does.
  fs::create_directory(dir_ / "bin");
  const fs::path fake = dir_ / "bin" / "gnuplot";
  std::ofstream(fake) << "#!/bin/sh\ncat >/dev/null\necho 'line 3: boom, no such terminal' >&2\n"
                         "exit 1\n";
  fs::permissions(fake, fs::perms::owner_all);
  fs::create_directory(dir_ / "out");
  const fs::path out = dir_ / "out" / "fig.svg";
  std::ofstream(out) << "old";
  {
    ScopedPath p((dir_ / "bin").string());
    // A failing gnuplot is not bad input but a failure underneath: IoError.
    test::expect_io_error([&] { heatmaps(identity(1, 1, 2).view(), out.string()); },
                          {"heatmaps", "gnuplot", "exited with status 1", "line 3: boom"});
  }
  EXPECT_EQ(read_all(out), "old");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_ / "out"), fs::directory_iterator()), 1);
}

TEST_F(PlotTest, MissingDirectory) {
  test::expect_error([&] { heatmaps(identity(1, 1, 2).view(), path("no/such/fig.png")); },
                     {"heatmaps", "no/such/"});
}

// ---- hostile labels and paths, a full disk, special destinations ----

// A gnuplot command hidden after a line end, as an adversary would write it.
std::string injection(const fs::path& marker) {
  return "x\nsystem \"touch " + marker.string() + "\"\ny";
}

struct RegressionData {
  Tensor<double> x{Shape{5}, {0, 1, 2, 3, 4}};
  Tensor<double> y{Shape{5}, {1, 2, 0, 3, 2}};
  void plot(const std::string& path, const RegressionPlotOptions& o = {}) const {
    plot_kernel_regression(x.view(), y.view(), y.view(), x.view(), y.view(), path, o);
  }
};

TEST_F(PlotTest, LabelsCannotRunGnuplotCommands) {
  const fs::path marker = dir_ / "pwned";
  const std::string out = path("fig.svg");
  for (const std::string& text :
       {injection(marker), std::string("a\rb"), std::string("a\x1b[1mb"), std::string("caf\xe9")}) {
    SCOPED_TRACE(text);
    const std::string problem = text.back() == '\xe9' ? "not UTF-8" : "control character";
    HeatmapOptions h;
    h.xlabel = text;
    test::expect_error([&] { heatmaps(identity(1, 1, 2).view(), out, h); },
                       {"heatmaps: xlabel", problem});
    h = {};
    h.ylabel = text;
    test::expect_error([&] { heatmaps(identity(1, 1, 2).view(), out, h); },
                       {"heatmaps: ylabel", problem});
    h = {};
    h.titles = {"fine", text};
    test::expect_error([&] { heatmaps(identity(1, 2, 2).view(), out, h); },
                       {"heatmaps: titles[1]", problem});
    const RegressionData data;
    for (int field = 0; field < 4; ++field) {
      RegressionPlotOptions o;
      std::string* label[] = {&o.xlabel, &o.ylabel, &o.labels[0], &o.labels[1]};
      const char* names[] = {"xlabel", "ylabel", "labels[0]", "labels[1]"};
      *label[field] = text;
      test::expect_error([&] { data.plot(out, o); },
                         {std::string("plot_kernel_regression: ") + names[field], problem});
    }
  }
  EXPECT_FALSE(fs::exists(marker)) << "a gnuplot command ran";
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(PlotTest, QuotesBackquotesAndBackslashesInLabelsAreText) {
  const fs::path marker = dir_ / "pwned";
  HeatmapOptions h;
  h.xlabel = "it's `touch " + marker.string() + "` \"q\" \\";
  h.titles = {"na\xc3\xafve"};
  heatmaps(identity(1, 1, 3).view(), path("fig.svg"), h);
  expect_valid(path("fig.svg"));
  const std::string svg = read_all(path("fig.svg"));
  EXPECT_NE(svg.find("`touch " + marker.string() + "`"), std::string::npos);
  EXPECT_NE(svg.find("na\xc3\xafve"), std::string::npos);
  EXPECT_FALSE(fs::exists(marker)) << "a gnuplot command ran";
}

// Changes the working directory for one scope.
class ScopedCwd {
 public:
  explicit ScopedCwd(const fs::path& dir) : old_(fs::current_path()) { fs::current_path(dir); }
  ~ScopedCwd() { fs::current_path(old_); }

 private:
  fs::path old_;
};

TEST_F(PlotTest, APathWithLineEndsIsOnlyAName) {
  // The path never enters the script: gnuplot draws to its stdout.
  ScopedCwd cwd(dir_);
  for (const char* ext : kFormats) {
    const std::string name = std::string("fig\nsystem \"touch pwned\"\n.") + ext;
    heatmaps(identity(1, 1, 3).view(), name);
    expect_valid(path(name));
  }
  const RegressionData data;
  data.plot("fit\nsystem \"touch pwned\"\n.png");
  expect_valid(path("fit\nsystem \"touch pwned\"\n.png"));
  EXPECT_FALSE(fs::exists(dir_ / "pwned")) << "a gnuplot command ran";
}

TEST_F(PlotTest, AFullDiskKeepsTheOldFigure) {
  // gnuplot exits 0 when its writes fail; the figure's end must be checked.
  const Tensor<double> w = identity(1, 2, 30);
  const RegressionData data;
  const Tensor<double> epochs(Shape{3}, {1, 2, 3}), losses(Shape{3}, {3, 2, 1});
  const std::function<void(const std::string&)> draw[] = {
      [&](const std::string& p) { heatmaps(w.view(), p); },
      [&](const std::string& p) { data.plot(p); },
      [&](const std::string& p) { plot_loss(epochs.view(), losses.view(), p); }};
  const char* functions[] = {"heatmaps", "plot_kernel_regression", "plot_loss"};
  for (int f = 0; f < 3; ++f) {
    for (const char* ext : kFormats) {
      SCOPED_TRACE(std::string(functions[f]) + " " + ext);
      const std::string fresh = path(std::string("fresh.") + ext);
      draw[f](fresh);
      const auto size = static_cast<rlim_t>(fs::file_size(fresh));
      fs::remove(fresh);
      const std::string out = path(std::string("fig.") + ext);
      std::ofstream(out) << "the old figure";
      for (const rlim_t limit : {size - 8, size / 3}) {
        test::FileSizeLimit cap(limit);
        test::expect_io_error([&] { draw[f](out); }, {functions[f], out});
      }
      EXPECT_EQ(read_all(out), "the old figure");
      EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1)
          << "a temporary file was left";
      fs::remove(out);
    }
  }
}

TEST_F(PlotTest, SymlinkFifoAndDeviceDestinations) {
  fs::create_directory(dir_ / "real");
  fs::create_symlink("real/fig.png", dir_ / "link.png");
  heatmaps(identity(1, 1, 3).view(), path("link.png"));
  EXPECT_TRUE(fs::is_symlink(dir_ / "link.png"));
  EXPECT_EQ(fs::read_symlink(dir_ / "link.png"), "real/fig.png");
  expect_valid(path("real/fig.png"));

  const std::string fifo = path("pipe.png");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::string got;
  std::thread reader([&] { got = read_all(fifo); });
  heatmaps(identity(1, 1, 3).view(), fifo);
  reader.join();
  EXPECT_TRUE(fs::is_fifo(fifo)) << "the FIFO was replaced";
  ASSERT_GE(got.size(), 12u);
  EXPECT_EQ(got.substr(0, 4), "\x89PNG");
  EXPECT_EQ(got.substr(got.size() - 8, 4), "IEND");

  if (::geteuid() == 0) {  // a private /dev/null: mknod needs root
    const std::string device = path("null.svg");
    ASSERT_EQ(::mknod(device.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0) << std::strerror(errno);
    heatmaps(identity(1, 1, 3).view(), device);
    EXPECT_TRUE(fs::is_character_file(device)) << "the device was replaced";
  }
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_NE(entry.path().filename().string()[0], '.') << "left behind: " << entry.path();
  }
}

}  // namespace
}  // namespace qkv

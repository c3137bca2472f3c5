// Figures through gnuplot: validate the arguments, write a gnuplot script
// with the data inline (datablocks), run gnuplot (posix_spawn) with the script
// on its stdin, the staged figure as its stdout and its stderr caught in an
// unnamed temporary file, check that the figure is complete, and rename it
// into place (a StagedFile). No path appears in the script or a shell command.
#include "qkv/plot.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string_view>

#include "core/check.h"
#include "qkv/error.h"
#include "qkv/staged_file.h"

extern char** environ;

namespace qkv {
namespace {

namespace fs = std::filesystem;

// A gnuplot single-quoted string: only ' needs escaping, as ''. Nothing else
// is special inside one (no backslash escapes, no `command` substitution),
// except a line end, which ends the command: check_label keeps those out.
std::string quote(std::string_view text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

// The length of the UTF-8 sequence at text[i], or 0 if it is not valid UTF-8
// (overlong forms, surrogates and code points above U+10FFFF included).
size_t utf8_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b = byte(i);
  if (b < 0x80) return 1;
  const size_t n = b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : b >= 0xc2 ? 2 : 0;
  if (n == 0 || b > 0xf4 || i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
  }
  const unsigned char b1 = byte(i + 1);
  if ((b == 0xe0 && b1 < 0xa0) || (b == 0xed && b1 >= 0xa0) || (b == 0xf0 && b1 < 0x90) ||
      (b == 0xf4 && b1 >= 0x90)) {
    return 0;
  }
  return n;
}

// A label or title must be one line of UTF-8 text. A line end inside it would
// end the gnuplot command and run the rest of the label as the next one
// (`system "..."` runs a shell command), so every control character is
// refused, not escaped; invalid UTF-8 would make the SVG terminal write XML
// no reader accepts.
void check_label(std::string_view function, std::string_view name, std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    const size_t n = utf8_length(text, i);
    if (b < 0x20 || b == 0x7f || n == 0) {
      std::string shown;
      for (const char c : text.substr(0, 60)) {
        const auto u = static_cast<unsigned char>(c);
        char escape[8];
        std::snprintf(escape, sizeof escape, "\\x%02x", u);
        shown += u < 0x20 || u == 0x7f || u >= 0x80 ? std::string(escape) : std::string(1, c);
      }
      char at[16];
      std::snprintf(at, sizeof at, "\\x%02x", b);
      fail(function,
           std::string(name) + " \"" + shown + (text.size() > 60 ? "...\"" : "\"") + " holds " +
               (n == 0 && b >= 0x80 ? "a byte that is not UTF-8 (" : "a control character (") + at +
               " at byte " + std::to_string(i) + "); a label must be one line of UTF-8 text");
    }
    i += n;
  }
}

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// The first executable `gnuplot` in PATH.
std::string find_gnuplot(std::string_view function) {
  const char* path = std::getenv("PATH");
  std::string_view dirs = path ? path : "";
  while (true) {
    const size_t colon = dirs.find(':');
    const std::string_view dir = dirs.substr(0, colon);
    const std::string candidate = (fs::path(dir.empty() ? "." : dir) / "gnuplot").string();
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    if (colon == std::string_view::npos) break;
    dirs.remove_prefix(colon + 1);
  }
  fail(function, "gnuplot not found: install Debian package gnuplot-nox");
}

// The gnuplot terminal line for `path`'s extension and a figure of
// width x height inches; fonts at 9 pt like matplotlib's small figures.
std::string terminal(std::string_view function, const std::string& path, double width,
                     double height) {
  const std::string ext = fs::path(path).extension().string();
  const auto px = [](double inches) { return std::to_string(std::lround(inches * 100)); };
  if (ext == ".png") {
    return "set terminal pngcairo noenhanced font ',9' size " + px(width) + "," + px(height);
  }
  if (ext == ".svg") {
    return "set terminal svg noenhanced font ',9' size " + px(width) + "," + px(height);
  }
  if (ext == ".pdf") {
    return "set terminal pdfcairo noenhanced font ',9' size " + number(width) + "in," +
           number(height) + "in";
  }
  fail(function, "path " + path + " has extension \"" + ext +
                     "\"; expected .png, .svg or .pdf (the format follows the extension)");
}

template <class T>
void check_finite(std::string_view function, std::string_view name, const TensorView<T>& view) {
  const Shape& s = view.shape();
  const int64_t n = view.numel();
  std::array<int64_t, kMaxRank> index{};
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t rest = flat, offset = 0;
    for (int a = s.rank() - 1; a >= 0; --a) {
      index[a] = rest % s[a];
      rest /= s[a];
      offset += index[a] * view.stride(a);
    }
    const double v = static_cast<double>(view.data()[offset]);
    if (!std::isfinite(v)) {
      std::string at;
      for (int a = 0; a < s.rank(); ++a) {
        if (a) at += ", ";
        at += std::to_string(index[a]);
      }
      fail(function,
           std::string(name) + "[" + at + "] is " + number(v) + "; the values must be finite");
    }
  }
}

// An unnamed temporary file for gnuplot's stderr: nothing to remove, even if
// the process is killed.
int unnamed_temp(std::string_view function) {
  std::error_code ec;
  const fs::path dir = fs::temp_directory_path(ec);
  const std::string where = ec ? std::string("/tmp") : dir.string();
  int fd = ::open(where.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {  // a file system without O_TMPFILE: a named file, unlinked at once
    std::string pattern = where + "/qkv-gnuplot-XXXXXX";
    fd = ::mkostemp(pattern.data(), O_CLOEXEC);
    if (fd >= 0) ::unlink(pattern.c_str());
  }
  if (fd < 0) {
    fail_io(function, "cannot create a temporary file in " + where + ": " + std::strerror(errno));
  }
  return fd;
}

// The whole content of an open file, from its start.
std::string read_back(int fd) {
  std::string text;
  char buffer[4096];
  off_t offset = 0;
  ssize_t got;
  while ((got = ::pread(fd, buffer, sizeof buffer, offset)) > 0) {
    text.append(buffer, static_cast<size_t>(got));
    offset += got;
  }
  return text;
}

// Runs `gnuplot` with `script` on its stdin, `out` as its stdout and `err` as
// its stderr; returns its wait status, or -1 if it could not be started.
// SIGPIPE (gnuplot quitting before it read everything) is blocked in this
// thread while writing and discarded after, so a failing gnuplot becomes an
// error and not a dead process; gnuplot itself starts with the caller's mask.
int run_gnuplot(const std::string& gnuplot, const std::string& script, int out, int err) {
  sigset_t pipe_set, old_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  int status = -1;
  int in[2];
  if (::pipe2(in, O_CLOEXEC) == 0) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out, STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err, STDERR_FILENO);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigmask(&attr, &old_set);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
    std::string program = gnuplot;
    char* argv[] = {program.data(), nullptr};
    pid_t pid = -1;
    const int spawned = ::posix_spawn(&pid, gnuplot.c_str(), &actions, &attr, argv, environ);
    posix_spawnattr_destroy(&attr);
    posix_spawn_file_actions_destroy(&actions);
    ::close(in[0]);
    if (spawned == 0) {
      const char* data = script.data();
      size_t left = script.size();
      while (left > 0) {
        const ssize_t n = ::write(in[1], data, left);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) break;  // EPIPE: gnuplot quit early; its status says why
        data += n;
        left -= static_cast<size_t>(n);
      }
    }
    ::close(in[1]);
    if (spawned == 0) {
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }
  sigset_t pending;
  sigpending(&pending);
  if (sigismember(&pending, SIGPIPE) && !sigismember(&old_set, SIGPIPE)) {
    const timespec zero{0, 0};
    sigtimedwait(&pipe_set, nullptr, &zero);
  }
  pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
  return status;
}

// gnuplot exits 0 even when its writes failed (a full disk leaves an empty or
// cut-off figure), so the figure must end as its format ends: PNG with the
// IEND chunk, PDF with %%EOF, SVG with </svg>.
void check_complete(std::string_view function, const std::string& path, StagedFile& staged) {
  const std::string ext = fs::path(path).extension().string();
  std::string tail = staged.tail(64);
  std::string_view end;
  bool complete = false;
  if (ext == ".png") {
    end = "the IEND chunk";
    static const std::string kIend("\0\0\0\0IEND\xae\x42\x60\x82", 12);
    complete = tail.size() >= kIend.size() &&
               tail.compare(tail.size() - kIend.size(), kIend.size(), kIend) == 0;
  } else {
    end = ext == ".pdf" ? "%%EOF" : "</svg>";
    while (!tail.empty() && std::isspace(static_cast<unsigned char>(tail.back()))) tail.pop_back();
    complete =
        tail.size() >= end.size() && tail.compare(tail.size() - end.size(), end.size(), end) == 0;
  }
  if (!complete) {
    fail_io(function, "path " + path + ": the figure gnuplot wrote is incomplete (" +
                          std::to_string(staged.size()) + " bytes, not ending with " +
                          std::string(end) +
                          "); the disk may be full or a file size limit reached");
  }
}

// Runs `body` (the script after the terminal line) through gnuplot into
// `path`, atomically: gnuplot draws into a StagedFile as its stdout.
void render(std::string_view function, const std::string& path, const std::string& terminal_line,
            const std::string& body) {
  const std::string gnuplot = find_gnuplot(function);
  StagedFile staged(function, "path", path);
  const int errors = unnamed_temp(function);
  const std::string script = terminal_line + "\n" + body + "\nexit\n";
  const int status = run_gnuplot(gnuplot, script, staged.fd(), errors);
  std::string message = read_back(errors);
  ::close(errors);
  if (status != 0) {
    while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) {
      message.pop_back();
    }
    const std::string how = status == -1 ? "could not be started"
                            : WIFEXITED(status)
                                ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                : "was killed by signal " + std::to_string(WTERMSIG(status));
    fail_io(function, "gnuplot (" + gnuplot + ") " + how + " rendering " + path +
                          (message.empty() ? std::string() : ":\n" + message));
  }
  check_complete(function, path, staged);
  staged.commit();
}

// Colour stops (position, #rrggbb) approximating matplotlib's maps: Reds and
// Blues are ColorBrewer's 9-class ramps (white to dark), viridis its published
// stops every tenth, gray black to white.
std::string palette(std::string_view function, const std::string& cmap) {
  std::vector<const char*> stops;
  if (cmap == "Reds") {
    stops = {"#fff5f0", "#fee0d2", "#fcbba1", "#fc9272", "#fb6a4a",
             "#ef3b2c", "#cb181d", "#a50f15", "#67000d"};
  } else if (cmap == "Blues") {
    stops = {"#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6",
             "#4292c6", "#2171b5", "#08519c", "#08306b"};
  } else if (cmap == "viridis") {
    stops = {"#440154", "#482878", "#3e4989", "#31688e", "#26828e",
             "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"};
  } else if (cmap == "gray") {
    stops = {"#000000", "#ffffff"};
  } else {
    fail(function,
         "cmap \"" + cmap + "\" is not a colour map; expected Reds, Blues, viridis or gray");
  }
  std::string text = "set palette defined (";
  for (size_t i = 0; i < stops.size(); ++i) {
    if (i) text += ", ";
    text += number(static_cast<double>(i) / (stops.size() - 1));
    text.append(" '").append(stops[i]).append("'");
  }
  return text + ")\n";
}

void check_figsize(std::string_view function, std::string_view name,
                   const std::array<double, 2>& size) {
  if (!(size[0] > 0 && size[1] > 0 && size[0] <= 100 && size[1] <= 100)) {
    fail(function, std::string(name) + " is (" + number(size[0]) + ", " + number(size[1]) +
                       "); expected inches in (0, 100]");
  }
}

template <class T>
void heatmaps_impl(ConstView<T> m, const std::string& path, const HeatmapOptions& options) {
  constexpr std::string_view kFn = "heatmaps";
  detail::check_rank(kFn, "matrices", m, 4, "(rows, cols, Nq, Nk)");
  const int64_t rows = m.size(0), cols = m.size(1), nq = m.size(2), nk = m.size(3);
  if (m.numel() == 0) {
    fail(kFn, "matrices has shape " + m.shape().str() + "; expected every axis >= 1");
  }
  if (!options.titles.empty() && static_cast<int64_t>(options.titles.size()) != cols) {
    fail(kFn, "titles has " + std::to_string(options.titles.size()) +
                  " entries but matrices has shape " + m.shape().str() + "; expected " +
                  std::to_string(cols) + " (one per column) or none");
  }
  check_figsize(kFn, "figsize", options.figsize);
  const std::string colours = palette(kFn, options.cmap);
  check_label(kFn, "xlabel", options.xlabel);
  check_label(kFn, "ylabel", options.ylabel);
  for (size_t c = 0; c < options.titles.size(); ++c) {
    check_label(kFn, "titles[" + std::to_string(c) + "]", options.titles[c]);
  }
  terminal(kFn, path, 1, 1);  // checks the extension before any work
  check_output_path(kFn, "path", path);
  check_finite(kFn, "matrices", m);

  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  const int64_t row_copies = nq == 1 ? 2 : 1, col_copies = nk == 1 ? 2 : 1;
  std::string data;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      data += "$m" + std::to_string(r) + "_" + std::to_string(c) + " << EOD\n";
      // gnuplot cannot size the pixels of a one-row or one-column image and
      // draws nothing: such an axis is written twice and drawn at half pitch.
      for (int64_t i = 0; i < nq * row_copies; ++i) {
        for (int64_t j = 0; j < nk * col_copies; ++j) {
          const double v = static_cast<double>(m(r, c, i / row_copies, j / col_copies));
          lo = std::min(lo, v);
          hi = std::max(hi, v);
          if (j) data += ' ';
          data += number(v);
        }
        data += "\n";
      }
      data += "EOD\n";
    }
  }
  if (lo == hi) {  // a constant map still needs a colour range: from 0 to the value
    if (hi > 0) {
      lo = 0;
    } else if (lo < 0) {
      hi = 0;
    } else {
      hi = 1;
    }
  }

  // Layout in inches: room for tick labels and the y label on the left, the x
  // label below, titles above and the colour bar on the right.
  const double pw = options.figsize[0], ph = options.figsize[1];
  const double left = 0.75, bottom = 0.6, top = options.titles.empty() ? 0.15 : 0.35;
  const double right = options.colorbar ? 0.9 : 0.2, gap = 0.15;
  const double width = left + cols * pw + (cols - 1) * gap + right;
  const double height = top + rows * ph + (rows - 1) * gap + bottom;
  const auto sx = [&](double inches) { return number(inches / width); };
  const auto sy = [&](double inches) { return number(1.0 - inches / height); };  // from the top

  std::string s = data + colours;
  s += "set cbrange [" + number(lo) + ":" + number(hi) + "]\nset format cb '%g'\n";
  s += "set tics out nomirror scale 0.7\nset border lw 0.8\n";
  s += "set xrange [-0.5:" + number(nk - 0.5) + "]\n";
  s += "set yrange [" + number(nq - 0.5) + ":-0.5]\n";  // query 0 at the top
  // Whole-number ticks: a lone key or query gets one tick, a few get one each.
  if (nk == 1) s += "set xtics (0)\n";
  if (nq == 1) s += "set ytics (0)\n";
  if (nk > 1 && nk <= 10) s += "set xtics 1\n";
  if (nq > 1 && nq <= 10) s += "set ytics 1\n";
  s += "set multiplot\n";
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double x0 = left + c * (pw + gap), y0 = top + r * (ph + gap);
      s += "set lmargin at screen " + sx(x0) + "\nset rmargin at screen " + sx(x0 + pw) + "\n";
      s += "set tmargin at screen " + sy(y0) + "\nset bmargin at screen " + sy(y0 + ph) + "\n";
      const bool bottom_row = r == rows - 1, first_col = c == 0;
      s += bottom_row ? "set format x '%g'\nset xlabel " + quote(options.xlabel) + "\n"
                      : "set format x ''\nunset xlabel\n";
      s += first_col ? "set format y '%g'\nset ylabel " + quote(options.ylabel) + "\n"
                     : "set format y ''\nunset ylabel\n";
      s += r == 0 && !options.titles.empty() ? "set title " + quote(options.titles[c]) + "\n"
                                             : "unset title\n";
      if (options.colorbar && r == rows - 1 && c == cols - 1) {
        // One bar for the grid, 60% of its height and centred, like d2l's shrink=0.6.
        const double grid_h = rows * ph + (rows - 1) * gap, bar_h = 0.6 * grid_h;
        const double bar_top = top + (grid_h - bar_h) / 2;
        const double bar_x = left + cols * pw + (cols - 1) * gap + 0.15;
        s += "set colorbox user origin screen " + sx(bar_x) + "," + sy(bar_top + bar_h) +
             " size screen " + number(0.12 / width) + "," + number(bar_h / height) + "\n";
        s += "set cbtics out scale 0.7\n";
      } else {
        s += "unset colorbox\n";
      }
      s += "plot $m" + std::to_string(r) + "_" + std::to_string(c) + " matrix using " +
           (col_copies == 2 ? "($1*0.5-0.25)" : "1") + ":" +
           (row_copies == 2 ? "($2*0.5-0.25)" : "2") + ":3 with image notitle\n";
    }
  }
  s += "unset multiplot\n";
  render(kFn, path, terminal(kFn, path, width, height), s);
}

template <class T>
void check_vector(std::string_view function, std::string_view name, const ConstView<T>& v,
                  std::string_view axis) {
  detail::check_rank(function, name, v, 1, axis);
}

template <class T>
std::string columns_block(const std::string& name, const std::vector<ConstView<T>>& columns) {
  std::string text = name + " << EOD\n";
  for (int64_t i = 0; i < columns[0].size(0); ++i) {
    for (size_t c = 0; c < columns.size(); ++c) {
      if (c) text += ' ';
      text += number(static_cast<double>(columns[c](i)));
    }
    text += "\n";
  }
  return text + "EOD\n";
}

template <class T>
void regression_impl(ConstView<T> x_test, ConstView<T> truth, ConstView<T> prediction,
                     ConstView<T> x_train, ConstView<T> y_train, const std::string& path,
                     const RegressionPlotOptions& o) {
  constexpr std::string_view kFn = "plot_kernel_regression";
  check_vector(kFn, "x_test", x_test, "(n)");
  check_vector(kFn, "truth", truth, "(n)");
  check_vector(kFn, "prediction", prediction, "(n)");
  check_vector(kFn, "x_train", x_train, "(m)");
  check_vector(kFn, "y_train", y_train, "(m)");
  // truth of shape [0] beside a non-empty x_test: no truth line (qkv regress
  // --plot draws a fit to data whose truth is unknown).
  const bool with_truth = !(truth.size(0) == 0 && x_test.size(0) > 0);
  if (with_truth) detail::check_shape(kFn, "truth", truth, x_test.shape());
  detail::check_shape(kFn, "prediction", prediction, x_test.shape());
  detail::check_shape(kFn, "y_train", y_train, x_train.shape());
  if (!(o.xlim[0] < o.xlim[1]) || !(o.ylim[0] < o.ylim[1])) {
    fail(kFn, "xlim (" + number(o.xlim[0]) + ", " + number(o.xlim[1]) + ") and ylim (" +
                  number(o.ylim[0]) + ", " + number(o.ylim[1]) + ") must be increasing");
  }
  check_figsize(kFn, "figsize", o.figsize);
  check_label(kFn, "xlabel", o.xlabel);
  check_label(kFn, "ylabel", o.ylabel);
  check_label(kFn, "labels[0]", o.labels[0]);
  check_label(kFn, "labels[1]", o.labels[1]);
  terminal(kFn, path, 1, 1);
  check_output_path(kFn, "path", path);
  for (const auto& [name, v] : {std::pair{"x_test", x_test},
                                {"truth", truth},
                                {"prediction", prediction},
                                {"x_train", x_train},
                                {"y_train", y_train}}) {
    check_finite(kFn, name, v);
  }
  std::string s =
      columns_block<T>("$lines", {x_test, with_truth ? truth : prediction, prediction}) +
      columns_block<T>("$train", {x_train, y_train});
  s += "set xrange [" + number(o.xlim[0]) + ":" + number(o.xlim[1]) + "]\n";
  s += "set yrange [" + number(o.ylim[0]) + ":" + number(o.ylim[1]) + "]\n";
  s += "set xlabel " + quote(o.xlabel) + "\nset ylabel " + quote(o.ylabel) + "\n";
  s += "set tics out nomirror scale 0.7\nset key top left box opaque\n";
  // matplotlib's first two line colours; the points at alpha 0.5 (gnuplot's
  // ARGB counts the top byte as transparency).
  s += "plot ";
  if (with_truth) {
    s += "$lines using 1:2 with lines lw 1.5 lc rgb '#1f77b4' title " + quote(o.labels[0]) +
         ", \\\n  ";
  }
  s += std::string("$lines using 1:3 with lines lw 1.5 ") + (with_truth ? "dt 2 " : "") +
       "lc rgb '#bf00bf' title " + quote(o.labels[1]) +
       ", \\\n  $train using 1:2 with points pt 7 ps 0.6 lc rgb '#80ff7f0e' notitle\n";
  render(kFn, path, terminal(kFn, path, o.figsize[0], o.figsize[1]), s);
}

template <class T>
void loss_impl(ConstView<T> epochs, ConstView<T> losses, const std::string& path) {
  constexpr std::string_view kFn = "plot_loss";
  check_vector(kFn, "epochs", epochs, "(n)");
  check_vector(kFn, "losses", losses, "(n)");
  detail::check_shape(kFn, "losses", losses, epochs.shape());
  if (epochs.size(0) == 0) fail(kFn, "epochs has shape [0]; expected at least one epoch");
  terminal(kFn, path, 1, 1);
  check_output_path(kFn, "path", path);
  check_finite(kFn, "epochs", epochs);
  check_finite(kFn, "losses", losses);
  std::string s = columns_block<T>("$loss", {epochs, losses});
  s += "set xlabel 'epoch'\nset ylabel 'loss'\nset tics out nomirror scale 0.7\n";
  if (epochs.size(0) <= 20) s += "set xtics 1\n";  // whole epochs, not half-epoch ticks
  s += "set offsets graph 0.05, graph 0.05, graph 0.05, graph 0.05\n";
  s += "plot $loss using 1:2 with linespoints lw 1.5 pt 7 ps 0.5 lc rgb '#1f77b4' title 'train "
       "loss'\n";
  render(kFn, path, terminal(kFn, path, 3.5, 2.5), s);
}

}  // namespace

std::string gnuplot_path() { return find_gnuplot("gnuplot_path"); }

void heatmaps(ConstView<double> matrices, const std::string& path, const HeatmapOptions& options) {
  heatmaps_impl(matrices, path, options);
}
void heatmaps(ConstView<float> matrices, const std::string& path, const HeatmapOptions& options) {
  heatmaps_impl(matrices, path, options);
}

void plot_kernel_regression(ConstView<double> x_test, ConstView<double> truth,
                            ConstView<double> prediction, ConstView<double> x_train,
                            ConstView<double> y_train, const std::string& path,
                            const RegressionPlotOptions& options) {
  regression_impl(x_test, truth, prediction, x_train, y_train, path, options);
}
void plot_kernel_regression(ConstView<float> x_test, ConstView<float> truth,
                            ConstView<float> prediction, ConstView<float> x_train,
                            ConstView<float> y_train, const std::string& path,
                            const RegressionPlotOptions& options) {
  regression_impl(x_test, truth, prediction, x_train, y_train, path, options);
}

void plot_loss(ConstView<double> epochs, ConstView<double> losses, const std::string& path) {
  loss_impl(epochs, losses, path);
}
void plot_loss(ConstView<float> epochs, ConstView<float> losses, const std::string& path) {
  loss_impl(epochs, losses, path);
}

}  // namespace qkv

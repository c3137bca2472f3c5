// Progress reports on stderr (cli/progress.h).
#include "progress.h"

#include <unistd.h>

#include <cstdio>

namespace qkv::cli {
namespace {

// A terminal's bar is redrawn at most 10 times a second; a log gets a line
// every 5 seconds, which keeps a long run's log short.
constexpr double kTerminalInterval = 0.1;
constexpr double kLineInterval = 5.0;
constexpr int kBarWidth = 30;

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return text;
}

}  // namespace

std::string seconds_text(double s) {
  char text[32];
  if (s < 60) {
    std::snprintf(text, sizeof text, "%.0f s", s);
  } else if (s < 3600) {
    std::snprintf(text, sizeof text, "%d min %02d s", static_cast<int>(s) / 60,
                  static_cast<int>(s) % 60);
  } else {
    std::snprintf(text, sizeof text, "%d h %02d min", static_cast<int>(s) / 3600,
                  static_cast<int>(s) % 3600 / 60);
  }
  return text;
}

Progress::Progress(std::string what, bool quiet, std::string unit)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      on_(!quiet),
      terminal_(::isatty(STDERR_FILENO) == 1),
      start_(Clock::now()),
      last_(start_) {}

std::string Progress::amount_text(double amount) const {
  if (unit_.empty()) return bytes_text(amount);
  char text[48];
  std::snprintf(text, sizeof text,
                amount < 10 && amount != static_cast<int64_t>(amount) ? "%.1f " : "%.0f ", amount);
  return text + unit_;
}

void Progress::update(int64_t done, int64_t total) {
  if (!on_) return;
  done_ = done;
  total_ = total;
  const Clock::time_point now = Clock::now();
  const double since_last = std::chrono::duration<double>(now - last_).count();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (since_last < (terminal_ ? kTerminalInterval : kLineInterval) && done < total) return;
  if (!terminal_ && done >= total && !printed_) return;  // short work: finish() stays silent
  last_ = now;
  const double fraction = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  std::string line = what_ + ": ";
  if (terminal_) {
    const int filled = static_cast<int>(fraction * kBarWidth);
    line = "\r" + line + "[" + std::string(static_cast<size_t>(filled), '#') +
           std::string(static_cast<size_t>(kBarWidth - filled), '.') + "] ";
  }
  char percent[16];
  std::snprintf(percent, sizeof percent, "%3.0f%%", 100 * fraction);
  line += std::string(percent) + " of " + amount_text(static_cast<double>(total)) + ", " +
          amount_text(rate) + "/s";
  if (done < total && rate > 0) {
    line += ", " + seconds_text(static_cast<double>(total - done) / rate) + " left";
  }
  line += terminal_ ? "   " : "\n";  // spaces: wipe a longer line drawn before
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  printed_ = true;
}

void Progress::finish() {
  if (!on_ || !printed_) return;
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  std::string line = terminal_ ? "\n" : "";
  line += what_ + ": done, " + amount_text(static_cast<double>(done_)) + " in " +
          seconds_text(elapsed) + "\n";
  std::fputs(line.c_str(), stderr);
  printed_ = false;
}

}  // namespace qkv::cli

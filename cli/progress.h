// Progress of long work on stderr (the key-value store's commands, attention
// over a store): a bar with the rate and the time left, redrawn in place,
// when stderr is a terminal; otherwise a plain line every few seconds and a
// last one when done; nothing with --quiet.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "qkv/chunk_source.h"

namespace qkv::cli {

class Progress {
 public:
  // `what` starts each line ("qkv store create"); `quiet` silences it.
  // `unit`: what is counted ("steps", "queries"); empty for bytes.
  Progress(std::string what, bool quiet, std::string unit = "");
  // `done` of `total` bytes (or units) so far.
  void update(int64_t done, int64_t total);
  // Ends the bar's line (terminal) or prints the last line (if any was printed).
  void finish();

 private:
  std::string amount_text(double amount) const;
  using Clock = std::chrono::steady_clock;
  std::string what_, unit_;
  bool on_, terminal_;
  Clock::time_point start_, last_;
  int64_t done_ = 0, total_ = 0;
  bool printed_ = false;
};

// A duration as a person reads it: "42 s", "3 min 05 s", "5 h 40 min".
std::string seconds_text(double seconds);

// The library's progress callback (qkv::StoreProgress) drawing `progress`,
// which must outlive the work.
inline StoreProgress report(Progress& progress) {
  return [&progress](int64_t done, int64_t total) { progress.update(done, total); };
}

}  // namespace qkv::cli

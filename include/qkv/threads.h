// The number of threads qkv's ops use. Results do not depend on it: work is
// split into blocks whose boundaries are fixed by the shapes alone, and no two
// threads ever add into the same element.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

namespace qkv {

// The most threads qkv runs, for set_num_threads, QKV_NUM_THREADS and the qkv
// command's --threads. Past the hardware's threads more only take turns on
// the same cores, and each costs: libgomp gives every thread its own stack
// (8 MiB of address space by default, so 1024 threads reserve 8 GiB) and
// starts a team with per-thread records on the caller's stack, which is what
// overflowed at --threads 100000. 1024 is above the hardware threads of the
// largest two-socket servers (2 x 192 cores x 2 = 768) and far below where
// thread creation fails.
inline constexpr int kMaxThreads = 1024;

// Sets the thread count for subsequent calls (1 <= n <= kMaxThreads); n = 0
// restores the default: the QKV_NUM_THREADS environment variable if it holds
// a whole number in [1, kMaxThreads] (otherwise it is ignored), else the
// number of cores OpenMP reports. Throws Error for n < 0 or n > kMaxThreads.
void set_num_threads(int n);

// The thread count in effect.
int num_threads();

// Stopping a long call from outside (Ctrl-C in Python). While an
// InterruptPoll lives on a thread, the parallel work of the calls that thread
// makes asks `stop()` between tasks, on that thread only and at most every
// kInterruptPollMs (the first time kInterruptPollMs after the poll began,
// so a short call never asks): once it says true, the tasks not yet started are skipped
// and the call throws qkv::Interrupted (below). A task is at most a
// few milliseconds of work, so a call stops within about that much after
// stop() first says true. Polls nest: the innermost one is asked.
inline constexpr int kInterruptPollMs = 20;
// Thrown by a call an InterruptPoll stopped: what it was computing is
// incomplete and must not be used. The Python bindings turn it into
// KeyboardInterrupt.
class Interrupted : public std::runtime_error {
 public:
  explicit Interrupted(const std::string& message) : std::runtime_error(message) {}
};
namespace kernels {
struct PollState;
}
class InterruptPoll {
 public:
  explicit InterruptPoll(bool (*stop)());
  ~InterruptPoll();
  InterruptPoll(const InterruptPoll&) = delete;
  InterruptPoll& operator=(const InterruptPoll&) = delete;

 private:
  std::unique_ptr<kernels::PollState> state_;
  kernels::PollState* previous_;
};

// qkv calls the BLAS single-threaded inside its own threads, so the pool of
// threads Debian's OpenBLAS (the pthread build) starts when it is loaded is
// never used; under an address-space limit (ulimit -v) those threads cannot
// get their buffers and keep the process from exiting. A program linking qkv
// avoids the pool with OPENBLAS_NUM_THREADS=1 in its environment from the
// start (the qkv command re-runs itself with it).

}  // namespace qkv

// Threading for the fast kernels. qkv owns the parallelism: work is cut into
// tasks whose boundaries depend only on the shapes, the tasks run on
// qkv::num_threads() OpenMP threads, and every BLAS call inside a task is
// single-threaded. So results are bitwise the same for any thread count, and
// OpenBLAS's own threads never oversubscribe our two cores.
#pragma once

#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include "qkv/threads.h"

namespace qkv::kernels {

// Keeps OpenBLAS single-threaded while it lives (kernels/runtime/parallel.cc): qkv calls
// the BLAS from inside its own tasks, and OpenBLAS's threads would fight
// them for the cores. The first of any number of live guards (nested, or on
// other threads) sets OpenBLAS to one thread and the last restores the count
// it had, so a program that also uses OpenBLAS itself (NumPy and PyTorch in
// a Python process load the same libopenblas) keeps its threads between qkv
// calls. parallel_for and every BLAS call of qkv hold one.
class BlasSingleThreaded {
 public:
  BlasSingleThreaded();
  ~BlasSingleThreaded();
  BlasSingleThreaded(const BlasSingleThreaded&) = delete;
  BlasSingleThreaded& operator=(const BlasSingleThreaded&) = delete;
};

// The threads a parallel_for of this thread may use: qkv::num_threads(), or
// 1 while a SerialScope of this thread lives.
int current_num_threads();

// Runs every parallel_for of the calling thread on that thread alone while
// it lives. The front ends open one for problems too small to pay for a
// parallel region: waking a second OpenMP thread costs ~10 us with
// OMP_WAIT_POLICY=passive, where d2l's toy attention (B = 2, Nq = 1,
// Nk = 10) computes in under 1 us. Task cuts depend on the shapes alone, so
// the results are the same bits either way.
class SerialScope {
 public:
  SerialScope();
  ~SerialScope();
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;
};

// The InterruptPoll living on this thread (qkv/threads.h): its stop() and
// when to ask it next (kInterruptPollMs after it was last asked, or after
// the poll began: a call shorter than that never takes the GIL). Null when
// none lives, and inside a run_tasks' tasks, so only the outermost polls.
struct PollState {
  bool (*stop)() = nullptr;
  std::chrono::steady_clock::time_point next;
};
PollState* current_poll();
// Hides this thread's poll while it lives (run_tasks, around its tasks).
class HiddenPoll {
 public:
  HiddenPoll();
  ~HiddenPoll();
  HiddenPoll(const HiddenPoll&) = delete;
  HiddenPoll& operator=(const HiddenPoll&) = delete;

 private:
  PollState* hidden_;
};

// Runs body(task, thread) for task in [0, num_tasks) on up to `threads`
// OpenMP threads (thread: the running thread's number, 0 the caller's), the
// one place qkv's tasks run. body must not throw. Under an InterruptPoll the
// calling thread asks it between its tasks (every kInterruptPollMs at most);
// once it says stop, the tasks not started are skipped and run_tasks throws
// Interrupted.
template <class Body>
void run_tasks(int64_t num_tasks, int threads, Body&& body) {
  PollState* const poll = current_poll();
  if (poll == nullptr) {
    if (threads <= 1 || num_tasks <= 1) {
      for (int64_t t = 0; t < num_tasks; ++t) body(t, 0);
      return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < num_tasks; ++t) body(t, omp_get_thread_num());
    return;
  }
  const HiddenPoll hidden;
  std::atomic<bool> stopped{false};
  using Clock = std::chrono::steady_clock;
  const auto run = [&](int64_t t, int thread) {
    // Thread 0 is the caller's own: the poll's thread.
    if (thread == 0 && Clock::now() >= poll->next) {
      if (poll->stop()) stopped.store(true, std::memory_order_relaxed);
      poll->next = Clock::now() + std::chrono::milliseconds(kInterruptPollMs);
    }
    if (!stopped.load(std::memory_order_relaxed)) body(t, thread);
  };
  if (threads <= 1 || num_tasks <= 1) {
    for (int64_t t = 0; t < num_tasks; ++t) run(t, 0);
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < num_tasks; ++t) run(t, omp_get_thread_num());
  }
  if (stopped.load()) throw Interrupted("qkv: the call was stopped before it finished");
}

// Runs body(task) for task in [0, num_tasks), in parallel when there is more
// than one thread (run_tasks: body must not throw; an InterruptPoll can stop it).
template <class Body>
void parallel_for(int64_t num_tasks, Body&& body) {
  const BlasSingleThreaded blas;
  run_tasks(num_tasks, current_num_threads(), [&](int64_t t, int) { body(t); });
}

}  // namespace qkv::kernels

// Threading for the fast kernels. qkv owns the parallelism: work is cut into
// tasks whose boundaries depend only on the shapes, the tasks run on
// qkv::num_threads() OpenMP threads, and every BLAS call inside a task is
// single-threaded. So results are bitwise the same for any thread count, and
// OpenBLAS's own threads never oversubscribe our two cores.
#pragma once

#include <cstdint>

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

// Runs body(task) for task in [0, num_tasks), in parallel when there is more
// than one thread. body must not throw.
template <class Body>
void parallel_for(int64_t num_tasks, Body&& body) {
  const BlasSingleThreaded blas;
  const int threads = current_num_threads();
  if (threads <= 1 || num_tasks <= 1) {
    for (int64_t t = 0; t < num_tasks; ++t) body(t);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < num_tasks; ++t) body(t);
}

}  // namespace qkv::kernels

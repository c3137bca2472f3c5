// Scratch handed to a kernel (both families: attention and regression).
// Kernels allocate nothing: each op's scratch is sized by its
// *_workspace_size function for the threads the call may use; the front end
// allocates it once per call and passes it in.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/runtime/parallel.h"

namespace qkv::kernels {

// `data` holds the doubles (8-byte words) its *_workspace_size asked for,
// sized for `num_threads` >= 1 (at most that many of the kernel's tasks hold
// scratch at once; results do not depend on it). Kernels of other element
// types cut typed slices from it with take_slice below.
struct Workspace {
  double* data = nullptr;
  int num_threads = 1;
};

// Slices cut from a workspace start on 64 bytes, the alignment the kernels'
// own allocations had (hwy::AllocateAligned, a cache line).
inline constexpr size_t kWorkspaceAlign = 64;

// Doubles a slice of n elements of T takes, alignment slack included.
template <class T>
size_t slice_words(int64_t n) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(T);
  return (bytes + kWorkspaceAlign + sizeof(double) - 1) / sizeof(double);
}

// The next slice of n elements of T at `*cursor` (aligned to kWorkspaceAlign),
// advancing the cursor by slice_words<T>(n).
template <class T>
T* take_slice(double** cursor, int64_t n) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(*cursor);
  const uintptr_t aligned = (p + kWorkspaceAlign - 1) & ~(uintptr_t{kWorkspaceAlign} - 1);
  *cursor += slice_words<T>(n);
  return reinterpret_cast<T*>(aligned);
}

// Cuts slices one after another from `at`, or, with at == nullptr, only
// counts their words: one layout function then both sizes a workspace (the
// *_workspace_size query) and cuts it (the kernel), so the two cannot drift.
class Slicer {
 public:
  explicit Slicer(double* at) : at_(at) {}
  template <class T>
  T* take(int64_t n) {
    words_ += slice_words<T>(n);
    return at_ ? take_slice<T>(&at_, n) : nullptr;
  }
  size_t words() const { return words_; }

 private:
  double* at_;
  size_t words_ = 0;
};

// The words a layout function cuts, run on a counting Slicer: the size
// query of a kernel whose layout(Slicer&) is also what cuts its workspace.
template <class Layout>
size_t counted_words(Layout&& layout) {
  Slicer count(nullptr);
  layout(count);
  return count.words();
}

// parallel_for whose body also gets a slot in [0, num_slots): the OpenMP
// thread running the task, so that no two tasks running at once share a
// slot's scratch. At most num_slots threads run. Which slot a task gets
// depends on timing, so a task must not leave anything in its slot that a
// later task reads.
template <class Body>
void parallel_for_slots(int64_t num_tasks, int num_slots, Body&& body) {
  const BlasSingleThreaded blas;
  run_tasks(num_tasks, std::min(current_num_threads(), std::max(num_slots, 1)), body);
}

}  // namespace qkv::kernels

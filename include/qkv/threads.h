// The number of threads qkv's ops use. Results do not depend on it: work is
// split into blocks whose boundaries are fixed by the shapes alone, and no two
// threads ever add into the same element.
#pragma once

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

// qkv calls the BLAS single-threaded inside its own threads, so the pool of
// threads Debian's OpenBLAS (the pthread build) starts when it is loaded is
// never used; under an address-space limit (ulimit -v) those threads cannot
// get their buffers and keep the process from exiting. A program linking qkv
// avoids the pool with OPENBLAS_NUM_THREADS=1 in its environment from the
// start (the qkv command re-runs itself with it).

}  // namespace qkv

// The number of threads qkv's ops use. Results do not depend on it: work is
// split into blocks whose boundaries are fixed by the shapes alone, and no two
// threads ever add into the same element.
#pragma once

namespace qkv {

// Sets the thread count for subsequent calls (n >= 1); n = 0 restores the
// default: the QKV_NUM_THREADS environment variable if set, else the number
// of cores OpenMP reports. Throws Error for n < 0.
void set_num_threads(int n);

// The thread count in effect.
int num_threads();

}  // namespace qkv

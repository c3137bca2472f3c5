// qkv's threads and OpenBLAS's (see parallel.h): the guard that keeps
// OpenBLAS single-threaded inside qkv's tasks, and the serial scopes.
#include "kernels/runtime/parallel.h"

#include <cblas.h>

#include <chrono>
#include <memory>
#include <mutex>

#include "qkv/threads.h"

namespace qkv::kernels {

namespace {

// The live guards and the OpenBLAS thread count before the first of them.
std::mutex blas_threads_mutex;
int blas_guards = 0;
int blas_threads_before = 1;

}  // namespace

BlasSingleThreaded::BlasSingleThreaded() {
  const std::lock_guard<std::mutex> lock(blas_threads_mutex);
  if (blas_guards++ == 0) {
    blas_threads_before = openblas_get_num_threads();
    if (blas_threads_before != 1) openblas_set_num_threads(1);
  }
}

BlasSingleThreaded::~BlasSingleThreaded() {
  const std::lock_guard<std::mutex> lock(blas_threads_mutex);
  if (--blas_guards == 0 && blas_threads_before != 1) {
    openblas_set_num_threads(blas_threads_before);
  }
}

namespace {
thread_local int serial_scopes = 0;  // live SerialScopes of this thread
}  // namespace

SerialScope::SerialScope() { ++serial_scopes; }
SerialScope::~SerialScope() { --serial_scopes; }

int current_num_threads() { return serial_scopes > 0 ? 1 : qkv::num_threads(); }

namespace {
thread_local PollState* live_poll = nullptr;  // the innermost live InterruptPoll's
}  // namespace

PollState* current_poll() { return live_poll; }

HiddenPoll::HiddenPoll() : hidden_(live_poll) { live_poll = nullptr; }
HiddenPoll::~HiddenPoll() { live_poll = hidden_; }

}  // namespace qkv::kernels

namespace qkv {

InterruptPoll::InterruptPoll(bool (*stop)())
    : state_(std::make_unique<kernels::PollState>()), previous_(kernels::live_poll) {
  state_->stop = stop;
  state_->next = std::chrono::steady_clock::now() + std::chrono::milliseconds(kInterruptPollMs);
  kernels::live_poll = state_.get();
}
InterruptPoll::~InterruptPoll() { kernels::live_poll = previous_; }

}  // namespace qkv

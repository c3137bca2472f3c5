// The key-value store's files as memory (qkv/store.h's MappedFile): mapped,
// or read when small, with the guard that turns a read past a file cut
// under it (SIGBUS) into zeros and then an Error; and opening only regular
// files (store/regular_file.h).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "qkv/error.h"
#include "qkv/store.h"
#include "store/regular_file.h"

namespace qkv {
namespace {
std::string errno_text(int error) { return std::strerror(error); }
}  // namespace

std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

int open_regular_file(std::string_view function, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail(function, path + ": cannot open: " + errno_text(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    fail(function, path + ": cannot stat: " + errno_text(error));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(function, path + ": not a regular file (" + kind_of(st.st_mode) +
                       "); a store's, an index's and a model's files are regular files");
  }
  return fd;
}

std::string read_text_file(std::string_view function, const std::string& path, size_t max_bytes,
                           std::string_view what) {
  const int fd = open_regular_file(function, path);
  std::string text;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      fail(function, path + ": cannot read: " + errno_text(error));
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > max_bytes) {
      ::close(fd);
      fail(function, path + ": larger than " + std::to_string(max_bytes >> 20) + " MiB; not " +
                         std::string(what));
    }
  }
  ::close(fd);
  return text;
}

NpyHeader checked_npy_header(std::string_view function, const MappedFile& file,
                             std::string_view descr, const Shape& shape, std::string_view what) {
  NpyHeader header;
  try {
    header = parse_npy_header(file.data(), file.size(), file.path());
  } catch (const Error& e) {
    // "parse_npy_header: <path>: <what>" told as the caller's own error.
    std::string message = e.what();
    const std::string prefix = "parse_npy_header: ";
    if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
    fail(function, message + " (the " + std::string(what) + " file is damaged or truncated)");
  }
  if (header.descr != descr || !(header.shape == shape)) {
    fail(function, file.path() + ": holds " + header.descr + " " + header.shape.str() +
                       " but the manifest says " + std::string(descr) + " " + shape.str() +
                       " (the " + std::string(what) + " file was replaced)");
  }
  return header;
}

// ---- MappedFile, and the guard against reads past a truncated file's end

namespace {

// The guard: a record per live mapping, which the SIGBUS handler reads
// without a lock (a handler may take none). A slot is claimed by a CAS on
// `end`, then published by storing `begin`; freed by clearing `begin`,
// then `end`. 16,384 slots: the mapped-chunk caches of 16 stores at once
// (KeyValueStore::kMappedChunks = 512 chunks, two files each); a mapping
// that finds no free slot is unguarded, as every mapping was before.
struct GuardSlot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<bool> faulted{false};
};
constexpr size_t kGuardSlots = 16384;
GuardSlot guard_slots[kGuardSlots];
struct sigaction sigbus_before;  // the handler the guard replaced
uintptr_t page_bytes = 4096;     // sysconf(_SC_PAGESIZE), read when the guard is installed

// A fault inside a guarded mapping (the file was truncated under it): the
// mapping from the faulting page to its end becomes private zero pages, so
// the read goes on, and the slot is marked for check_unchanged(). mmap is
// not on POSIX's list of async-signal-safe functions but is a plain system
// call on Linux, which is what this relies on. A fault anywhere else goes
// to the handler that was there before: the guard steps aside and the
// faulting access runs again under it (a SIGBUS sent by kill is re-raised).
void on_sigbus(int signal, siginfo_t* info, void* context) {
  const auto at = reinterpret_cast<uintptr_t>(info->si_addr);
  if (info->si_code > 0) {  // from the kernel, for an access at si_addr
    for (GuardSlot& slot : guard_slots) {
      const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
      if (begin == 0 || at < begin) continue;
      const uintptr_t end = slot.end.load(std::memory_order_acquire);
      if (at >= end) continue;
      const uintptr_t page = at & ~(page_bytes - 1);
      void* zeros = ::mmap(reinterpret_cast<void*>(page), end - page, PROT_READ,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (zeros == MAP_FAILED) break;
      slot.faulted.store(true, std::memory_order_release);
      return;
    }
  }
  ::sigaction(SIGBUS, &sigbus_before, nullptr);
  if (info->si_code <= 0) {
    ::raise(signal);
  } else if ((sigbus_before.sa_flags & SA_SIGINFO) != 0 && sigbus_before.sa_sigaction != nullptr) {
    sigbus_before.sa_sigaction(signal, info, context);
  }
}

void install_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    page_bytes = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &sigbus_before);
  });
}

// The slot now guarding [data, data + size rounded up to pages), or -1.
int guard(const unsigned char* data, size_t size) {
  install_guard();
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + (size + page_bytes - 1) / page_bytes * page_bytes;
  for (size_t i = 0; i < kGuardSlots; ++i) {
    uintptr_t free = 0;
    if (guard_slots[i].end.compare_exchange_strong(free, end, std::memory_order_acq_rel)) {
      guard_slots[i].faulted.store(false, std::memory_order_relaxed);
      guard_slots[i].begin.store(begin, std::memory_order_release);
      return static_cast<int>(i);
    }
  }
  return -1;
}

void unguard(int slot) {
  if (slot < 0) return;
  guard_slots[slot].begin.store(0, std::memory_order_release);
  guard_slots[slot].end.store(0, std::memory_order_release);
}

}  // namespace

MappedFile::MappedFile(std::string_view function, const std::string& path) : path_(path) {
  const int fd = open_regular_file(function, path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    fail(function, path + ": cannot stat: " + errno_text(error));
  }
  size_ = static_cast<size_t>(st.st_size);
  device_ = static_cast<uint64_t>(st.st_dev);
  inode_ = static_cast<uint64_t>(st.st_ino);
  if (size_ <= kCopyBytes) {
    copy_ = std::make_unique<unsigned char[]>(std::max<size_t>(size_, 1));
    size_t done = 0;
    while (done < size_) {
      const ssize_t n = ::pread(fd, copy_.get() + done, size_ - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int error = n < 0 ? errno : 0;
        ::close(fd);
        fail(function,
             path + (n < 0 ? ": cannot read: " + errno_text(error)
                           : ": changed while it was read (it was " + std::to_string(size_) +
                                 " bytes and ended at " + std::to_string(done) + ")"));
      }
      done += static_cast<size_t>(n);
    }
    data_ = copy_.get();
  } else {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      fail(function,
           path + ": cannot map " + std::to_string(size_) + " bytes: " + errno_text(error));
    }
    data_ = static_cast<const unsigned char*>(p);
    guard_slot_ = guard(data_, size_);
  }
  ::close(fd);  // the mapping keeps the file
}

void MappedFile::unmap() {
  unguard(guard_slot_);
  if (data_ != nullptr && !copy_) ::munmap(const_cast<unsigned char*>(data_), size_);
  copy_.reset();
  data_ = nullptr;
  size_ = 0;
  guard_slot_ = -1;
}

MappedFile::~MappedFile() { unmap(); }

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(other.data_),
      size_(other.size_),
      copy_(std::move(other.copy_)),
      path_(std::move(other.path_)),
      device_(other.device_),
      inode_(other.inode_),
      guard_slot_(other.guard_slot_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.guard_slot_ = -1;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    unmap();
    data_ = other.data_;
    size_ = other.size_;
    copy_ = std::move(other.copy_);
    path_ = std::move(other.path_);
    device_ = other.device_;
    inode_ = other.inode_;
    guard_slot_ = other.guard_slot_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.guard_slot_ = -1;
  }
  return *this;
}

bool MappedFile::unchanged() const {
  if (copy_) return true;  // read whole when opened: what it holds cannot change
  if (guard_slot_ >= 0 && guard_slots[guard_slot_].faulted.load(std::memory_order_acquire))
    return false;
  struct stat st;
  return ::stat(path_.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == device_ &&
         static_cast<uint64_t>(st.st_ino) == inode_ && static_cast<size_t>(st.st_size) == size_;
}

void MappedFile::check_unchanged(std::string_view function) const {
  if (unchanged()) return;
  struct stat st;
  std::string now;
  if (::stat(path_.c_str(), &st) != 0) {
    now = "it is gone: " + errno_text(errno);
  } else if (static_cast<uint64_t>(st.st_ino) != inode_ ||
             static_cast<uint64_t>(st.st_dev) != device_) {
    now = "another file took its place";
  } else {
    now = "it was " + std::to_string(size_) + " bytes and is " + std::to_string(st.st_size);
  }
  fail(function,
       path_ + ": changed while it was read (" + now + "); what was computed from it is discarded");
}

void MappedFile::prefetch() const {
  if (data_ == nullptr || copy_) return;
  // A file already in the page cache needs no read-ahead, and asking for it
  // costs: WILLNEED walks every page of the range (about 1 ms per 128 MiB
  // chunk pair, 18 % of a warm Q = 1 pass over 10^7 rows). So 16 pages spread
  // over the file are probed first (mincore), and a file they all find
  // cached is left alone.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t pages = (size_ + page - 1) / page;
  bool cached = true;
  for (size_t probe = 0; probe < 16 && cached; ++probe) {
    unsigned char in = 0;
    const size_t at = pages * probe / 16 * page;
    cached = ::mincore(const_cast<unsigned char*>(data_) + at, 1, &in) == 0 && (in & 1) != 0;
  }
  if (!cached) ::madvise(const_cast<unsigned char*>(data_), size_, MADV_WILLNEED);
}

}  // namespace qkv

// Output files (qkv/staged_file.h): a temporary file beside the destination,
// flushed and renamed over it; symlinks followed to their target; devices and
// FIFOs written through; and the table of live temporary files and
// directories that remove_staged_files() removes from a signal handler.
#include "qkv/staged_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "io/directories.h"
#include "qkv/error.h"

namespace qkv {
namespace {

namespace fs = std::filesystem;

// ---- the temporary files alive in this process, for signal handlers

// A slot holds one temporary file's path. A signal handler may run at any
// moment, in any thread, so the table is fixed storage and lock-free atomics:
// the handler reads a slot's state and unlinks its path, nothing else. The
// path is listed before the file is created (mkstemp fills in the name in
// the slot itself) and unlisted only after it is renamed or removed, so no
// moment exists where the file is there but not listed. A handler that reads
// a half-written name unlinks nothing.
// 64 slots: the qkv command stages at most 3 files at once and a figure 1;
// a file staged when every slot is taken is still removed on failure, only
// not by remove_staged_files().
// A slot lists a file (kListed) or a StagedDirectory's temporary directory
// (kListedDirectory), which the handler removes with all it holds.
constexpr int kSlots = 64;
enum SlotState : int { kFree = 0, kClaimed = 1, kListed = 2, kListedDirectory = 3 };
std::atomic<int> slot_state[kSlots];
char slot_path[kSlots][PATH_MAX];
static_assert(std::atomic<int>::is_always_lock_free, "signal handlers need lock-free atomics");

// Claims a slot and copies `pattern` into it; -1 if none is free or the
// pattern is too long. The path at slot_path[slot] is then listed, as a
// file or as a directory.
int list_temp(const std::string& pattern, SlotState as = kListed) {
  if (pattern.size() >= PATH_MAX) return -1;
  for (int slot = 0; slot < kSlots; ++slot) {
    int expected = kFree;
    if (slot_state[slot].compare_exchange_strong(expected, kClaimed)) {
      std::memcpy(slot_path[slot], pattern.c_str(), pattern.size() + 1);
      slot_state[slot].store(as);
      return slot;
    }
  }
  return -1;
}

// Removes the directory `name` (relative to the open directory `parent`)
// and all it holds, with system calls only (openat, getdents64, unlinkat,
// close): async-signal-safe, which opendir/readdir (malloc) and
// std::filesystem are not. A staged store inside a staged search index is
// two levels; links are removed, never followed.
void remove_tree_at(int parent, const char* name, int depth) noexcept {
  const int fd = ::openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  // Entries removed while a directory is read may move the ones after them:
  // read it again until a pass removes nothing.
  for (bool removed = true; removed;) {
    removed = false;
    ::lseek(fd, 0, SEEK_SET);
    alignas(8) char buffer[4096];
    for (ssize_t n; (n = ::getdents64(fd, buffer, sizeof buffer)) > 0;) {
      for (ssize_t at = 0; at < n;) {
        const auto* entry = reinterpret_cast<const struct dirent64*>(buffer + at);
        at += entry->d_reclen;
        const char* entry_name = entry->d_name;
        if (std::strcmp(entry_name, ".") == 0 || std::strcmp(entry_name, "..") == 0) continue;
        if (entry->d_type == DT_DIR && depth < 8) remove_tree_at(fd, entry_name, depth + 1);
        removed |= ::unlinkat(fd, entry_name, entry->d_type == DT_DIR ? AT_REMOVEDIR : 0) == 0;
      }
    }
  }
  ::close(fd);
}

void unlist_temp(int slot) {
  if (slot >= 0) slot_state[slot].store(kFree);
}

// ---- paths

bool is_path_problem(int error) {
  switch (error) {
    case EACCES:
    case EPERM:
    case ENOENT:
    case ENOTDIR:
    case EROFS:
    case EISDIR:
    case ENAMETOOLONG:
    case ELOOP:
    case ENXIO:
      return true;
    default:
      return false;
  }
}

// "<name> <path>", or the path alone; an empty path shows as "".
std::string label(std::string_view name, const std::string& path) {
  const std::string shown = path.empty() ? std::string("\"\"") : path;
  return name.empty() ? shown : std::string(name) + " " + shown;
}

// The file `path` ends at once symlinks in its last component are followed
// (a link to a link to a file gives the file), relative targets taken from the
// link's directory; it need not exist yet (a dangling link gives its target).
std::string follow_links(std::string_view function, const std::string& where, std::string path) {
  for (int hops = 0;; ++hops) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
    // The kernel's own limit on a chain of links (MAXSYMLINKS).
    if (hops == 40) fail(function, where + ": too many levels of symbolic links");
    std::string target(PATH_MAX, '\0');
    const ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
    if (n < 0) {
      fail(function,
           where + ": cannot read the symbolic link " + path + ": " + std::strerror(errno));
    }
    target.resize(static_cast<size_t>(n));
    const fs::path t(target);
    path = t.is_absolute() ? target : (fs::path(path).parent_path() / t).string();
  }
}

fs::path directory_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// Linux reports the umask in /proc/self/status; reading it with umask(2)
// would change it for a moment in every thread.
mode_t current_umask() {
  mode_t mask = 022;
  if (std::FILE* f = std::fopen("/proc/self/status", "re")) {
    char line[256];
    while (std::fgets(line, sizeof line, f)) {
      unsigned value;
      if (std::sscanf(line, "Umask: %o", &value) == 1) {
        mask = static_cast<mode_t>(value);
        break;
      }
    }
    std::fclose(f);
  }
  return mask;
}

// The key two outputs share if they lead to the same regular file: the real
// path of the directory and the final name. Empty for devices and FIFOs,
// which may well be named twice (--out /dev/null --weights /dev/null).
std::string same_file_key(std::string_view function, const std::string& where,
                          const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return {};
  const std::string target = follow_links(function, where, path);
  char real[PATH_MAX];
  if (::realpath(directory_of(target).c_str(), real) == nullptr) return target;
  return (fs::path(real) / fs::path(target).filename()).string();
}

size_t write_all(int fd, const char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return done;
    done += static_cast<size_t>(n);
  }
  return done;
}

}  // namespace

void check_output_path(std::string_view function, std::string_view name, const std::string& path) {
  const std::string where = label(name, path);
  if (path.empty()) fail(function, where + ": the path is empty; expected a file name");
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) fail(function, where + ": is a directory");
    if (!S_ISREG(st.st_mode)) return;  // a device or FIFO, written through
  }
  const std::string target = follow_links(function, where, path);
  if (!fs::path(target).has_filename()) {
    fail(function, where + ": names a directory; expected a file name");
  }
  const std::string dir = directory_of(target).string();
  struct stat dir_st;
  int error = 0;
  if (::stat(dir.c_str(), &dir_st) != 0) {
    error = errno;
  } else if (!S_ISDIR(dir_st.st_mode)) {
    error = ENOTDIR;
  } else if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    error = errno;
  }
  if (error != 0) {
    fail(function, where + ": cannot create a file in " + dir + ": " + std::strerror(error));
  }
}

void check_output_paths(std::string_view function,
                        const std::vector<std::pair<std::string, std::string>>& outputs) {
  std::vector<std::string> keys;
  for (const auto& [name, path] : outputs) {
    check_output_path(function, name, path);
    keys.push_back(same_file_key(function, label(name, path), path));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (!keys[i].empty() && keys[i] == keys[j]) {
        fail(function, outputs[j].first + " and " + outputs[i].first + " name the same file " +
                           outputs[i].second);
      }
    }
  }
}

StagedFile::StagedFile(std::string_view function, std::string_view name, std::string path)
    : function_(function), name_(name), path_(std::move(path)) {
  check_output_path(function_, name_, path_);
  struct stat st;
  std::string pattern;
  mode_t mode = 0;
  if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    // A device or FIFO has no directory to stage in beside it (/dev), and is
    // never replaced: the content waits in the temporary directory.
    write_through_ = true;
    target_ = path_;
    std::error_code ec;
    const fs::path tmp = fs::temp_directory_path(ec);
    pattern = ((ec ? fs::path("/tmp") : tmp) / "qkv-output-XXXXXX").string();
  } else {
    target_ = follow_links(function_, where(), path_);
    // An existing file keeps its permissions, as open(2) with O_TRUNC would.
    // A new file gets what open(2) would give it, not mkstemp's 0600.
    mode = ::stat(target_.c_str(), &st) == 0 ? st.st_mode & 07777 : mode_after_umask(0666);
    // Long names are cut so the temporary name stays within NAME_MAX.
    const std::string base = fs::path(target_).filename().string().substr(0, 200);
    pattern = (directory_of(target_) / ("." + base + ".qkv-XXXXXX")).string();
  }
  const int slot = list_temp(pattern);
  char* name_buffer = slot >= 0 ? slot_path[slot] : pattern.data();
  fd_ = ::mkostemp(name_buffer, O_CLOEXEC);
  if (fd_ < 0) {
    const int error = errno;
    unlist_temp(slot);
    const std::string what = where() + ": cannot create a file in " +
                             fs::path(pattern).parent_path().string() + ": " + std::strerror(error);
    if (is_path_problem(error)) fail(function_, what);
    qkv::fail_io(function_, what);
  }
  temp_ = name_buffer;
  slot_ = slot;
  if (!write_through_ && ::fchmod(fd_, mode) != 0) {
    fail_io("cannot set the permissions of " + temp_, errno);
  }
}

StagedFile::StagedFile(StagedFile&& other) noexcept
    : function_(std::move(other.function_)),
      name_(std::move(other.name_)),
      path_(std::move(other.path_)),
      target_(std::move(other.target_)),
      temp_(std::move(other.temp_)),
      fd_(other.fd_),
      slot_(other.slot_),
      write_through_(other.write_through_),
      finished_(other.finished_) {
  other.temp_.clear();
  other.fd_ = -1;
  other.slot_ = -1;
}

StagedFile::~StagedFile() { discard(); }

void StagedFile::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_.empty()) ::unlink(temp_.c_str());
  temp_.clear();
  unlist_temp(slot_);
  slot_ = -1;
}

std::string StagedFile::where() const { return label(name_, path_); }

void StagedFile::fail_io(const std::string& what, int error) {
  const std::string message = where() + ": " + what + ": " + std::strerror(error);
  discard();  // a staged file that failed is of no more use
  qkv::fail_io(function_, message);
}

void StagedFile::write(std::string_view bytes) {
  if (write_all(fd_, bytes.data(), bytes.size()) < bytes.size()) fail_io("cannot write", errno);
}

long long StagedFile::size() {
  struct stat st;
  if (::fstat(fd_, &st) != 0) fail_io("cannot read back", errno);
  return st.st_size;
}

std::string StagedFile::tail(size_t n) {
  const auto file_size = static_cast<size_t>(size());
  n = std::min(n, file_size);
  std::string bytes(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got =
        ::pread(fd_, bytes.data() + done, n - done, static_cast<off_t>(file_size - n + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail_io("cannot read back", errno);
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  bytes.resize(done);
  return bytes;
}

void StagedFile::finish() {
  if (finished_ || write_through_) return;  // a write-through copy is read back in commit()
  // On disk before the rename, so a crash cannot leave a renamed but empty file.
  if (::fsync(fd_) != 0) fail_io("cannot flush to disk", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail_io("cannot write", errno);
  finished_ = true;
}

void StagedFile::commit() {
  finish();
  if (write_through_) {
    const int out = ::open(target_.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY);
    if (out < 0) {
      const int error = errno;
      const std::string what = where() + ": cannot open for writing: " + std::strerror(error);
      discard();
      if (is_path_problem(error)) fail(function_, what);
      qkv::fail_io(function_, what);
    }
    char buffer[65536];
    off_t offset = 0;
    for (;;) {
      const ssize_t got = ::pread(fd_, buffer, sizeof buffer, offset);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) {
        const int error = errno;
        ::close(out);
        fail_io("cannot read back", error);
      }
      if (got == 0) break;
      if (write_all(out, buffer, static_cast<size_t>(got)) < static_cast<size_t>(got)) {
        const int error = errno;
        ::close(out);
        fail_io("cannot write", error);
      }
      offset += got;
    }
    if (::close(out) != 0) fail_io("cannot write", errno);
    discard();
    return;
  }
  if (std::rename(temp_.c_str(), target_.c_str()) != 0) {
    fail_io("cannot rename the finished file into place", errno);
  }
  temp_.clear();
  unlist_temp(slot_);
  slot_ = -1;
  // The rename itself on disk too; a directory that cannot be synced (some
  // network file systems) loses only that guarantee, not the file.
  const int dir = ::open(directory_of(target_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void write_files(std::string_view function, const std::vector<OutputBytes>& files) {
  std::vector<std::pair<std::string, std::string>> outputs;
  for (const OutputBytes& file : files) outputs.emplace_back(file.name, file.path);
  check_output_paths(function, outputs);
  std::vector<StagedFile> staged;
  staged.reserve(files.size());
  for (const OutputBytes& file : files) {
    staged.emplace_back(function, file.name, file.path);
    staged.back().write(file.bytes);
    staged.back().finish();
  }
  for (StagedFile& file : staged) file.commit();
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

StagedDirectory::StagedDirectory(std::string_view function, std::string path, Mode mode)
    : function_(function), path_(std::move(path)), mode_(mode) {
  if (path_.empty()) fail(function_, "the output directory's path is empty");
  struct stat st;
  const bool exists = ::lstat(path_.c_str(), &st) == 0;
  if (mode_ == Mode::kNew && exists) {
    fail(function_, path_ + ": already exists; give a new path");
  }
  if (mode_ == Mode::kReplace && !(exists && S_ISDIR(st.st_mode))) {
    fail(function_, path_ + ": not a directory to replace");
  }
  fs::path target(path_);
  if (!target.has_filename()) target = target.parent_path();
  parent_ = target.has_parent_path() ? target.parent_path().string() : ".";
  path_ = target.string();
  // Appended piece by piece: GCC 12 warns (-Wrestrict, falsely) on "." + string.
  std::string hidden = ".";
  hidden += target.filename().string();
  hidden += ".qkv-XXXXXX";
  temp_ = (fs::path(parent_) / hidden).string();
  // Listed before it is made (mkdtemp fills in the slot's own name), as a
  // StagedFile's temporary file is.
  slot_ = list_temp(temp_, kListedDirectory);
  char* name_buffer = slot_ >= 0 ? slot_path[slot_] : temp_.data();
  if (::mkdtemp(name_buffer) == nullptr) {
    const int error = errno;
    unlist_temp(slot_);
    slot_ = -1;
    temp_.clear();
    fail(function_,
         path_ + ": cannot create a directory in " + parent_ + ": " + std::strerror(error));
  }
  temp_ = name_buffer;
}

StagedDirectory::~StagedDirectory() {
  if (!temp_.empty()) {
    std::error_code ignored;
    fs::remove_all(temp_, ignored);
  }
  unlist_temp(slot_);
}

void StagedDirectory::commit() {
  // mkdtemp's 0700, opened up to what mkdir(2) would have given.
  ::chmod(temp_.c_str(), mode_after_umask(0777));
  sync_directory(temp_);
  const unsigned flags = mode_ == Mode::kNew ? RENAME_NOREPLACE : RENAME_EXCHANGE;
  if (::renameat2(AT_FDCWD, temp_.c_str(), AT_FDCWD, path_.c_str(), flags) != 0) {
    const int error = errno;
    if (error == EEXIST) fail(function_, path_ + ": already exists; give a new path");
    fail_io(function_,
            path_ + ": cannot rename the finished directory into place: " + std::strerror(error));
  }
  if (mode_ == Mode::kReplace) {
    // temp_ now names the old directory; a signal meanwhile removes it too.
    sync_directory(parent_);
    std::error_code ignored;
    fs::remove_all(temp_, ignored);
  }
  temp_.clear();
  unlist_temp(slot_);
  slot_ = -1;
  sync_directory(parent_);
}

unsigned mode_after_umask(unsigned mode) { return mode & ~static_cast<unsigned>(current_umask()); }

void remove_staged_files() noexcept {
  for (int slot = 0; slot < kSlots; ++slot) {
    const int state = slot_state[slot].load();
    if (state == kListed) ::unlink(slot_path[slot]);
    if (state == kListedDirectory) {
      remove_tree_at(AT_FDCWD, slot_path[slot], 0);
      ::rmdir(slot_path[slot]);
    }
  }
}

namespace {
// SignalWindow's state. A handler stores its signal first and reads the
// count second, and a closing window lowers the count first and takes the
// signal second, so whichever runs last sees the other: the signal is
// raised by one of them (by both at worst, which kills the process all the
// same), never by neither.
std::atomic<int> open_windows{0};
std::atomic<int> deferred_signal{0};
}  // namespace

SignalWindow::SignalWindow() noexcept { open_windows.fetch_add(1); }

SignalWindow::~SignalWindow() {
  if (open_windows.fetch_sub(1) != 1) return;
  if (const int signal_number = deferred_signal.exchange(0); signal_number != 0)
    ::raise(signal_number);
}

bool defer_signal(int signal_number) noexcept {
  deferred_signal.store(signal_number);
  if (open_windows.load() > 0) return true;
  deferred_signal.store(0);
  return false;
}

}  // namespace qkv

// Output files written the one way every qkv writer writes them (write_npy,
// the figures of plot.h, the qkv command): staged in a temporary file beside
// the destination, checked, flushed to disk and renamed over it, so a failure
// never leaves a partial file and never clobbers the old one.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace qkv {

// Where an output goes, decided from what `path` names when the file is staged:
// - nothing yet, or a regular file: the temporary file `.<name>.qkv-XXXXXX`
//   is created in the destination's directory and renamed over it. A symlink
//   is followed (through chains of links, relative targets taken from the
//   link's directory): its target is replaced, the link stays a link.
// - a character device or FIFO (/dev/null, /dev/stdout on a pipe, a named
//   pipe): staged in the system's temporary directory, then copied into it;
//   it is never replaced, renamed or truncated.
// - a directory or an empty path: an Error.
//
// Messages name the output as "<function>: <name> <path>: ..." (without
// "<function>: " when function is empty, without "<name> " when name is
// empty). Problems with the path itself (empty, a directory, a missing or
// unwritable directory, a loop of symlinks) throw Error; failures of the
// system while writing (a full disk, EFBIG, an I/O error) throw IoError.

// Checks, before any work is done, that `path` can be written as an output;
// throws Error if not. The writers check again when they stage.
void check_output_path(std::string_view function, std::string_view name, const std::string& path);
// The same for several outputs, (name, path) each, and an Error if two of them
// lead to the same regular file (through "..", "." or symlinks).
void check_output_paths(std::string_view function,
                        const std::vector<std::pair<std::string, std::string>>& outputs);

// One output being written. While it exists, its temporary file is listed for
// remove_staged_files(). If a call fails, or it is destroyed before commit(),
// it removes the temporary file and leaves the destination as it was.
class StagedFile {
 public:
  StagedFile(std::string_view function, std::string_view name, std::string path);
  ~StagedFile();
  StagedFile(StagedFile&& other) noexcept;
  StagedFile& operator=(StagedFile&&) = delete;
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  // The temporary file, open for reading and writing, for writers that need a
  // descriptor (gnuplot draws into it as its standard output).
  int fd() const { return fd_; }
  // Appends bytes to the temporary file.
  void write(std::string_view bytes);
  // The last `n` bytes of the temporary file (fewer if it is shorter), and its
  // size, for checks that the content is complete.
  std::string tail(size_t n);
  long long size();
  // Flushes the temporary file to disk (fsync) and closes it; commit() does it
  // if not done.
  void finish();
  // Puts the content into place: renames the temporary file over the
  // destination, or copies it into a device or FIFO.
  void commit();

  const std::string& path() const { return path_; }

 private:
  // Removes the temporary file and throws IoError "<where>: <what>: <error>".
  [[noreturn]] void fail_io(const std::string& what, int error);
  std::string where() const;
  void discard() noexcept;

  std::string function_, name_, path_;
  std::string target_;  // what path_ leads to: a symlink's target, or path_
  std::string temp_;    // the temporary file; empty once committed or discarded
  int fd_ = -1;
  int slot_ = -1;               // in the table remove_staged_files() reads, or -1
  bool write_through_ = false;  // a device or FIFO: copied into, not replaced
  bool finished_ = false;
};

// One output of write_files: its name for messages (e.g. "--out"), its path
// and its complete content.
struct OutputBytes {
  std::string name;
  std::string path;
  std::string_view bytes;
};

// Writes all the files or none: each is staged and flushed, and only when
// every one is are they committed, in order. On failure the temporary files
// are removed and no destination is touched. (Committing is a rename within a
// directory, which fails only if the file system does; files committed before
// such a failure stay.) The paths are checked by check_output_paths first.
void write_files(std::string_view function, const std::vector<OutputBytes>& files);

// A directory of outputs made whole or not at all (a key-value store, a
// search index): its files are written into the hidden temporary directory
// `.<name>.qkv-XXXXXX` beside `path`, then commit() syncs it and renames it
// to `path` (RENAME_NOREPLACE: a directory made there meanwhile is never
// replaced). Destroyed before commit(), it removes the temporary directory;
// while it lives, the directory is listed for remove_staged_files().
// Error if `path` already exists or is empty.
//
// Replacing (kReplace): `path` must be a directory already, and commit()
// swaps the new one in (RENAME_EXCHANGE: whoever opens `path` finds the old
// directory or the new one, whole), then removes the old one, which stays
// listed for remove_staged_files() until it is gone. Readers that opened
// the old one's files keep reading them.
class StagedDirectory {
 public:
  enum class Mode { kNew, kReplace };
  StagedDirectory(std::string_view function, std::string path, Mode mode = Mode::kNew);
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  // The temporary directory, to write the files into.
  const std::string& temp() const { return temp_; }
  void commit();

 private:
  std::string function_, path_, parent_, temp_;
  Mode mode_;
  int slot_ = -1;  // staged_file.cc's listing of temp_ for signal handlers
};

// Removes the temporary file of every StagedFile and the temporary
// directory (and all it holds) of every StagedDirectory alive in the
// process, with system calls only (unlink, and openat/getdents64/unlinkat
// for a directory): async-signal-safe, for a handler of SIGINT or SIGTERM
// that then re-raises the signal (the qkv command installs one). A process
// killed by a signal it cannot catch (SIGKILL) leaves them behind.
void remove_staged_files() noexcept;

// A stretch of a commit that a signal must not cut short: files already
// moved into place that only a manifest written next makes part of a whole
// (KeyValueStore::append renames its new chunks into the store, then
// replaces the manifest; a SIGINT between the two left up to 138 chunk
// files that nothing named). While one lives, a handler that calls
// defer_signal() is told to return, and the signal is raised again when
// the last window closes, once the store is whole (appended, or rolled
// back). The windows last milliseconds (renames and one fsync).
class SignalWindow {
 public:
  SignalWindow() noexcept;
  ~SignalWindow();
  SignalWindow(const SignalWindow&) = delete;
  SignalWindow& operator=(const SignalWindow&) = delete;
};

// For a signal handler, in any thread (async-signal-safe): true if a
// SignalWindow is open, and `signal_number` will be raised again when it
// closes (the handler should return at once); false otherwise.
bool defer_signal(int signal_number) noexcept;

}  // namespace qkv

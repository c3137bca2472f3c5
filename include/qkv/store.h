// An on-disk key-value store: the keys (N, D) and values (N, Dv) of an
// attention database, kept in a directory of chunk files (.npy, float32 or
// bfloat16, memory-mapped when read) and a manifest (manifest.json: the
// sizes, the dtype, each chunk's files and an XXH3-64 checksum of each).
// docs/scale.md has the format. Changes are atomic: new chunk files are
// written and flushed to disk under temporary names and renamed into place,
// and only then is the manifest replaced by a rename, so a crash or a kill at
// any point leaves the store as it was before the change or after it.
// The store is a chunk source (qkv/chunk_source.h): attention over a store
// (qkv/store_attention.h) reads it through that interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/chunk_source.h"
#include "qkv/tensor.h"

namespace qkv {

// 2^18 rows: at D = Dv = 64 in float32 a chunk's keys are 64 MiB, large
// enough that a chunk's attention call (and, read cold, its read) pays for
// its set-up, small enough that 10^7 rows make 39 chunks to share among
// threads or MPI ranks.
inline constexpr int64_t kDefaultChunkRows = int64_t{1} << 18;

// One chunk: rows [first_row, first_row + rows) of the store.
struct StoreChunk {
  int64_t first_row = 0;
  int64_t rows = 0;
  std::string keys_file, values_file;       // names inside the store's directory
  uint64_t keys_xxh3 = 0, values_xxh3 = 0;  // XXH3-64 of each whole file
};

// How much open() checks. kStructure: the manifest, and each chunk file's
// presence and size against it (a missing, truncated or replaced file; its
// .npy header is checked when the chunk is first read); O(chunks), about a
// microsecond each. kChecksums: every file's header and checksum too (an
// altered byte anywhere), which reads the whole store.
enum class StoreCheck { kStructure, kChecksums };

// A file mapped read-only into memory (MAP_SHARED: the page cache's pages,
// no copy), or, if it is at most kCopyBytes long, read into memory: for a
// small file a mapping costs more than the copy (munmap flushes the TLB of
// every core the process runs on: about 20 us, against 1 us to read 16 KiB)
// and takes one of the process's vm.max_map_count mappings. Moves, unmaps
// when destroyed.
//
// A file truncated while it is mapped would make a read past its new end
// fault (SIGBUS, which kills the process) or, inside its last page, read
// zeros. So while a MappedFile lives, a fault inside it is caught (a SIGBUS
// handler, installed with the first mapping, that puts zero pages in place
// of the missing ones and lets the read go on; any other SIGBUS goes to the
// handler before it), and check_unchanged() then reports the change: read
// the data, then call it before trusting what was computed from it.
class MappedFile {
 public:
  static constexpr size_t kCopyBytes = 64 * 1024;

  MappedFile() = default;
  // Maps (or reads) the whole of `path`; Error naming it if it cannot be opened or
  // mapped, or is not a regular file.
  MappedFile(std::string_view function, const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Asks the kernel to start reading the file into the page cache now
  // (madvise WILLNEED), so a cold read overlaps the work before it.
  void prefetch() const;
  // Whether the file is as it was mapped: no read has faulted past its end,
  // and its path names the same file (device and inode) of the same size.
  // Always for a file read into memory.
  bool unchanged() const;
  // Error "function: PATH: changed while it was read (...)" unless unchanged().
  void check_unchanged(std::string_view function) const;

 private:
  void unmap();

  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
  std::unique_ptr<unsigned char[]> copy_;  // a small file's bytes, which data_ points to
  std::string path_;
  uint64_t device_ = 0, inode_ = 0;
  int guard_slot_ = -1;  // the fault guard's record of this mapping (store.cc), or -1
};

class KeyValueStore : public ChunkSource {
 public:
  // Creates a new store at `dir` from keys (N, D) and values (N, Dv), any
  // strides, rounded to bfloat16 (to nearest, ties to even) for kBFloat16,
  // in chunks of at most `chunk_rows` rows (N = 0 makes an empty store).
  // `dir` must not exist; its parent must. The store is built in a
  // temporary directory beside it and renamed into place when complete, so
  // a failed or killed create leaves nothing at `dir`. Error for bad shapes,
  // a non-finite size or an existing `dir`; IoError when the system fails.
  static KeyValueStore create(const std::string& dir, ConstView<float> keys,
                              ConstView<float> values, StoreDtype dtype = StoreDtype::kFloat32,
                              int64_t chunk_rows = kDefaultChunkRows,
                              const StoreProgress& progress = {});
  // Opens an existing store, checking it as `check` says; Error naming the
  // file and what is wrong with it (a malformed manifest, a missing,
  // truncated or altered chunk).
  static KeyValueStore open(const std::string& dir, StoreCheck check = StoreCheck::kChecksums,
                            const StoreProgress& progress = {});

  // Appends rows: keys (N, D) and values (N, Dv) with this store's D and Dv,
  // as new chunks after the last (the last chunk is never rewritten, so it
  // may stay shorter than chunk_rows). Atomic: the chunk files are written,
  // flushed and renamed into place, then the manifest is replaced by a
  // rename. Holds the store's lock file (flock) meanwhile: a second appender
  // gets an Error at once and writes nothing. Reads the manifest again under
  // the lock, so appends by other processes since open() are kept; this
  // object then describes the store after the append.
  void append(ConstView<float> keys, ConstView<float> values, const StoreProgress& progress = {});

  // Reads every chunk file and checks its size, header and checksum against
  // the manifest; Error naming the first file that disagrees.
  void verify(const StoreProgress& progress = {}) const;

  // The chunk source (qkv/chunk_source.h). read_chunk maps chunk `index`'s
  // files when they are asked for, checking their sizes and headers against
  // the manifest then (Error "KeyValueStore::read_chunk: FILE: ..."), and
  // keeps the last kMappedChunks chunks read mapped, shared by copies of
  // this store: attention over a store in the page cache does not fault its
  // pages in again on every call (10^7 rows of d = dv = 64 are 1.25 million
  // 4 KiB pages), and a store of any number of chunks stays far below the
  // system's limit of mappings (vm.max_map_count, 65,530 by default). A
  // chunk kept mapped is checked again (its files' sizes) each time it is
  // read, and the returned chunk's check_intact() reports a file truncated
  // while it was being read (MappedFile). read_ahead maps the chunk and
  // starts reading it into the page cache (madvise WILLNEED); it throws
  // nothing (a damaged chunk is read_chunk's Error).
  static constexpr size_t kMappedChunks = 512;
  std::string name() const override { return "store " + dir_; }
  StoreDtype dtype() const override { return dtype_; }
  int64_t rows() const override { return rows_; }
  int64_t key_dim() const override { return key_dim_; }
  int64_t value_dim() const override { return value_dim_; }
  size_t num_chunks() const override { return chunks_.size(); }
  ChunkRange chunk_range(size_t index) const override;
  SourceChunk read_chunk(size_t index) const override;
  void read_ahead(size_t index) const override;

  const std::string& dir() const { return dir_; }
  int64_t chunk_rows() const { return chunk_rows_; }
  const std::vector<StoreChunk>& chunks() const { return chunks_; }
  // The bytes of all chunk files.
  int64_t file_bytes() const;

  // Parses a manifest's text (what open() reads from manifest.json);
  // Error naming `name` and what is wrong. For tests and the fuzzer.
  static KeyValueStore parse_manifest(std::string_view text, const std::string& name);
  // The manifest's text for this store: manifest_body() and its XXH3-64 as
  // the last member, "xxh3".
  std::string manifest_text() const;

 private:
  // Chunk `index`'s files mapped (store.cc's MappedChunk), with errors told
  // as `function`'s.
  struct MappedChunk;
  std::shared_ptr<const MappedChunk> map_checked(std::string_view function, size_t index) const;
  // The chunks mapped last (at most kMappedChunks), shared by copies of this store.
  struct Mappings;
  static std::shared_ptr<Mappings> no_mappings();
  std::shared_ptr<Mappings> mappings_ = no_mappings();
  // The manifest without its checksum: what the checksum is of.
  std::string manifest_body() const;
  // open()'s kStructure check, with errors told as `function`'s.
  void check_sizes(std::string_view function) const;
  // verify, with errors told as `function`'s.
  void check_checksums(std::string_view function, const StoreProgress& progress) const;

  std::string dir_;
  StoreDtype dtype_ = StoreDtype::kFloat32;
  int64_t rows_ = 0, key_dim_ = 0, value_dim_ = 0, chunk_rows_ = kDefaultChunkRows;
  std::vector<StoreChunk> chunks_;
};

}  // namespace qkv

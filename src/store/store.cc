// The on-disk key-value store (qkv/store.h): the manifest (JSON through
// nlohmann-json), chunk files written through StagedFile (temporary name,
// fsync, rename) with their XXH3-64 checksums formed as they are written,
// the lock file of appenders (flock), and the checks of open() and verify().
#include "qkv/store.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "io/directories.h"
#include "io/npy_header.h"
#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/npy.h"
#include "qkv/staged_file.h"
#include "store/manifest_json.h"
#include "store/regular_file.h"

// The checksum functions compiled into this file: no library to link, for
// qkv or for programs that link the installed static libqkv.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace qkv {
namespace {

namespace fs = std::filesystem;

constexpr const char* kManifest = "manifest.json";
constexpr const char* kLock = "lock";
constexpr const char* kFormat = "qkv key-value store";
constexpr int kVersion = 1;
// A manifest of 10^6 chunks is about 200 MB; past 1 GiB it is not one of ours.
constexpr size_t kMaxManifestBytes = size_t{1} << 30;
// Rows converted and written at a time: 4096 rows of D = 64 floats is 1 MiB,
// small next to a chunk and large enough that each write(2) is efficient.
constexpr int64_t kWriteRows = 4096;

std::string errno_text(int error) { return std::strerror(error); }

size_t item_size(StoreDtype dtype) { return dtype == StoreDtype::kFloat32 ? 4 : 2; }
const char* npy_descr(StoreDtype dtype) { return dtype == StoreDtype::kFloat32 ? "<f4" : "<u2"; }

std::string chunk_file_name(const char* what, size_t index) {
  char text[40];
  std::snprintf(text, sizeof text, "%s-%06zu.npy", what, index);
  return text;
}

// Whether `name` is what chunk_file_name(what, i) makes for some i: the
// files append may remove when no manifest names them (a user's own files in
// the directory stay).
bool is_chunk_file_name(const std::string& name, std::string_view what) {
  if (name.size() < what.size() + 11 || name.compare(0, what.size(), what) != 0 ||
      name[what.size()] != '-' || name.compare(name.size() - 4, 4, ".npy") != 0) {
    return false;
  }
  const size_t digits = name.size() - what.size() - 5;  // all but "<what>-" and ".npy"
  return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(what.size() + 1),
                     name.begin() + static_cast<std::ptrdiff_t>(what.size() + 1 + digits),
                     [](char c) { return c >= '0' && c <= '9'; });
}

// ---- the manifest

// ---- chunk files

// Writes rows [first, first + n) of `source` (N, dim) as a .npy chunk file
// of `dtype` through `file`, and returns the file's XXH3-64.
uint64_t write_chunk_file(StagedFile& file, ConstView<float> source, int64_t first, int64_t n,
                          StoreDtype dtype, std::vector<unsigned char>& buffer) {
  const int64_t dim = source.size(1);
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  const auto emit = [&](const void* bytes, size_t size) {
    XXH3_64bits_update(&state, bytes, size);
    file.write(std::string_view(static_cast<const char*>(bytes), size));
  };
  const std::string header = npy_header_bytes(npy_descr(dtype), Shape{n, dim});
  emit(header.data(), header.size());
  const size_t row_bytes = static_cast<size_t>(dim) * item_size(dtype);
  buffer.resize(static_cast<size_t>(std::min(n, kWriteRows)) * row_bytes);
  for (int64_t r0 = 0; r0 < n; r0 += kWriteRows) {
    const int64_t rows = std::min(kWriteRows, n - r0);
    for (int64_t r = 0; r < rows; ++r) {
      unsigned char* out = buffer.data() + static_cast<size_t>(r) * row_bytes;
      for (int64_t d = 0; d < dim; ++d) {
        const float x = source(first + r0 + r, d);
        if (dtype == StoreDtype::kFloat32) {
          std::memcpy(out + 4 * d, &x, 4);
        } else {
          const uint16_t bits = bfloat16(x).bits;
          std::memcpy(out + 2 * d, &bits, 2);
        }
      }
    }
    emit(buffer.data(), static_cast<size_t>(rows) * row_bytes);
  }
  file.finish();
  return XXH3_64bits_digest(&state);
}

void check_rows(std::string_view function, ConstView<float> keys, ConstView<float> values) {
  if (keys.rank() != 2) {
    fail(function, "keys has shape " + keys.shape().str() + "; expected rank 2 (N, D)");
  }
  if (values.rank() != 2) {
    fail(function, "values has shape " + values.shape().str() + "; expected rank 2 (N, Dv)");
  }
  if (keys.size(0) != values.size(0)) {
    fail(function, "keys has shape " + keys.shape().str() + " but values has shape " +
                       values.shape().str() + "; expected one value row per key row");
  }
  if (keys.size(1) < 1 || values.size(1) < 1) {
    fail(function, "keys has shape " + keys.shape().str() + " and values has shape " +
                       values.shape().str() + "; expected D >= 1 and Dv >= 1");
  }
}

// The lock of appenders: an flock on <dir>/lock, released when closed or
// when the process dies (a killed appender never leaves the store locked).
class StoreLock {
 public:
  StoreLock(std::string_view function, const std::string& dir) {
    const std::string path = (fs::path(dir) / kLock).string();
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd_ < 0)
      fail(function,
           "store " + dir + ": cannot open its lock file " + path + ": " + errno_text(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      ::close(fd_);
      if (error == EWOULDBLOCK) {
        fail_io(function, "store " + dir + " is being changed by another process (it holds " +
                              path + "); nothing was written, try again when it is done");
      }
      fail_io(function, "store " + dir + ": cannot lock " + path + ": " + errno_text(error));
    }
  }
  ~StoreLock() { ::close(fd_); }
  StoreLock(const StoreLock&) = delete;
  StoreLock& operator=(const StoreLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

std::string_view store_dtype_name(StoreDtype dtype) {
  return dtype == StoreDtype::kFloat32 ? "float32" : "bfloat16";
}

// ---- the manifest

KeyValueStore KeyValueStore::parse_manifest(std::string_view text, const std::string& name) {
  const ManifestReader in{"KeyValueStore::open", name};
  const Json json = in.parse(text,
                             {"format", "version", "dtype", "key_dim", "value_dim", "chunk_rows",
                              "rows", "chunks", "xxh3"},
                             kFormat, kVersion);
  KeyValueStore store;
  store.dtype_ = in.dtype(json);
  // Sizes far past any machine, but small enough that every byte count
  // below (rows x dim x 4) fits in 64 bits.
  constexpr int64_t kMaxDim = int64_t{1} << 24, kMaxRows = int64_t{1} << 36;
  store.key_dim_ = in.integer(json, "key_dim", "", 1, kMaxDim);
  store.value_dim_ = in.integer(json, "value_dim", "", 1, kMaxDim);
  store.chunk_rows_ = in.integer(json, "chunk_rows", "", 1, kMaxRows);
  store.rows_ = in.integer(json, "rows", "", 0, kMaxRows);
  const Json& chunks = in.member(json, "chunks", "");
  if (!chunks.is_array())
    in.fail(std::string("\"chunks\" is ") + chunks.type_name() + "; expected an array");
  int64_t first_row = 0;
  std::unordered_set<std::string> names;  // a set: 10^6 chunks name 2 x 10^6 files
  for (size_t c = 0; c < chunks.size(); ++c) {
    const std::string where = "chunks[" + std::to_string(c) + "] ";
    const Json& entry = chunks[c];
    if (!entry.is_object()) in.fail(where + "is " + entry.type_name() + "; expected an object");
    in.only(entry, {"rows", "keys", "keys_xxh3", "values", "values_xxh3"}, where);
    StoreChunk chunk;
    chunk.first_row = first_row;
    chunk.rows = in.integer(entry, "rows", where, 1, store.chunk_rows_);
    chunk.keys_file = in.file_name(entry, "keys", where);
    chunk.keys_xxh3 = in.checksum(entry, "keys_xxh3", where);
    chunk.values_file = in.file_name(entry, "values", where);
    chunk.values_xxh3 = in.checksum(entry, "values_xxh3", where);
    for (const std::string* file : {&chunk.keys_file, &chunk.values_file}) {
      if (*file == kManifest || *file == kLock || !names.insert(*file).second) {
        in.fail(where + "names the file \"" + *file + "\", which the store uses already");
      }
    }
    first_row += chunk.rows;
    if (first_row > kMaxRows)
      in.fail(where + "takes the store past " + std::to_string(kMaxRows) + " rows");
    store.chunks_.push_back(std::move(chunk));
  }
  if (first_row != store.rows_) {
    in.fail("\"rows\" is " + std::to_string(store.rows_) + " but the chunks hold " +
            std::to_string(first_row));
  }
  // The manifest's own checksum, last so every other mistake is named as
  // itself: over the text qkv writes for what was read, so an edit that
  // still parses (two chunk entries swapped, a size changed with the
  // rows) is found. Manifests written before qkv wrote it have none.
  if (json.contains("xxh3")) {
    const uint64_t want = in.checksum(json, "xxh3", "");
    const uint64_t got = XXH3_64bits(store.manifest_body().data(), store.manifest_body().size());
    if (got != want) {
      in.fail("its checksum \"xxh3\" " + hex64(want) + " does not match its contents' " +
              hex64(got) + " (the manifest was edited or damaged)");
    }
  }
  return store;
}

std::string KeyValueStore::manifest_text() const {
  // The body with one more member before its closing "\n}\n" (as dump(1)
  // writes an object): a manifest of 10^6 chunks is 200 MB, not built twice.
  const std::string body = manifest_body();
  return body.substr(0, body.size() - 3) + ",\n \"xxh3\": \"" +
         hex64(XXH3_64bits(body.data(), body.size())) + "\"\n}\n";
}

std::string KeyValueStore::manifest_body() const {
  Json chunks = Json::array();
  for (const StoreChunk& chunk : chunks_) {
    chunks.push_back(Json{{"rows", chunk.rows},
                          {"keys", chunk.keys_file},
                          {"keys_xxh3", hex64(chunk.keys_xxh3)},
                          {"values", chunk.values_file},
                          {"values_xxh3", hex64(chunk.values_xxh3)}});
  }
  const Json json{{"format", kFormat},
                  {"version", kVersion},
                  {"dtype", std::string(store_dtype_name(dtype_))},
                  {"key_dim", key_dim_},
                  {"value_dim", value_dim_},
                  {"chunk_rows", chunk_rows_},
                  {"rows", rows_},
                  {"chunks", chunks}};
  return json.dump(1) + "\n";
}

int64_t KeyValueStore::file_bytes() const {
  int64_t bytes = 0;
  for (const StoreChunk& chunk : chunks_) {
    bytes += static_cast<int64_t>(
        npy_header_bytes(npy_descr(dtype_), Shape{chunk.rows, key_dim_}).size() +
        npy_header_bytes(npy_descr(dtype_), Shape{chunk.rows, value_dim_}).size() +
        static_cast<size_t>(chunk.rows * (key_dim_ + value_dim_)) * item_size(dtype_));
  }
  return bytes;
}

// ---- chunk files: writing, checking

namespace {

// Writes rows [0, N) of keys and values as chunks numbered from `first_index`
// into `dir`, each file staged and renamed into place; returns the chunks.
std::vector<StoreChunk> write_chunks(std::string_view function, const std::string& dir,
                                     ConstView<float> keys, ConstView<float> values,
                                     StoreDtype dtype, int64_t chunk_rows, size_t first_index,
                                     int64_t first_row, const StoreProgress& progress) {
  std::vector<StoreChunk> chunks;
  std::vector<unsigned char> buffer;
  const int64_t n = keys.size(0);
  const int64_t row_bytes =
      (keys.size(1) + values.size(1)) * static_cast<int64_t>(item_size(dtype));
  for (int64_t r0 = 0; r0 < n; r0 += chunk_rows) {
    StoreChunk chunk;
    chunk.first_row = first_row + r0;
    chunk.rows = std::min(chunk_rows, n - r0);
    const size_t index = first_index + chunks.size();
    chunk.keys_file = chunk_file_name("keys", index);
    chunk.values_file = chunk_file_name("values", index);
    StagedFile keys_out(function, "keys chunk", (fs::path(dir) / chunk.keys_file).string());
    chunk.keys_xxh3 = write_chunk_file(keys_out, keys, r0, chunk.rows, dtype, buffer);
    StagedFile values_out(function, "values chunk", (fs::path(dir) / chunk.values_file).string());
    chunk.values_xxh3 = write_chunk_file(values_out, values, r0, chunk.rows, dtype, buffer);
    keys_out.commit();
    values_out.commit();
    chunks.push_back(std::move(chunk));
    if (progress) progress((r0 + chunks.back().rows) * row_bytes, n * row_bytes);
  }
  return chunks;
}

void write_manifest(std::string_view function, const std::string& dir, const std::string& text) {
  StagedFile out(function, "manifest", (fs::path(dir) / kManifest).string());
  out.write(text);
  out.commit();  // fsync, rename over the old manifest, fsync the directory
}

// Checks one chunk file mapped as `file` against the manifest: its header's
// dtype and shape, and with `hash` its checksum.
void check_chunk_file(std::string_view function, const std::string& path, const MappedFile& file,
                      StoreDtype dtype, int64_t rows, int64_t dim, uint64_t xxh3, bool hash,
                      NpyHeader* header_out = nullptr) {
  const NpyHeader header =
      checked_npy_header(function, file, npy_descr(dtype), Shape{rows, dim}, "chunk");
  if (hash) {
    const uint64_t got = XXH3_64bits(file.data(), file.size());
    if (got != xxh3) {
      fail(function, path + ": checksum " + hex64(got) + " does not match the manifest's " +
                         hex64(xxh3) + " (the chunk file was altered)");
    }
  }
  if (header_out) *header_out = header;
}

}  // namespace

KeyValueStore KeyValueStore::create(const std::string& dir, ConstView<float> keys,
                                    ConstView<float> values, StoreDtype dtype, int64_t chunk_rows,
                                    const StoreProgress& progress) {
  constexpr std::string_view kFn = "KeyValueStore::create";
  check_rows(kFn, keys, values);
  if (chunk_rows < 1) fail(kFn, "chunk_rows = " + std::to_string(chunk_rows) + "; expected >= 1");
  if (dir.empty()) fail(kFn, "the store's path is empty");
  struct stat st;
  if (::lstat(dir.c_str(), &st) == 0)
    fail(kFn, dir + ": already exists; a new store needs a new path");
  StagedDirectory staged(kFn, dir);
  const std::string& temp = staged.temp();
  KeyValueStore store;
  store.dir_ = temp;
  store.dtype_ = dtype;
  store.key_dim_ = keys.size(1);
  store.value_dim_ = values.size(1);
  store.chunk_rows_ = chunk_rows;
  store.rows_ = keys.size(0);
  store.chunks_ = write_chunks(kFn, temp, keys, values, dtype, chunk_rows, 0, 0, progress);
  const int lock = ::open((fs::path(temp) / kLock).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (lock < 0) fail_io(kFn, dir + ": cannot create its lock file: " + errno_text(errno));
  ::close(lock);
  write_manifest(kFn, temp, store.manifest_text());
  staged.commit();
  store.dir_ = dir;
  return store;
}

KeyValueStore KeyValueStore::open(const std::string& dir, StoreCheck check,
                                  const StoreProgress& progress) {
  constexpr std::string_view kFn = "KeyValueStore::open";
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0)
    fail(kFn, dir + ": cannot open the store: " + errno_text(errno));
  if (!S_ISDIR(st.st_mode)) fail(kFn, dir + ": not a store (a store is a directory)");
  const std::string manifest = (fs::path(dir) / kManifest).string();
  if (::stat(manifest.c_str(), &st) != 0) {
    fail(kFn, dir + ": not a store: no " + kManifest + " (" + errno_text(errno) + ")");
  }
  KeyValueStore store = parse_manifest(
      read_text_file(kFn, manifest, kMaxManifestBytes, "a store's manifest"), manifest);
  store.dir_ = dir;
  if (check == StoreCheck::kChecksums) {
    store.check_checksums(kFn, progress);
  } else {
    store.check_sizes(kFn);
  }
  return store;
}

void KeyValueStore::check_sizes(std::string_view kFn) const {
  const size_t item = item_size(dtype_);
  for (const StoreChunk& chunk : chunks_) {
    for (const auto& [file, dim] :
         {std::pair{&chunk.keys_file, key_dim_}, std::pair{&chunk.values_file, value_dim_}}) {
      const std::string path = (fs::path(dir_) / *file).string();
      const Shape shape{chunk.rows, dim};
      // The size qkv writes; a chunk of another size (or no regular file)
      // is mapped and checked whole, for the message that says what is
      // wrong with it (or for a valid header of another length).
      const size_t want = npy_header_bytes(npy_descr(dtype_), shape).size() +
                          static_cast<size_t>(chunk.rows * dim) * item;
      struct stat st;
      if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
          static_cast<size_t>(st.st_size) == want)
        continue;
      const MappedFile mapped(kFn, path);
      check_chunk_file(kFn, path, mapped, dtype_, chunk.rows, dim, 0, false);
    }
  }
}

// One chunk's keys (rows, D) and values (rows, Dv), mapped; its views stay
// valid while it lives.
struct KeyValueStore::MappedChunk {
  MappedFile keys_file, values_file;
  size_t keys_offset = 0, values_offset = 0;  // where the .npy data starts
};

// The chunks read last, most recent first: a list for the order and a map
// from the chunk's keys file (which names the chunk however a copy of the
// store numbers it) into it.
struct KeyValueStore::Mappings {
  std::mutex mutex;
  using Entry = std::pair<std::string, std::shared_ptr<const MappedChunk>>;
  std::list<Entry> recent;
  std::unordered_map<std::string, std::list<Entry>::iterator> by_keys_file;
};

std::shared_ptr<KeyValueStore::Mappings> KeyValueStore::no_mappings() {
  return std::make_shared<Mappings>();
}
ChunkRange KeyValueStore::chunk_range(size_t index) const {
  if (index >= chunks_.size()) {
    fail("KeyValueStore::chunk_range", "index = " + std::to_string(index) + "; store " + dir_ +
                                           " has " + std::to_string(chunks_.size()) + " chunks");
  }
  return {chunks_[index].first_row, chunks_[index].rows};
}

SourceChunk KeyValueStore::read_chunk(size_t index) const {
  constexpr std::string_view kFn = "KeyValueStore::read_chunk";
  if (index >= chunks_.size()) {
    fail(kFn, "index = " + std::to_string(index) + "; store " + dir_ + " has " +
                  std::to_string(chunks_.size()) + " chunks");
  }
  std::shared_ptr<const MappedChunk> mapped = map_checked(kFn, index);
  const int64_t rows = chunks_[index].rows;
  const unsigned char* keys = mapped->keys_file.data() + mapped->keys_offset;
  const unsigned char* values = mapped->values_file.data() + mapped->values_offset;
  const ChunkRange range{chunks_[index].first_row, rows};
  // After the views are used: a file truncated meanwhile is an Error (the
  // guard kept its missing pages readable as zeros).
  std::function<void()> check = [mapped, kFn] {
    mapped->keys_file.check_unchanged(kFn);
    mapped->values_file.check_unchanged(kFn);
  };
  if (dtype_ == StoreDtype::kFloat32) {
    return SourceChunk(
        range, ConstView<float>(reinterpret_cast<const float*>(keys), Shape{rows, key_dim_}),
        ConstView<float>(reinterpret_cast<const float*>(values), Shape{rows, value_dim_}), mapped,
        std::move(check));
  }
  return SourceChunk(
      range, ConstView<bfloat16>(reinterpret_cast<const bfloat16*>(keys), Shape{rows, key_dim_}),
      ConstView<bfloat16>(reinterpret_cast<const bfloat16*>(values), Shape{rows, value_dim_}),
      mapped, std::move(check));
}

void KeyValueStore::read_ahead(size_t index) const {
  if (index >= chunks_.size()) return;  // a hint: nothing to read
  try {
    const std::shared_ptr<const MappedChunk> mapped =
        map_checked("KeyValueStore::read_ahead", index);
    mapped->keys_file.prefetch();
    mapped->values_file.prefetch();
  } catch (const Error&) {
  } catch (const IoError&) {
    // A hint: a chunk that cannot be mapped is reported by read_chunk, to
    // the caller that reads it (a chunk no query reaches never is).
  }
}

std::shared_ptr<const KeyValueStore::MappedChunk> KeyValueStore::map_checked(std::string_view kFn,
                                                                             size_t index) const {
  const StoreChunk& chunk = chunks_.at(index);
  Mappings& cache = *mappings_;
  const std::lock_guard<std::mutex> lock(cache.mutex);
  const auto found = cache.by_keys_file.find(chunk.keys_file);
  if (found != cache.by_keys_file.end()) {
    const std::shared_ptr<const MappedChunk> kept = found->second->second;
    // Two stats: a file changed since it was mapped is mapped and checked
    // again below (and so named), not read.
    if (kept->keys_file.unchanged() && kept->values_file.unchanged()) {
      cache.recent.splice(cache.recent.begin(), cache.recent, found->second);
      return kept;
    }
    cache.recent.erase(found->second);
    cache.by_keys_file.erase(found);
  }
  auto made = std::make_shared<MappedChunk>();
  MappedChunk& mapped = *made;
  NpyHeader keys_header, values_header;
  const std::string keys_path = (fs::path(dir_) / chunk.keys_file).string();
  const std::string values_path = (fs::path(dir_) / chunk.values_file).string();
  mapped.keys_file = MappedFile(kFn, keys_path);
  check_chunk_file(kFn, keys_path, mapped.keys_file, dtype_, chunk.rows, key_dim_, 0, false,
                   &keys_header);
  mapped.values_file = MappedFile(kFn, values_path);
  check_chunk_file(kFn, values_path, mapped.values_file, dtype_, chunk.rows, value_dim_, 0, false,
                   &values_header);
  mapped.keys_offset = static_cast<size_t>(keys_header.data_offset);
  mapped.values_offset = static_cast<size_t>(values_header.data_offset);
  cache.recent.emplace_front(chunk.keys_file, made);
  cache.by_keys_file[chunk.keys_file] = cache.recent.begin();
  // The least recent leaves the cache; whoever still reads it keeps it mapped.
  if (cache.recent.size() > kMappedChunks) {
    cache.by_keys_file.erase(cache.recent.back().first);
    cache.recent.pop_back();
  }
  return made;
}

void KeyValueStore::verify(const StoreProgress& progress) const {
  check_checksums("KeyValueStore::verify", progress);
}

void KeyValueStore::check_checksums(std::string_view kFn, const StoreProgress& progress) const {
  const int64_t total = file_bytes();
  int64_t done = 0;
  for (const StoreChunk& chunk : chunks_) {
    for (const auto& [file, dim, xxh3] :
         {std::tuple{&chunk.keys_file, key_dim_, chunk.keys_xxh3},
          std::tuple{&chunk.values_file, value_dim_, chunk.values_xxh3}}) {
      const std::string path = (fs::path(dir_) / *file).string();
      const MappedFile mapped(kFn, path);
      ::madvise(const_cast<unsigned char*>(mapped.data()), mapped.size(), MADV_SEQUENTIAL);
      check_chunk_file(kFn, path, mapped, dtype_, chunk.rows, dim, xxh3, true);
      done += static_cast<int64_t>(mapped.size());
      if (progress) progress(std::min(done, total), total);
    }
  }
}

void KeyValueStore::append(ConstView<float> keys, ConstView<float> values,
                           const StoreProgress& progress) {
  constexpr std::string_view kFn = "KeyValueStore::append";
  check_rows(kFn, keys, values);
  const StoreLock lock(kFn, dir_);
  // The store as it is now, under the lock: other appenders may have
  // changed it since this object was opened.
  const std::string manifest = (fs::path(dir_) / kManifest).string();
  KeyValueStore now = parse_manifest(
      read_text_file(kFn, manifest, kMaxManifestBytes, "a store's manifest"), manifest);
  now.dir_ = dir_;
  if (keys.size(1) != now.key_dim_ || values.size(1) != now.value_dim_) {
    fail(kFn, "keys has shape " + keys.shape().str() + " and values has shape " +
                  values.shape().str() + " but store " + dir_ + " holds D = " +
                  std::to_string(now.key_dim_) + ", Dv = " + std::to_string(now.value_dim_));
  }
  // What a killed append left behind (files no manifest names, temporary
  // files) goes first: no other writer runs while the lock is held, and
  // readers read only files the manifest names.
  std::unordered_set<std::string> in_manifest{kManifest, kLock};
  for (const StoreChunk& c : now.chunks_) {
    in_manifest.insert(c.keys_file);
    in_manifest.insert(c.values_file);
  }
  const auto in_use = [&](const std::string& name) { return in_manifest.count(name) != 0; };
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    const bool named = in_use(name);
    const bool chunk_file =
        (is_chunk_file_name(name, "keys") || is_chunk_file_name(name, "values")) &&
        entry.is_regular_file(ec);
    const bool staged = name[0] == '.' && name.find(".qkv-") != std::string::npos &&
                        !entry.is_symlink(ec) &&
                        (entry.is_regular_file(ec) || entry.is_directory(ec));
    if (!named && (chunk_file || staged)) fs::remove_all(entry.path(), ec);
  }
  if (keys.size(0) > 0) {
    // New chunk files take numbers whose names no chunk of the manifest
    // uses, so a new file never replaces one the store holds.
    const auto new_chunks =
        static_cast<size_t>((keys.size(0) + now.chunk_rows_ - 1) / now.chunk_rows_);
    size_t next = now.chunks_.size();
    for (size_t i = 0; i < new_chunks; ++i) {
      if (in_use(chunk_file_name("keys", next + i)) ||
          in_use(chunk_file_name("values", next + i))) {
        next += i + 1;
        i = static_cast<size_t>(-1);  // start the range again after the name in use
      }
    }
    // The new chunks are written into a hidden directory in the store, never
    // committed: a failure (a full disk) or a signal while they are written
    // removes it and all it holds (StagedDirectory's destructor, the qkv
    // command's signal handler). Only when every file is written are they
    // renamed into place, which takes microseconds a file.
    StagedDirectory staging(kFn, (fs::path(dir_) / "append").string());
    std::vector<StoreChunk> added = write_chunks(kFn, staging.temp(), keys, values, now.dtype_,
                                                 now.chunk_rows_, next, now.rows_, progress);
    // The files renamed into place so far, removed again if the append fails.
    std::vector<std::string> placed;
    // From the first rename to the manifest, a signal waits: it then finds
    // the store appended or as it was, never chunks no manifest names.
    const SignalWindow window;
    try {
      for (const StoreChunk& chunk : added) {
        for (const std::string* file : {&chunk.keys_file, &chunk.values_file}) {
          const std::string from = (fs::path(staging.temp()) / *file).string();
          const std::string to = (fs::path(dir_) / *file).string();
          // NOREPLACE: whatever is already there (a symbolic link to outside
          // the store, say) is never written through nor replaced.
          if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0) {
            const int error = errno;
            if (error == EEXIST) {
              struct stat st;
              const bool link = ::lstat(to.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
              fail(kFn, to + ": " + (link ? "a symbolic link" : "a file no manifest names") +
                            " is where the new chunk goes (a store's files are its own: "
                            "remove it); nothing was appended");
            }
            fail_io(kFn, to + ": cannot move the new chunk into place: " + errno_text(error));
          }
          placed.push_back(to);
        }
      }
      sync_directory(dir_);
      for (StoreChunk& chunk : added) now.chunks_.push_back(std::move(chunk));
      now.rows_ += keys.size(0);
      write_manifest(kFn, dir_, now.manifest_text());
    } catch (...) {
      for (const std::string& file : placed) ::unlink(file.c_str());
      sync_directory(dir_);
      throw;
    }
  }
  *this = std::move(now);
}

}  // namespace qkv

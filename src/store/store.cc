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
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "io/directories.h"
#include "io/npy_header.h"
#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/npy.h"
#include "qkv/staged_file.h"

// The checksum functions compiled into this file: no library to link, for
// qkv or for programs that link the installed static libqkv.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace qkv {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr const char* kManifest = "manifest.json";
constexpr const char* kLock = "lock";
constexpr const char* kFormat = "qkv key-value store";
constexpr int kVersion = 1;
// Rows converted and written at a time: 4096 rows of D = 64 floats is 1 MiB,
// small next to a chunk and large enough that each write(2) is efficient.
constexpr int64_t kWriteRows = 4096;

std::string errno_text(int error) { return std::strerror(error); }

size_t item_size(StoreDtype dtype) { return dtype == StoreDtype::kFloat32 ? 4 : 2; }
const char* npy_descr(StoreDtype dtype) { return dtype == StoreDtype::kFloat32 ? "<f4" : "<u2"; }

std::string hex64(uint64_t x) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(x));
  return text;
}

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

// A value as JSON text for a message; the parser took only valid UTF-8, but
// replace rather than throw all the same.
std::string shown(const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); }

struct ManifestReader {
  std::string_view function;
  const std::string& name;

  [[noreturn]] void fail(const std::string& what) const { qkv::fail(function, name + ": " + what); }
  const Json& member(const Json& object, const char* key, const std::string& where) const {
    const auto it = object.find(key);
    if (it == object.end()) fail(where + " has no \"" + key + "\"");
    return *it;
  }
  int64_t integer(const Json& object, const char* key, const std::string& where, int64_t lo,
                  int64_t hi) const {
    const Json& v = member(object, key, where);
    if (!v.is_number_integer()) {
      fail(where + "\"" + key + "\" is " + v.type_name() + " " + shown(v) +
           "; expected an integer");
    }
    const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(hi)
                                                 : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
    if (!in_range || (v.is_number_unsigned() && lo > 0 && v.get<uint64_t>() < uint64_t(lo))) {
      fail(where + "\"" + key + "\" is " + shown(v) + "; expected " + std::to_string(lo) + " to " +
           std::to_string(hi));
    }
    return v.get<int64_t>();
  }
  std::string text(const Json& object, const char* key, const std::string& where) const {
    const Json& v = member(object, key, where);
    if (!v.is_string()) {
      fail(where + "\"" + key + "\" is " + v.type_name() + "; expected a string");
    }
    return v.get<std::string>();
  }
  // A chunk file's name: kept inside the store's directory, never hidden.
  std::string file_name(const Json& object, const char* key, const std::string& where) const {
    const std::string file = text(object, key, where);
    const bool plain = !file.empty() && file.size() <= 200 && file[0] != '.' &&
                       file.find('/') == std::string::npos && file.find('\0') == std::string::npos;
    if (!plain) {
      fail(where + "\"" + key + "\" is " + shown(Json(file)) +
           "; expected the name of a file in the store's directory");
    }
    return file;
  }
  uint64_t checksum(const Json& object, const char* key, const std::string& where) const {
    const std::string hex = text(object, key, where);
    uint64_t x = 0;
    bool ok = hex.size() == 16;
    for (char c : hex) {
      const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      ok = ok && digit >= 0;
      x = x << 4 | static_cast<uint64_t>(digit & 15);
    }
    if (!ok) fail(where + "\"" + key + "\" is \"" + hex + "\"; expected 16 hex digits");
    return x;
  }
  void only(const Json& object, std::initializer_list<const char*> keys,
            const std::string& where) const {
    for (const auto& item : object.items()) {
      if (std::find_if(keys.begin(), keys.end(), [&](const char* k) { return item.key() == k; }) ==
          keys.end()) {
        fail(where + "has an unknown member \"" + item.key() + "\"");
      }
    }
  }
};

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

// What a file that is not a regular one is, for messages.
std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Opens `path` for reading if it is a regular file, else Error naming it and
// what it is. O_NONBLOCK, so a FIFO without a writer does not block the
// open itself (for a regular file it changes nothing); a device such as
// /dev/zero is refused before a byte is read.
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
                       "); a store's manifest and chunks are regular files");
  }
  return fd;
}

std::string read_text_file(std::string_view function, const std::string& path) {
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
    // A manifest of 10^6 chunks is about 200 MB; past 1 GiB it is not one of ours.
    if (text.size() > (size_t{1} << 30)) {
      ::close(fd);
      fail(function, path + ": larger than 1 GiB; not a store's manifest");
    }
  }
  ::close(fd);
  return text;
}

}  // namespace

std::string_view store_dtype_name(StoreDtype dtype) {
  return dtype == StoreDtype::kFloat32 ? "float32" : "bfloat16";
}

// ---- MappedFile

MappedFile::MappedFile(std::string_view function, const std::string& path) {
  const int fd = open_regular_file(function, path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    fail(function, path + ": cannot stat: " + errno_text(error));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      fail(function,
           path + ": cannot map " + std::to_string(size_) + " bytes: " + errno_text(error));
    }
    data_ = static_cast<const unsigned char*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void MappedFile::prefetch() const {
  if (data_ == nullptr) return;
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

// ---- the manifest

KeyValueStore KeyValueStore::parse_manifest(std::string_view text, const std::string& name) {
  const ManifestReader in{"KeyValueStore::open", name};
  Json json;
  try {
    json = Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {  // a parse error, or a number out of range (1e400)
    in.fail(std::string("not valid JSON: ") + e.what());
  }
  if (!json.is_object())
    in.fail(std::string("is a JSON ") + json.type_name() + "; expected an object");
  in.only(json,
          {"format", "version", "dtype", "key_dim", "value_dim", "chunk_rows", "rows", "chunks"},
          "");
  if (in.text(json, "format", "") != kFormat) {
    in.fail("\"format\" is " + shown(json["format"]) + "; expected \"" + kFormat + "\"");
  }
  const int64_t version = in.integer(json, "version", "", 0, std::numeric_limits<int>::max());
  if (version != kVersion) {
    in.fail("\"version\" is " + std::to_string(version) + "; this qkv reads version " +
            std::to_string(kVersion));
  }
  KeyValueStore store;
  const std::string dtype = in.text(json, "dtype", "");
  if (dtype == "float32") {
    store.dtype_ = StoreDtype::kFloat32;
  } else if (dtype == "bfloat16") {
    store.dtype_ = StoreDtype::kBFloat16;
  } else {
    in.fail("\"dtype\" is \"" + dtype + "\"; expected \"float32\" or \"bfloat16\"");
  }
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
  std::vector<std::string> names;
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
      if (*file == kManifest || *file == kLock ||
          std::find(names.begin(), names.end(), *file) != names.end()) {
        in.fail(where + "names the file \"" + *file + "\", which the store uses already");
      }
      names.push_back(*file);
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
  return store;
}

std::string KeyValueStore::manifest_text() const {
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
  NpyHeader header;
  try {
    header = parse_npy_header(file.data(), file.size(), path);
  } catch (const Error& e) {
    // "parse_npy_header: <path>: <what>" told as the caller's own error.
    std::string what = e.what();
    const std::string prefix = "parse_npy_header: ";
    if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
    fail(function, what + " (the chunk file is damaged or truncated)");
  }
  const Shape expected{rows, dim};
  if (header.descr != npy_descr(dtype) || !(header.shape == expected)) {
    fail(function, path + ": holds " + header.descr + " " + header.shape.str() +
                       " but the manifest says " + npy_descr(dtype) + " " + expected.str() +
                       " (the chunk file was replaced)");
  }
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
  KeyValueStore store = parse_manifest(read_text_file(kFn, manifest), manifest);
  store.dir_ = dir;
  if (check == StoreCheck::kChecksums) {
    store.check_checksums(kFn, progress);
  } else {
    for (size_t c = 0; c < store.chunks_.size(); ++c) store.map_checked(kFn, c);
  }
  return store;
}

// One chunk's keys (rows, D) and values (rows, Dv), mapped; its views stay
// valid while it lives.
struct KeyValueStore::MappedChunk {
  MappedFile keys_file, values_file;
  size_t keys_offset = 0, values_offset = 0;  // where the .npy data starts
};

struct KeyValueStore::Mappings {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<const MappedChunk>> by_keys_file;
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
  if (dtype_ == StoreDtype::kFloat32) {
    return SourceChunk(
        range, ConstView<float>(reinterpret_cast<const float*>(keys), Shape{rows, key_dim_}),
        ConstView<float>(reinterpret_cast<const float*>(values), Shape{rows, value_dim_}),
        std::move(mapped));
  }
  return SourceChunk(
      range, ConstView<bfloat16>(reinterpret_cast<const bfloat16*>(keys), Shape{rows, key_dim_}),
      ConstView<bfloat16>(reinterpret_cast<const bfloat16*>(values), Shape{rows, value_dim_}),
      std::move(mapped));
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
  const std::lock_guard<std::mutex> lock(mappings_->mutex);
  std::shared_ptr<const MappedChunk>& cached = mappings_->by_keys_file[chunk.keys_file];
  if (cached) return cached;
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
  cached = std::move(made);
  return cached;
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
  KeyValueStore now = parse_manifest(read_text_file(kFn, manifest), manifest);
  now.dir_ = dir_;
  if (keys.size(1) != now.key_dim_ || values.size(1) != now.value_dim_) {
    fail(kFn, "keys has shape " + keys.shape().str() + " and values has shape " +
                  values.shape().str() + " but store " + dir_ + " holds D = " +
                  std::to_string(now.key_dim_) + ", Dv = " + std::to_string(now.value_dim_));
  }
  // What a killed append left behind (files no manifest names, temporary
  // files) goes first: no other writer runs while the lock is held, and
  // readers read only files the manifest names.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    const bool named =
        name == kManifest || name == kLock ||
        std::any_of(now.chunks_.begin(), now.chunks_.end(), [&](const StoreChunk& c) {
          return c.keys_file == name || c.values_file == name;
        });
    const bool ours = (is_chunk_file_name(name, "keys") || is_chunk_file_name(name, "values") ||
                       (name[0] == '.' && name.find(".qkv-") != std::string::npos)) &&
                      entry.is_regular_file(ec);
    if (!named && ours) fs::remove(entry.path(), ec);
  }
  if (keys.size(0) > 0) {
    // New chunk files take numbers whose names no chunk of the manifest
    // uses, so a new file never replaces one the store holds.
    const auto in_use = [&](const std::string& name) {
      return std::any_of(now.chunks_.begin(), now.chunks_.end(), [&](const StoreChunk& c) {
        return c.keys_file == name || c.values_file == name;
      });
    };
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
    std::vector<StoreChunk> added = write_chunks(kFn, dir_, keys, values, now.dtype_,
                                                 now.chunk_rows_, next, now.rows_, progress);
    sync_directory(dir_);
    for (StoreChunk& chunk : added) now.chunks_.push_back(std::move(chunk));
    now.rows_ += keys.size(0);
    write_manifest(kFn, dir_, now.manifest_text());
  }
  *this = std::move(now);
}

}  // namespace qkv

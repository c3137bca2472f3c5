// Tests of the on-disk key-value store's files (qkv/store.h): round trips
// of float32 and bfloat16 rows through chunk files; appends (also from a
// stale object) and their atomicity pieces (the lock, leftovers of killed
// appends); every kind of damage open() and verify() must name; manifest
// parsing errors; chunk files cut after open and while they are read (the
// fault guard); a store of 100,000 chunks. Not kernel tests: run once.
// Killing a real appender is tests/cli/test_store.py's.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "io/npy_header.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#include "store_testing.h"
#include "test_util.h"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

// Where a chunk's keys are in memory.
const void* keys_address(const SourceChunk& chunk) {
  return chunk.dtype() == StoreDtype::kFloat32
             ? static_cast<const void*>(chunk.keys<float>().data())
             : static_cast<const void*>(chunk.keys<bfloat16>().data());
}

void flip_byte(const std::string& file, long offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(offset);
  f.write(&c, 1);
}

// ---- round trips ----------------------------------------------------------------

TEST_F(StoreTest, RowsComeBackAsWrittenInEveryChunking) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int made = 0;
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{64}, rng.uniform_int(65, 300)}) {
      for (int64_t chunk_rows : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1000}}) {
        if (n / chunk_rows > 80) continue;
        const int64_t d = rng.uniform_int(1, 9), dv = rng.uniform_int(1, 9);
        const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, -3, 3);
        const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv}, -3, 3);
        const std::string dir = path("s" + std::to_string(made++));
        const KeyValueStore created = KeyValueStore::create(dir, keys, values, dtype, chunk_rows);
        const KeyValueStore store = KeyValueStore::open(dir);
        SCOPED_TRACE(dir + " n=" + std::to_string(n) + " chunk_rows=" + std::to_string(chunk_rows));
        EXPECT_EQ(store.rows(), n);
        EXPECT_EQ(store.key_dim(), d);
        EXPECT_EQ(store.value_dim(), dv);
        EXPECT_EQ(store.dtype(), dtype);
        EXPECT_EQ(store.chunk_rows(), chunk_rows);
        EXPECT_EQ(store.chunks().size(), static_cast<size_t>((n + chunk_rows - 1) / chunk_rows));
        EXPECT_EQ(store.manifest_text(), created.manifest_text());
        int64_t next_row = 0, bytes = 0;
        for (const StoreChunk& chunk : store.chunks()) {
          EXPECT_EQ(chunk.first_row, next_row);
          EXPECT_GE(chunk.rows, 1);
          EXPECT_LE(chunk.rows, chunk_rows);
          next_row += chunk.rows;
          bytes += static_cast<int64_t>(fs::file_size(fs::path(dir) / chunk.keys_file) +
                                        fs::file_size(fs::path(dir) / chunk.values_file));
        }
        EXPECT_EQ(store.file_bytes(), bytes);
        const ReadBack back = read_back(store);
        if (!store.chunks().empty()) {  // mapped once, kept, shared by copies
          const KeyValueStore copy = store;
          EXPECT_EQ(keys_address(store.read_chunk(0)), keys_address(copy.read_chunk(0)));
        }
        const bool bf16 = dtype == StoreDtype::kBFloat16;
        expect_bitwise_equal(back.keys, bf16 ? rounded_to_bf16(keys) : keys, "keys");
        expect_bitwise_equal(back.values, bf16 ? rounded_to_bf16(values) : values, "values");
      }
    }
  }
}

TEST_F(StoreTest, ChunkFilesAreNumPyFiles) {
  // NumPy reads a chunk as (rows, D) <f4, or <u2 holding bfloat16's bits.
  const Tensor<float> keys({3, 2}, {1, 2, 3, 4, 5, 6.5f});
  const Tensor<float> values({3, 1}, {-1, 0, 1});
  const KeyValueStore store = KeyValueStore::create(path("s"), keys, values);
  const NpyArray read = read_npy((fs::path(store.dir()) / store.chunks()[0].keys_file).string());
  expect_bitwise_equal(std::get<Tensor<float>>(read), keys, "keys chunk");
  const KeyValueStore bf = KeyValueStore::create(path("b"), keys, values, StoreDtype::kBFloat16);
  const std::string file = (fs::path(bf.dir()) / bf.chunks()[0].keys_file).string();
  expect_error([&] { read_npy(file); }, {"<u2"});  // not a dtype the tensor readers take
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const NpyHeader header = parse_npy_header(bytes.data(), bytes.size(), file);
  EXPECT_EQ(header.descr, "<u2");
  EXPECT_EQ(header.shape, Shape({3, 2}));
  uint16_t bits;
  std::memcpy(&bits, bytes.data() + header.data_offset + 5 * 2, 2);
  EXPECT_EQ(bits, bfloat16(6.5f).bits);
}

TEST_F(StoreTest, StridedInputsAreGathered) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> wide = random_tensor<float>(rng, Shape{10, 8});
  // Every other column of every row: keys (10, 4) with strides (8, 2).
  const ConstView<float> keys(wide.data(), Shape{10, 4}, Shape{8, 2});
  const ConstView<float> values(wide.data() + 1, Shape{10, 4}, Shape{8, 2});
  const KeyValueStore store =
      KeyValueStore::create(path("s"), keys, values, StoreDtype::kFloat32, 3);
  const ReadBack back = read_back(store);
  expect_bitwise_equal(back.keys, Tensor<float>::copy_of(keys), "keys");
  expect_bitwise_equal(back.values, Tensor<float>::copy_of(values), "values");
}

// ---- appends --------------------------------------------------------------------

TEST_F(StoreTest, AppendsAddChunksAndKeepEveryRow) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    const std::string dir = path(dtype == StoreDtype::kFloat32 ? "f" : "b");
    Tensor<float> all_keys = random_tensor<float>(rng, Shape{60, 5});
    Tensor<float> all_values = random_tensor<float>(rng, Shape{60, 3});
    KeyValueStore store =
        KeyValueStore::create(dir, rows_of(all_keys, 0, 10), rows_of(all_values, 0, 10), dtype, 8);
    // A second object opened now goes stale when `store` appends; its own
    // append must still keep those rows (it reads the manifest under the lock).
    KeyValueStore stale = KeyValueStore::open(dir);
    store.append(rows_of(all_keys, 10, 20), rows_of(all_values, 10, 20));
    EXPECT_EQ(store.rows(), 30);
    stale.append(rows_of(all_keys, 30, 17), rows_of(all_values, 30, 17));
    EXPECT_EQ(stale.rows(), 47);
    stale.append(Tensor<float>(Shape{0, 5}), Tensor<float>(Shape{0, 3}));  // nothing to add
    KeyValueStore again = KeyValueStore::open(dir);
    again.append(rows_of(all_keys, 47, 13), rows_of(all_values, 47, 13));
    const KeyValueStore last = KeyValueStore::open(dir);
    EXPECT_EQ(last.rows(), 60);
    // 10 = 8 + 2, 20 = 8 + 8 + 4, 17 = 8 + 8 + 1, 13 = 8 + 5: earlier chunks never rewritten.
    std::vector<int64_t> sizes;
    for (const StoreChunk& c : last.chunks()) sizes.push_back(c.rows);
    EXPECT_EQ(sizes, (std::vector<int64_t>{8, 2, 8, 8, 4, 8, 8, 1, 8, 5}));
    const ReadBack back = read_back(last);
    const bool bf16 = dtype == StoreDtype::kBFloat16;
    expect_bitwise_equal(back.keys, bf16 ? rounded_to_bf16(all_keys) : all_keys, "keys");
    expect_bitwise_equal(back.values, bf16 ? rounded_to_bf16(all_values) : all_values, "values");
  }
}

TEST_F(StoreTest, AppendOfOtherSizesChangesNothing) {
  const Tensor<float> keys(Shape{4, 3}, 1.0f), values(Shape{4, 2}, 2.0f);
  KeyValueStore store = KeyValueStore::create(path("s"), keys, values);
  const std::string before = store.manifest_text();
  expect_error(
      [&] {
        store.append(Tensor<float>(Shape{2, 4}), Tensor<float>(Shape{2, 2}));
      },
      {"KeyValueStore::append", "[2, 4]", "D = 3", "Dv = 2"});
  expect_error(
      [&] {
        store.append(Tensor<float>(Shape{2, 3}), Tensor<float>(Shape{3, 2}));
      },
      {"KeyValueStore::append", "[2, 3]", "[3, 2]", "one value row per key row"});
  expect_error(
      [&] {
        store.append(Tensor<float>(Shape{3}), Tensor<float>(Shape{3, 2}));
      },
      {"keys has shape [3]", "(N, D)"});
  EXPECT_EQ(KeyValueStore::open(path("s")).manifest_text(), before);
  EXPECT_EQ(listing(path("s")), (std::vector<std::string>{"keys-000000.npy", "lock",
                                                          "manifest.json", "values-000000.npy"}));
}

TEST_F(StoreTest, ASecondAppenderGetsAnErrorAndWritesNothing) {
  const Tensor<float> keys(Shape{4, 3}, 1.0f), values(Shape{4, 2}, 2.0f);
  KeyValueStore store = KeyValueStore::create(path("s"), keys, values);
  const std::vector<std::string> files = listing(path("s"));
  {
    // Another appender holds the lock (flock on <store>/lock, as append does).
    const int fd = ::open(path("s/lock").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    expect_io_error([&] { store.append(keys, values); },
                    {"KeyValueStore::append", path("s"), "another process", "nothing was written"});
    ::close(fd);
  }
  EXPECT_EQ(listing(path("s")), files);
  EXPECT_EQ(KeyValueStore::open(path("s")).rows(), 4);
  store.append(keys, values);  // the lock is free again
  EXPECT_EQ(KeyValueStore::open(path("s")).rows(), 8);
}

TEST_F(StoreTest, AnAppendClearsWhatAKilledAppendLeft) {
  const Tensor<float> keys(Shape{4, 3}, 1.0f), values(Shape{4, 2}, 2.0f);
  KeyValueStore store = KeyValueStore::create(path("s"), keys, values, StoreDtype::kFloat32, 4);
  // A killed append leaves renamed chunk files the manifest never named and
  // staged temporary files.
  for (const char* name : {"keys-000001.npy", "values-000001.npy", ".keys-000002.npy.qkv-Ab12Cd",
                           ".manifest.json.qkv-Zz99Yy"}) {
    std::ofstream(path(std::string("s/") + name)) << "left behind";
  }
  std::ofstream(path("s/notes.txt")) << "the user's own file";
  std::ofstream(path("s/keys-notes.npy")) << "and another, named like a chunk but not one";
  EXPECT_EQ(KeyValueStore::open(path("s")).rows(), 4);  // readers ignore them
  store.append(keys, values);
  EXPECT_EQ(listing(path("s")),
            (std::vector<std::string>{"keys-000000.npy", "keys-000001.npy", "keys-notes.npy",
                                      "lock", "manifest.json", "notes.txt", "values-000000.npy",
                                      "values-000001.npy"}));
  KeyValueStore::open(path("s"), StoreCheck::kChecksums);  // the new chunk 1 is whole
}

// ---- create's errors ---------------------------------------------------------------

TEST_F(StoreTest, CreateRefusesAnExistingPathAndBadArguments) {
  const Tensor<float> keys(Shape{4, 3}, 1.0f), values(Shape{4, 2}, 2.0f);
  fs::create_directory(path("exists"));
  expect_error([&] { KeyValueStore::create(path("exists"), keys, values); },
               {"KeyValueStore::create", path("exists"), "already exists"});
  std::ofstream(path("file")) << "x";
  expect_error([&] { KeyValueStore::create(path("file"), keys, values); }, {"already exists"});
  expect_error([&] { KeyValueStore::create(path("no/such/dir/s"), keys, values); },
               {"KeyValueStore::create", "cannot create a directory"});
  expect_error([&] { KeyValueStore::create(path("s"), keys, values, StoreDtype::kFloat32, 0); },
               {"chunk_rows = 0"});
  expect_error(
      [&] {
        KeyValueStore::create(path("s"), keys, Tensor<float>(Shape{3, 2}));
      },
      {"[4, 3]", "[3, 2]"});
  expect_error(
      [&] {
        KeyValueStore::create(path("s"), Tensor<float>(Shape{4, 0}), values);
      },
      {"D >= 1"});
  // Nothing left behind by the failures: no store, no temporary directory.
  EXPECT_EQ(listing(root_), (std::vector<std::string>{"exists", "file"}));
}

TEST_F(StoreTest, AFailedCreateLeavesNoDirectory) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> keys = random_tensor<float>(rng, Shape{4096, 64});
  const Tensor<float> values = random_tensor<float>(rng, Shape{4096, 64});
  {
    const FileSizeLimit limit(100000);  // the first chunk file fails part way
    expect_io_error([&] { KeyValueStore::create(path("s"), keys, values); }, {"cannot write"});
  }
  EXPECT_TRUE(listing(root_).empty());
}

// ---- damage open() and verify() find ------------------------------------------------

TEST_F(StoreTest, DamagedChunksAreNamed) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> keys = random_tensor<float>(rng, Shape{30, 4});
  const Tensor<float> values = random_tensor<float>(rng, Shape{30, 2});
  const auto fresh = [&](const std::string& name) {
    return KeyValueStore::create(path(name), keys, values, StoreDtype::kFloat32, 8);
  };
  {  // a flipped byte in the data: only the checksums see it
    const KeyValueStore store = fresh("flip");
    const std::string file = path("flip/") + store.chunks()[2].values_file;
    flip_byte(file, static_cast<long>(fs::file_size(file)) - 3);
    KeyValueStore::open(path("flip"), StoreCheck::kStructure);
    expect_error([&] { KeyValueStore::open(path("flip")); },
                 {"KeyValueStore::open", file, "checksum", "altered"});
    expect_error([&] { store.verify(); }, {"KeyValueStore::verify", file, "altered"});
  }
  {  // a truncated chunk: open() finds it without checksums, and so does read_chunk
    const KeyValueStore store = fresh("cut");
    const std::string file = path("cut/") + store.chunks()[1].keys_file;
    fs::resize_file(file, fs::file_size(file) - 4);
    expect_error([&] { KeyValueStore::open(path("cut"), StoreCheck::kStructure); },
                 {"KeyValueStore::open", file, "truncated"});
    expect_error([&] { store.read_chunk(1); }, {"KeyValueStore::read_chunk", file, "truncated"});
    store.read_ahead(1);  // a hint: what it cannot read, read_chunk reports
    expect_error([&] { store.verify(); }, {file});
  }
  {  // a missing chunk file
    const KeyValueStore store = fresh("gone");
    const std::string file = path("gone/") + store.chunks()[3].values_file;
    fs::remove(file);
    expect_error([&] { KeyValueStore::open(path("gone"), StoreCheck::kStructure); },
                 {file, "cannot open"});
  }
  {  // a chunk file replaced by another array (another shape, another dtype)
    const KeyValueStore store = fresh("swap");
    const std::string file = path("swap/") + store.chunks()[0].keys_file;
    write_npy(file, Tensor<float>(Shape{8, 5}).view());
    expect_error([&] { KeyValueStore::open(path("swap"), StoreCheck::kStructure); },
                 {file, "[8, 5]", "[8, 4]", "replaced"});
    write_npy(file, Tensor<double>(Shape{8, 4}).view());
    expect_error([&] { KeyValueStore::open(path("swap"), StoreCheck::kStructure); },
                 {file, "<f8", "<f4", "replaced"});
  }
  {  // not a store at all
    expect_error([&] { KeyValueStore::open(path("nothing")); }, {path("nothing"), "cannot open"});
    fs::create_directory(path("empty"));
    expect_error([&] { KeyValueStore::open(path("empty")); }, {"not a store", "manifest.json"});
  }
}

// ---- the manifest -------------------------------------------------------------

// The manifest's own checksum covers what each chunk is: two chunk entries
// swapped (files and checksums together, so every file matches its entry)
// reorder the rows, and open() said nothing, nor did verify().
TEST_F(StoreTest, AnEditedManifestIsFoundByItsChecksum) {
  const Tensor<float> keys(Shape{6, 2}, {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5});
  const Tensor<float> values(Shape{6, 1}, {0, 1, 2, 3, 4, 5});
  KeyValueStore::create(path("s"), keys, values, StoreDtype::kFloat32, 3);
  const std::string manifest = path("s/manifest.json");
  const auto read = [&] {
    std::ifstream in(manifest);
    return nlohmann::ordered_json::parse(in);
  };
  const auto write = [&](const nlohmann::ordered_json& json) {
    std::ofstream(manifest) << json.dump(1) << "\n";
  };
  nlohmann::ordered_json json = read();
  ASSERT_TRUE(json.contains("xxh3"));
  const nlohmann::ordered_json as_written = json;
  std::swap(json["chunks"][0], json["chunks"][1]);
  write(json);
  expect_error(
      [&] { KeyValueStore::open(path("s")); },
      {"KeyValueStore::open", manifest, "\"xxh3\"", "does not match", "edited or damaged"});
  // Formatting is not content: the same members, laid out otherwise, open.
  std::ofstream(manifest) << as_written.dump(4);
  EXPECT_EQ(KeyValueStore::open(path("s")).rows(), 6);
  // A manifest written before qkv wrote its checksum has none, and opens.
  json = as_written;
  json.erase("xxh3");
  write(json);
  const KeyValueStore store = KeyValueStore::open(path("s"));
  EXPECT_EQ(read_back(store).values(4, 0), 4.0f);
}

TEST(StoreManifest, EveryMistakeIsNamed) {
  const std::string good = R"({"format": "qkv key-value store", "version": 1, "dtype": "float32",
    "key_dim": 4, "value_dim": 2, "chunk_rows": 8, "rows": 10, "chunks": [
    {"rows": 8, "keys": "keys-000000.npy", "keys_xxh3": "0123456789abcdef",
     "values": "values-000000.npy", "values_xxh3": "fedcba9876543210"},
    {"rows": 2, "keys": "k1.npy", "keys_xxh3": "0000000000000000",
     "values": "v1.npy", "values_xxh3": "ffffffffffffffff"}]})";
  const KeyValueStore store = KeyValueStore::parse_manifest(good, "m.json");
  EXPECT_EQ(store.rows(), 10);
  EXPECT_EQ(store.chunks()[1].first_row, 8);
  EXPECT_EQ(store.chunks()[0].keys_xxh3, 0x0123456789abcdefULL);
  EXPECT_EQ(store.chunks()[1].values_xxh3, 0xffffffffffffffffULL);
  // The text written back parses to the same store.
  EXPECT_EQ(KeyValueStore::parse_manifest(store.manifest_text(), "again").manifest_text(),
            store.manifest_text());

  const auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return text.replace(at, from.size(), to);
  };
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"", {"not valid JSON"}},
      {"{", {"not valid JSON"}},
      {"[1, 2]", {"is a JSON array", "expected an object"}},
      {with("qkv key-value store", "something else"), {"\"format\"", "something else"}},
      {with("\"version\": 1", "\"version\": 2"), {"\"version\" is 2", "reads version 1"}},
      {with("\"version\": 1", "\"version\": \"1\""), {"\"version\"", "expected an integer"}},
      {with("float32", "float16"), {"\"dtype\" is \"float16\""}},
      {with("\"key_dim\": 4", "\"key_dim\": 0"), {"\"key_dim\" is 0"}},
      {with("\"key_dim\": 4", "\"key_dim\": 4.5"), {"\"key_dim\"", "expected an integer"}},
      {with("\"key_dim\": 4", "\"key_dim\": 1e400"), {"not valid JSON", "1e400"}},  // fuzz-found
      {with("\"value_dim\": 2", "\"value_dim\": -2"), {"\"value_dim\" is -2"}},
      {with("\"rows\": 10", "\"rows\": 18446744073709551615"),
       {"\"rows\" is 18446744073709551615"}},
      {with("\"rows\": 10", "\"rows\": 11"), {"\"rows\" is 11", "the chunks hold 10"}},
      {with("\"chunk_rows\": 8", "\"chunk_rows\": 4"), {"chunks[0] \"rows\" is 8"}},
      {with("\"rows\": 2", "\"rows\": 0"), {"chunks[1] \"rows\" is 0"}},
      {with("\"k1.npy\"", "\"../k1.npy\""),
       {"chunks[1] \"keys\"", "a file in the store's directory"}},
      {with("\"k1.npy\"", "\".hidden\""), {"chunks[1] \"keys\""}},
      {with("\"k1.npy\"", "\"manifest.json\""), {"chunks[1]", "manifest.json"}},
      {with("\"k1.npy\"", "\"keys-000000.npy\""), {"chunks[1]", "uses already"}},
      {with("\"0000000000000000\"", "\"00000000000000\""), {"chunks[1] \"keys_xxh3\"", "16 hex"}},
      {with("\"0000000000000000\"", "\"000000000000000G\""), {"16 hex digits"}},
      {with("\"dtype\"", "\"extra\": 1, \"dtype\""), {"unknown member \"extra\""}},
      {with("\"rows\": 2,", "\"rows\": 2, \"more\": 1,"), {"chunks[1] has an unknown member"}},
      {with("\"chunks\": [", "\"chunks\": 5, \"x\": ["), {"unknown member \"x\""}},
      {with(", \"value_dim\": 2", ""), {"has no \"value_dim\""}},
  };
  for (const auto& [text, fragments] : cases) {
    SCOPED_TRACE(text);
    const std::string message = expect_error([&] { KeyValueStore::parse_manifest(text, "m.json"); },
                                             {"KeyValueStore::open", "m.json"});
    for (const std::string& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos) << fragment << "\n" << message;
    }
  }
}

// ---- files that change under a reader; many chunks ------------------------------

// A chunk file cut after the store was opened and its chunks read (and kept
// mapped): the next attention names it, whether the cut leaves whole pages
// out (a read there faulted: SIGBUS, exit 135) or stays inside the file's
// last page (read past the cut as zeros: a wrong result, exit 0).
TEST_F(StoreTest, AChunkCutAfterOpenIsNamedNotReadAsZerosOrACrash) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // Keys files of 128 KiB (mapped: above MappedFile::kCopyBytes).
  const Tensor<float> keys = random_tensor<float>(rng, Shape{12288, 8});
  const Tensor<float> values = random_tensor<float>(rng, Shape{12288, 4});
  const Tensor<float> queries = random_tensor<float>(rng, Shape{3, 8});
  int made = 0;
  for (const uintmax_t cut : {uintmax_t{4}, uintmax_t{40000}}) {
    for (const StoreCheck check : {StoreCheck::kStructure, StoreCheck::kChecksums}) {
      const std::string dir = path("cut" + std::to_string(made++));
      KeyValueStore::create(dir, keys, values, StoreDtype::kFloat32, 4096);
      const KeyValueStore store = KeyValueStore::open(dir, check);
      attend(queries, store);  // every chunk mapped, and kept so
      const std::string file = dir + "/" + store.chunks()[1].keys_file;
      fs::resize_file(file, fs::file_size(file) - cut);
      expect_error([&] { attend(queries, store); },
                   {"KeyValueStore::read_chunk", file, "truncated"});
    }
  }
}

// A chunk file cut while its rows are being read: the reads past the cut
// see zeros (the guard's pages, not SIGBUS), and check_intact() names the
// file, so whatever used the rows is discarded.
TEST_F(StoreTest, AChunkCutWhileItIsReadIsAnErrorNotACrash) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> keys = random_tensor<float>(rng, Shape{4096, 16}, 1, 2);  // 256 KiB
  const Tensor<float> values = random_tensor<float>(rng, Shape{4096, 2});
  const KeyValueStore store = KeyValueStore::create(path("s"), keys, values);
  const SourceChunk chunk = store.read_chunk(0);
  chunk.check_intact();
  const std::string file = path("s/") + store.chunks()[0].keys_file;
  const uintmax_t size = fs::file_size(file);
  fs::resize_file(file, 8192);  // the header and 127 whole rows are left
  const ConstView<float> read = chunk.keys<float>();
  int64_t zeros = 0;
  for (int64_t i = 0; i < read.size(0); ++i) {
    for (int64_t j = 0; j < read.size(1); ++j) zeros += read(i, j) == 0.0f;
  }
  // Every key is in [1, 2): the zeros are the bytes past the cut.
  EXPECT_EQ(zeros, (4096 * 16 * 4 + 128 - 8192) / 4);
  expect_error([&] { chunk.check_intact(); },
               {"KeyValueStore::read_chunk", file, "changed while it was read",
                std::to_string(size) + " bytes and is 8192"});
  // The store names the file from now on, and other chunks of it read on.
  expect_error([&] { store.read_chunk(0); }, {"KeyValueStore::read_chunk", file, "truncated"});
}

// The guard catches faults in its own mappings only: any other SIGBUS still
// ends the process (under the sanitizers, with their report).
TEST(StoreGuard, OtherFaultsStillEndTheProcess) {
  char pattern[] = "/tmp/qkv-guard-test-XXXXXX";
  const int fd = ::mkstemp(pattern);
  ASSERT_GE(fd, 0);
  const std::string file = pattern;
  constexpr size_t kBytes = 4 * MappedFile::kCopyBytes;  // mapped, not read
  ASSERT_EQ(::ftruncate(fd, kBytes), 0);
  {
    const MappedFile guarded("test", file);  // installs the guard
    EXPECT_TRUE(guarded.unchanged());
    ASSERT_EQ(guarded.size(), kBytes);
  }
  void* p = ::mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  const auto by_sigbus = [](int status) {
    return WIFSIGNALED(status) ? WTERMSIG(status) == SIGBUS : WEXITSTATUS(status) != 0;
  };
  EXPECT_EXIT(
      {
        const volatile unsigned char* bytes = static_cast<const unsigned char*>(p);
        std::exit(bytes[4096] == 0 ? 0 : 0);
      },
      by_sigbus, "");
  ::munmap(p, kBytes);
  ::close(fd);
  ::unlink(file.c_str());
}

// 100,000 chunks of one row: two files each, three times the mappings the
// system allows a process (vm.max_map_count, 65,530) had every chunk stayed
// mapped, as each did. The store opens, appends and attends with a bounded
// number of mappings. On tmpfs where there is one: 200,000 files.
TEST(StoreManyChunks, AHundredThousandChunksOpenAppendAndAttend) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  std::string pattern =
      fs::is_directory("/dev/shm") ? "/dev/shm/qkv-many-XXXXXX" : "/tmp/qkv-many-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string dir = pattern + "/s";
  // Under the sanitizers 5,000 chunks (ten times the chunks kept mapped, so
  // the eviction runs as often): 100,000 took 2 minutes there, 11 s here.
  constexpr int64_t n = kSanitized ? 5000 : 100000, extra = 5;
  const Tensor<float> keys = random_tensor<float>(rng, Shape{n + extra, 2});
  const Tensor<float> values = random_tensor<float>(rng, Shape{n + extra, 1});
  KeyValueStore::create(dir, rows_of(keys, 0, n), rows_of(values, 0, n), StoreDtype::kFloat32, 1);
  KeyValueStore store = KeyValueStore::open(dir, StoreCheck::kStructure);
  ASSERT_EQ(store.num_chunks(), size_t{n});
  store.append(rows_of(keys, n, extra), rows_of(values, n, extra));
  ASSERT_EQ(store.num_chunks(), size_t{n + extra});
  const Tensor<float> queries = random_tensor<float>(rng, Shape{2, 2});
  StoreAttentionOptions options;
  options.top_k = 3;
  const StoreAttentionResult got =
      attend(queries, KeyValueStore::open(dir, StoreCheck::kStructure), {}, options);
  const std::vector<int64_t> all(2, n + extra);
  const PlainAttention want = plain_attention(queries, keys, values, all, 1 / std::sqrt(2.0));
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(got.output(i, 0), want.output(i, 0), 1e-5);
    EXPECT_NEAR(got.lse(i), want.lse(i), 1e-5);
    std::vector<int64_t> order(n + extra);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return want.weights(i, a) > want.weights(i, b); });
    for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(got.top_ids(i, r), order[r]) << i << " " << r;
  }
  // The mappings now: the process's own and at most kMappedChunks chunks'.
  std::ifstream maps("/proc/self/maps");
  int64_t lines = 0;
  for (std::string line; std::getline(maps, line);) ++lines;
  EXPECT_LT(lines, 8000);
  fs::remove_all(pattern);
}

}  // namespace
}  // namespace qkv::test

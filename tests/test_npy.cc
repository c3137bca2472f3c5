// Tests of the .npy reader and writer: round trips of every dtype and rank,
// files exchanged with real NumPy (/usr/bin/python3, a required test
// dependency), one test per rejected input, pipes read only as far as the
// header says, and atomic writes (symlinks' targets replaced, FIFOs and
// devices written through, a full disk an IoError that keeps the old file).
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <thread>
#include <variant>

#include "io/npy_header.h"
#include "test_util.h"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

// ---- helpers -------------------------------------------------------------------

// A fresh directory under $TMPDIR (or /tmp), removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/qkv_test_npy.XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp(" << pattern << "): " << std::strerror(errno);
    }
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  // The names of the entries in the directory, sorted.
  std::set<std::string> entries() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(path_)) names.insert(e.path().filename());
    return names;
  }

 private:
  std::string path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

// Runs a Python script with /usr/bin/python3 (NumPy is a required test
// dependency, so a failure here fails the test). Output goes to a log that
// the failure message quotes.
::testing::AssertionResult run_python(const TempDir& dir, const std::string& script,
                                      const std::string& args = "") {
  const std::string script_path = dir / "script.py";
  const std::string log_path = dir / "python.log";
  {
    std::ofstream out(script_path);
    out << script;
  }
  const std::string command =
      "/usr/bin/python3 '" + script_path + "' " + args + " >'" + log_path + "' 2>&1";
  const int status = std::system(command.c_str());
  const std::string log = read_bytes(log_path);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return ::testing::AssertionFailure() << "python3 failed (status " << status << ") running:\n"
                                         << script << "\noutput:\n"
                                         << log;
  }
  return ::testing::AssertionSuccess();
}

// Bytes of a hand-made .npy file: magic, version `major`.0, the header length
// and `dict`, padded with spaces and '\n' to 64 bytes when `pad`, then `data`.
std::string npy_file(std::string_view dict, std::string_view data = {}, int major = 1,
                     bool pad = true) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string header(dict);
  if (pad) {
    while ((prefix + header.size() + 1) % 64 != 0) header += ' ';
    header += '\n';
  }
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < prefix - 8; ++i)
    out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + std::string(data);
}

// Where the header dict starts in a file of this version.
size_t dict_start(int major) { return major == 1 ? 10 : 12; }

template <class T>
std::string raw_bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

std::string f4_dict(std::string_view shape) {
  return "{'descr': '<f4', 'fortran_order': False, 'shape': " + std::string(shape) + ", }";
}

// Parses in-memory bytes named "test.npy" (so messages can be checked for it).
NpyArray parse(const std::string& bytes) {
  return parse_npy(bytes.data(), bytes.size(), "test.npy");
}

template <class T>
const Tensor<T>& held(const NpyArray& array) {
  EXPECT_TRUE(std::holds_alternative<Tensor<T>>(array))
      << "variant holds alternative " << array.index();
  return std::get<Tensor<T>>(array);
}

// The value NumPy and these tests agree on for element k of a test array
// (exact in every dtype, including int64 values beyond 2^53).
template <class T>
T pattern_value(int64_t k) {
  if constexpr (std::is_same_v<T, int32_t>) return static_cast<T>(k * 7919 - 50000);
  if constexpr (std::is_same_v<T, int64_t>) return (k - 5) * (int64_t{1} << 40) + 3;
  return static_cast<T>(static_cast<double>(k) * 0.25 - 3.0);
}
// The same formula in Python, by dtype.
const char* kPythonPattern = R"(
import numpy as np
def pattern(dtype, shape):
    n = int(np.prod(shape, dtype=np.int64))
    k = np.arange(n, dtype=np.int64)
    if dtype == '<i4':
        v = (k * 7919 - 50000).astype('<i4')
    elif dtype == '<i8':
        v = ((k - 5) * (1 << 40) + 3).astype('<i8')
    else:
        v = (k.astype(np.float64) * 0.25 - 3.0).astype(dtype)
    return v.reshape(shape)
)";

template <class T>
Tensor<T> pattern_tensor(const Shape& shape) {
  Tensor<T> t(shape);
  for (size_t k = 0; k < t.values().size(); ++k) t.values()[k] = pattern_value<T>(int64_t(k));
  return t;
}

template <class T>
const char* dtype_str() {
  if constexpr (std::is_same_v<T, float>) return "<f4";
  if constexpr (std::is_same_v<T, double>) return "<f8";
  if constexpr (std::is_same_v<T, int32_t>) return "<i4";
  return "<i8";
}

// Shapes of ranks 0 to 4, with zero-size axes among them.
const std::vector<Shape> kShapes = {{},  {1},    {7},       {3, 4},       {2, 3, 5},   {2, 1, 3, 2},
                                    {0}, {3, 0}, {2, 0, 4}, {1, 2, 0, 3}, {0, 0, 0, 0}};

std::string python_shape(const Shape& shape) {
  std::string s = "(";
  for (int a = 0; a < shape.rank(); ++a) s += std::to_string(shape[a]) + ",";
  return s + ")";
}

// Random values of type T, including the extremes of integer types.
template <class T>
Tensor<T> random_values(Rng& rng, const Shape& shape) {
  Tensor<T> t(shape);
  for (T& x : t.values()) {
    if constexpr (std::is_integral_v<T>) {
      x = static_cast<T>(
          rng.uniform_int(std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
    } else {
      x = static_cast<T>(rng.uniform(-1e3, 1e3));
    }
  }
  if (t.numel() >= 2 && std::is_integral_v<T>) {
    t.values().front() = std::numeric_limits<T>::min();
    t.values().back() = std::numeric_limits<T>::max();
  }
  return t;
}

// ---- round trips ---------------------------------------------------------------

template <class T>
class NpyRoundTrip : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double, int32_t, int64_t>;
TYPED_TEST_SUITE(NpyRoundTrip, ElementTypes);

TYPED_TEST(NpyRoundTrip, BytesOfEveryRankIncludingZeroSize) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE("shape " + shape.str());
    const Tensor<T> original = random_values<T>(rng, shape);
    const std::string bytes = npy_bytes(original.view());
    // NumPy's layout: version 1.0, the data starts at a multiple of 64 and
    // the header ends with '\n'.
    ASSERT_GE(bytes.size(), 10u);
    EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
    const size_t data_offset =
        10 + (static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8);
    EXPECT_EQ(data_offset % 64, 0u);
    EXPECT_EQ(bytes[data_offset - 1], '\n');
    EXPECT_EQ(bytes.size(), data_offset + static_cast<size_t>(shape.numel()) * sizeof(T));

    const NpyArray back = parse(bytes);
    const Tensor<T>& got = held<T>(back);
    EXPECT_EQ(got.shape(), shape);
    expect_bitwise_equal(got, original, "parsed");
  }
}

TYPED_TEST(NpyRoundTrip, FilesOfEveryRank) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  TempDir dir;
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE("shape " + shape.str());
    const Tensor<T> original = random_values<T>(rng, shape);
    const std::string path = dir / "a.npy";
    write_npy(path, original.view());
    EXPECT_EQ(read_bytes(path), npy_bytes(original.view()));
    const NpyArray back = read_npy(path);
    const Tensor<T>& got = held<T>(back);
    EXPECT_EQ(got.shape(), shape);
    expect_bitwise_equal(got, original, "read back");
  }
  EXPECT_EQ(dir.entries(), std::set<std::string>{"a.npy"});  // no temporary files left
}

TYPED_TEST(NpyRoundTrip, StridedViewsAreWrittenInRowMajorOrder) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  TempDir dir;
  for (const Shape& shape : kShapes) {
    for (bool reversed : {false, true}) {
      SCOPED_TRACE("shape " + shape.str() + (reversed ? " column-major" : " padded"));
      const Tensor<T> original = random_values<T>(rng, shape);
      const Strided<T> strided(original.view(),
                               {.step = 3, .pad = 2, .offset = 1, .reversed = reversed});
      // The bytes equal those of the contiguous copy.
      EXPECT_EQ(npy_bytes(strided.const_view()), npy_bytes(original.view()));
      write_npy(dir / "s.npy", strided.const_view());
      const NpyArray back = read_npy(dir / "s.npy");
      expect_bitwise_equal(held<T>(back), original, "strided write");
    }
  }
}

TYPED_TEST(NpyRoundTrip, BroadcastViewAndLargeStridedView) {
  using T = TypeParam;
  // A stride-0 axis repeats its row: (4, 3) from 3 values.
  const Tensor<T> row = pattern_tensor<T>({3});
  const ConstView<T> broadcast(row.data(), {4, 3}, {0, 1});
  const NpyArray back = parse(npy_bytes(broadcast));
  const Tensor<T>& got = held<T>(back);
  ASSERT_EQ(got.shape(), (Shape{4, 3}));
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(got(i, j), row(j)) << "i=" << i << " j=" << j;
  }
  // Large enough to cross the writer's gather-buffer boundaries several times.
  const Tensor<T> big = pattern_tensor<T>({3, 70, 101});
  const Strided<T> strided(big.view(), {.step = 2, .pad = 1, .offset = 3, .reversed = true});
  TempDir dir;
  write_npy(dir / "big.npy", strided.const_view());
  expect_bitwise_equal(held<T>(read_npy(dir / "big.npy")), big, "big strided");
}

TEST(NpyRoundTrip, SpecialFloatValuesSurviveBitForBit) {
  const std::vector<float> f = {
      std::numeric_limits<float>::quiet_NaN(),  -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::infinity(),   -0.0f,
      std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
      std::numeric_limits<float>::lowest()};
  const Tensor<float> a({7}, f);
  expect_bitwise_equal(held<float>(parse(npy_bytes(a.view()))), a, "float specials");
  const std::vector<double> d = {std::numeric_limits<double>::quiet_NaN(), -0.0,
                                 std::numeric_limits<double>::denorm_min(),
                                 std::numeric_limits<double>::infinity()};
  const Tensor<double> b({2, 2}, d);
  expect_bitwise_equal(held<double>(parse(npy_bytes(b.view()))), b, "double specials");
}

// ---- header parsing ------------------------------------------------------------

TEST(NpyHeader, AcceptsAnyKeyOrderWhitespaceQuotesAndTrailingCommas) {
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  const std::string data = raw_bytes(values);
  const std::vector<std::string> dicts = {
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}",
      "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",
      "{'fortran_order':False,'shape':(2,3,),'descr':'<f4',}",
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2, 3)}",
      "  {\n\t'descr' : '<f4' ,\n 'fortran_order' :\tFalse,\r\n 'shape' : ( 2 ,\n 3 ) , }  \n",
      "{'descr': '=f4', 'fortran_order': False, 'shape': (2, 3)}",      // native order = little
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }",  // Python 2 longs
      "{'descr': '<f4', 'fortran_order': False, 'shape': (+2, 3), }",
  };
  for (const std::string& dict : dicts) {
    SCOPED_TRACE(dict);
    for (bool pad : {true, false}) {
      const NpyArray a = parse(npy_file(dict, data, 1, pad));
      const Tensor<float>& t = held<float>(a);
      EXPECT_EQ(t.shape(), (Shape{2, 3}));
      EXPECT_EQ(t.values(), values);
    }
  }
}

TEST(NpyHeader, ShapeTuplesOfRankZeroToFour) {
  const std::vector<std::pair<std::string, Shape>> cases = {
      {"()", {}},         {"( )", {}},         {"(3,)", {3}},
      {"(3 , )", {3}},    {"(2, 3)", {2, 3}},  {"(1,2,1,2)", {1, 2, 1, 2}},
      {"(0, 5)", {0, 5}}, {"(5, 0,)", {5, 0}},
  };
  for (const auto& [text, shape] : cases) {
    SCOPED_TRACE(text);
    const std::string data(static_cast<size_t>(shape.numel()) * 4, '\0');
    const NpyArray a = parse(npy_file(f4_dict(text), data));
    EXPECT_EQ(held<float>(a).shape(), shape);
  }
}

TEST(NpyHeader, Versions2And3ParseLikeVersion1) {
  const std::vector<int32_t> values = {7, -8, 9};
  for (int major : {2, 3}) {
    SCOPED_TRACE("version " + std::to_string(major));
    const NpyArray a = parse(npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }",
                                      raw_bytes(values), major));
    EXPECT_EQ(held<int32_t>(a).values(), values);
  }
}

// ---- files written by NumPy ----------------------------------------------------

TEST(NpyNumpy, ReadsFilesWrittenByNumpyInEveryVersionDtypeAndRank) {
  TempDir dir;
  std::string script = kPythonPattern;
  script += R"(
import sys
from numpy.lib import format as npf
out = sys.argv[1]
shapes = [(), (1,), (7,), (3, 4), (2, 3, 5), (2, 1, 3, 2), (0,), (3, 0), (1, 2, 0, 3)]
for dtype in ('<f4', '<f8', '<i4', '<i8'):
    for version in ((1, 0), (2, 0), (3, 0)):
        for i, shape in enumerate(shapes):
            name = '%s/%s_v%d_%d.npy' % (out, dtype[1:], version[0], i)
            with open(name, 'wb') as f:
                npf.write_array(f, pattern(dtype, shape), version=version)
# np.save picks the version itself; a non-contiguous C-order source is copied.
np.save(out + '/save_f4.npy', pattern('<f4', (4, 6))[::2, ::3])
)";
  ASSERT_TRUE(run_python(dir, script, "'" + dir.path() + "'"));

  const std::vector<Shape> shapes = {{},           {1}, {7},    {3, 4},      {2, 3, 5},
                                     {2, 1, 3, 2}, {0}, {3, 0}, {1, 2, 0, 3}};
  auto check = [&](auto tag, const std::string& code) {
    using T = decltype(tag);
    for (int major : {1, 2, 3}) {
      for (size_t i = 0; i < shapes.size(); ++i) {
        const std::string path =
            dir / (code + "_v" + std::to_string(major) + "_" + std::to_string(i) + ".npy");
        SCOPED_TRACE(path);
        const std::string bytes = read_bytes(path);
        ASSERT_GT(bytes.size(), 8u);
        EXPECT_EQ(bytes[6], static_cast<char>(major)) << "NumPy wrote another version";
        const NpyArray a = read_npy(path);
        expect_bitwise_equal(held<T>(a), pattern_tensor<T>(shapes[i]), "NumPy's values");
      }
    }
  };
  check(float{}, "f4");
  check(double{}, "f8");
  check(int32_t{}, "i4");
  check(int64_t{}, "i8");

  // pattern((4, 6))[::2, ::3]: rows 0 and 2, columns 0 and 3.
  const Tensor<float> full = pattern_tensor<float>({4, 6});
  const Tensor<float> expected({2, 2}, {full(0, 0), full(0, 3), full(2, 0), full(2, 3)});
  expect_bitwise_equal(held<float>(read_npy(dir / "save_f4.npy")), expected, "np.save slice");
}

// Masks: NumPy's bool (|b1) and uint8 (|u1) files read as uint8 bytes, and
// ours (|u1) loaded by NumPy with the same values.
TEST(NpyNumpy, BoolAndUint8RoundTripWithNumpy) {
  TempDir dir;
  const std::string script = R"(
import sys
import numpy as np
out = sys.argv[1]
a = (np.arange(24).reshape(2, 3, 4) % 3) == 1
np.save(out + '/bool.npy', a)
np.save(out + '/uint8.npy', (np.arange(24, dtype='u1') * 11).reshape(4, 6))
with open(out + '/bool_le.npy', 'wb') as f:  # '<b1' as some writers spell it
    f.write(np.lib.format.magic(1, 0))
    header = "{'descr': '<b1', 'fortran_order': False, 'shape': (3,), }"
    header += ' ' * (64 - 10 - len(header) - 1) + '\n'
    f.write(len(header).to_bytes(2, 'little') + header.encode() + bytes([1, 0, 1]))
)";
  ASSERT_TRUE(run_python(dir, script, "'" + dir.path() + "'"));
  Tensor<uint8_t> want_bool(Shape{2, 3, 4});
  for (int64_t e = 0; e < 24; ++e) want_bool.data()[e] = e % 3 == 1 ? 1 : 0;
  expect_bitwise_equal(held<uint8_t>(read_npy(dir / "bool.npy")), want_bool, "bool");
  Tensor<uint8_t> want_u8(Shape{4, 6});
  for (int64_t e = 0; e < 24; ++e) want_u8.data()[e] = static_cast<uint8_t>(e * 11);
  expect_bitwise_equal(held<uint8_t>(read_npy(dir / "uint8.npy")), want_u8, "uint8");
  expect_bitwise_equal(held<uint8_t>(read_npy(dir / "bool_le.npy")),
                       Tensor<uint8_t>(Shape{3}, std::vector<uint8_t>{1, 0, 1}), "<b1");
  // Ours: |u1, which NumPy loads as uint8 with the same bytes.
  write_npy(dir / "ours.npy", want_u8.view());
  const std::string check = R"(
import sys
import numpy as np
a = np.load(sys.argv[1] + '/ours.npy')
assert a.dtype == np.uint8 and a.shape == (4, 6), (a.dtype, a.shape)
assert (a.ravel() == (np.arange(24) * 11) % 256).all()
)";
  EXPECT_TRUE(run_python(dir, check, "'" + dir.path() + "'"));
  expect_bitwise_equal(held<uint8_t>(parse(npy_bytes(want_u8.view()))), want_u8, "round trip");
}

TEST(NpyNumpy, NumpyLoadsOurFilesWithIdenticalValues) {
  TempDir dir;
  // name, dtype, shape: written here, checked by NumPy against the same pattern.
  std::string listing;
  int count = 0;
  auto write_all = [&](auto tag) {
    using T = decltype(tag);
    for (const Shape& shape : kShapes) {
      const Tensor<T> t = pattern_tensor<T>(shape);
      const std::string name = "ours_" + std::to_string(count++) + ".npy";
      // Alternate contiguous and strided sources: the file must not tell.
      if (count % 2) {
        write_npy(dir / name, t.view());
      } else {
        const Strided<T> strided(t.view());
        write_npy(dir / name, strided.const_view());
      }
      listing += "('" + name + "', '" + dtype_str<T>() + "', " + python_shape(shape) + "),\n";
    }
  };
  write_all(float{});
  write_all(double{});
  write_all(int32_t{});
  write_all(int64_t{});

  std::string script = kPythonPattern;
  script += "files = [\n" + listing + "]\n";
  script += R"(
import sys
from numpy.lib import format as npf
out = sys.argv[1]
bad = 0
for name, dtype, shape in files:
    path = out + '/' + name
    a = np.load(path)
    want = pattern(dtype, shape)
    with open(path, 'rb') as f:
        version = npf.read_magic(f)
        npf._read_array_header(f, version)
        offset = f.tell()
    if (a.dtype.str != dtype or a.shape != shape or not a.flags.c_contiguous
            or a.tobytes() != want.tobytes() or version != (1, 0) or offset % 64 != 0):
        print('mismatch in', name, a.dtype.str, a.shape, version, offset, a.ravel()[:8],
              'want', dtype, shape)
        bad += 1
print(len(files), 'files checked,', bad, 'bad')
sys.exit(1 if bad else 0)
)";
  EXPECT_TRUE(run_python(dir, script, "'" + dir.path() + "'"));
}

TEST(NpyNumpy, RejectsNumpyFilesOfUnsupportedKinds) {
  TempDir dir;
  const std::string script = R"(
import sys
import numpy as np
out = sys.argv[1]
a = np.arange(6, dtype='<f4').reshape(2, 3)
np.save(out + '/fortran.npy', np.asfortranarray(a))
np.save(out + '/big_endian.npy', a.astype('>f8'))
np.save(out + '/object.npy', np.array([1, 'x', None], dtype=object), allow_pickle=True)
np.save(out + '/half.npy', a.astype('<f2'))
np.save(out + '/complex.npy', a.astype('<c8'))
np.save(out + '/int8.npy', a.astype('i1'))
np.save(out + '/structured.npy', np.zeros(3, dtype=[('x', '<f4'), ('y', '<i4')]))
np.save(out + '/rank5.npy', np.zeros((1, 2, 1, 2, 1), dtype='<f4'))
)";
  ASSERT_TRUE(run_python(dir, script, "'" + dir.path() + "'"));
  const std::vector<std::pair<std::string, std::vector<std::string_view>>> cases = {
      {"fortran.npy", {"Fortran-order", "offset"}},
      {"big_endian.npy", {"big-endian dtype '>f8'", "offset"}},
      {"object.npy", {"object arrays", "'|O'"}},
      {"half.npy", {"unsupported dtype '<f2'"}},
      {"complex.npy", {"unsupported dtype '<c8'"}},
      {"int8.npy", {"unsupported dtype '|i1'"}},
      {"structured.npy", {"structured dtypes"}},
      {"rank5.npy", {"[1, 2, 1, 2, 1]", "rank 5", "at most 4"}},
  };
  for (const auto& [name, fragments] : cases) {
    SCOPED_TRACE(name);
    const std::string path = dir / name;
    const std::string message = expect_error([&] { read_npy(path); }, {"read_npy", path});
    for (std::string_view fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "lacks " << fragment << ": " << message;
    }
  }
}

// ---- rejected input, one test per rule -----------------------------------------

TEST(NpyReject, BadMagic) {
  std::string bytes = npy_file(f4_dict("(1,)"), std::string(4, '\0'));
  bytes[5] = 'Z';
  expect_error([&] { parse(bytes); },
               {"parse_npy: test.npy: not a .npy file: bad magic at offset 5"});
  expect_error([&] { parse("PK\x03\x04 zip file"); }, {"bad magic at offset 0"});
}

TEST(NpyReject, FileTooShortForThePreamble) {
  expect_error([&] { parse(""); }, {"test.npy", "file too short: 0 bytes"});
  expect_error([&] { parse(std::string("\x93NUMPY\x01", 7)); }, {"file too short: 7 bytes"});
  expect_error([&] { parse(std::string("\x93NUMPY\x02\x00\x10\x00", 10)); },
               {"file too short: 10 bytes", "header length field at offset 8"});
}

TEST(NpyReject, UnknownVersion) {
  std::string bytes = npy_file(f4_dict("(1,)"), std::string(4, '\0'));
  bytes[6] = 4;
  expect_error([&] { parse(bytes); },
               {"test.npy", "unsupported .npy format version 4.0 at offset 6"});
  bytes[6] = 1;
  bytes[7] = 1;
  expect_error([&] { parse(bytes); }, {"unsupported .npy format version 1.1 at offset 6"});
}

TEST(NpyReject, HeaderLengthBeyondTheFile) {
  std::string bytes = npy_file(f4_dict("(1,)"), std::string(4, '\0'));
  const size_t rest = bytes.size() - 10;
  bytes[8] = '\xff';
  bytes[9] = '\x7f';  // 32767
  expect_error([&] { parse(bytes); },
               {"test.npy", "header length 32767 at offset 8 runs past the end of the file",
                "only " + std::to_string(rest) + " bytes follow at offset 10"});
  // Version 2.0 has a 4-byte length.
  std::string v2 = npy_file(f4_dict("(1,)"), std::string(4, '\0'), 2);
  v2[11] = '\x01';  // adds 2^24 to the 4-byte length
  const size_t claimed = (size_t{1} << 24) + static_cast<unsigned char>(v2[8]);
  expect_error([&] { parse(v2); },
               {"header length " + std::to_string(claimed) + " at offset 8 runs past the end"});
}

TEST(NpyReject, MissingKeys) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, }";
  expect_error([&] { parse(npy_file(dict)); },
               {"test.npy", "header at offset 10 is missing key(s) 'shape'"});
  expect_error([&] { parse(npy_file("{}")); },
               {"missing key(s) 'descr', 'fortran_order', 'shape'"});
}

TEST(NpyReject, DuplicateKey) {
  const std::string dict =
      "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'descr': '<f8'}";
  const size_t offset = dict_start(1) + dict.rfind("'descr'");
  expect_error([&] { parse(npy_file(dict, std::string(4, '\0'))); },
               {"duplicate header key 'descr' at offset " + std::to_string(offset)});
}

TEST(NpyReject, UnexpectedKey) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1}";
  const size_t offset = dict_start(1) + dict.find("'extra'");
  expect_error([&] { parse(npy_file(dict, std::string(4, '\0'))); },
               {"unexpected header key 'extra' at offset " + std::to_string(offset)});
}

TEST(NpyReject, ObjectArrays) {
  const std::string dict = "{'descr': '|O', 'fortran_order': False, 'shape': (2,), }";
  const size_t offset = dict_start(1) + dict.find("'|O'");
  expect_error(
      [&] { parse(npy_file(dict, std::string(16, '\0'))); },
      {"object arrays (dtype '|O' at offset " + std::to_string(offset) + ") are not supported"});
}

TEST(NpyReject, OtherDtypesNameTheDtype) {
  for (std::string dtype : {"<f2", "<c16", "|i1", "<i2", "<u4", "<U5", "|f4", "f4", "float32"}) {
    SCOPED_TRACE(dtype);
    const std::string dict = "{'descr': '" + dtype + "', 'fortran_order': False, 'shape': (2,), }";
    const size_t offset = dict_start(1) + dict.find("'" + dtype + "'");
    expect_error([&] { parse(npy_file(dict, std::string(8, '\0'))); },
                 {"unsupported dtype '" + dtype + "' at offset " + std::to_string(offset),
                  "expected one of <f4, <f8, <i4, <i8"});
  }
  const std::string dict = "{'descr': [('x', '<f4')], 'fortran_order': False, 'shape': (2,), }";
  expect_error([&] { parse(npy_file(dict, std::string(8, '\0'))); },
               {"structured dtypes", "offset " + std::to_string(dict_start(1) + dict.find('['))});
  expect_error([&] { parse(npy_file("{'descr': 4, 'fortran_order': False, 'shape': (2,)}")); },
               {"'descr' at offset", "is an integer"});
}

TEST(NpyHeaderOnly, ViewsTheDataInPlaceAndTakesUint16) {
  // parse_npy_header: the key-value store's chunks, read where they are mapped.
  for (const auto& [descr, item] : {std::pair{"<f4", 4}, {"<u2", 2}, {"<i8", 8}, {"|u1", 1}}) {
    SCOPED_TRACE(descr);
    const std::string header = npy_header_bytes(descr, Shape{3, 5});
    EXPECT_EQ(header.size() % 64, 0u);
    const std::string bytes = header + std::string(static_cast<size_t>(15 * item), '\x7f');
    const NpyHeader h = parse_npy_header(bytes.data(), bytes.size(), "chunk.npy");
    EXPECT_EQ(h.descr, descr);
    EXPECT_EQ(h.shape, Shape({3, 5}));
    EXPECT_EQ(h.data_offset, header.size());
    EXPECT_EQ(h.data_bytes, static_cast<size_t>(15 * item));
    // The data must be exactly as long as the header says.
    expect_error([&] { parse_npy_header(bytes.data(), bytes.size() - 1, "chunk.npy"); },
                 {"parse_npy_header: chunk.npy: truncated data"});
    const std::string longer = bytes + "x";
    expect_error([&] { parse_npy_header(longer.data(), longer.size(), "chunk.npy"); },
                 {"parse_npy_header: chunk.npy: header lies about size"});
  }
  // The readers into tensors refuse <u2 like any other dtype they do not take.
  const std::string u2 = npy_header_bytes("<u2", Shape{2}) + std::string(4, '\0');
  expect_error([&] { parse(u2); }, {"unsupported dtype '<u2'"});
  expect_error([&] { parse_npy_header("\x93NUMPX", 6, "x.npy"); }, {"parse_npy_header", "bad magic"});
  expect_error([&] { npy_header_bytes("<f2", Shape{2}); }, {"npy_header_bytes", "'<f2'"});
}

TEST(NpyReject, BigEndian) {
  for (std::string dtype : {">f4", ">f8", ">i4", ">i8"}) {
    SCOPED_TRACE(dtype);
    const std::string dict = "{'descr': '" + dtype + "', 'fortran_order': False, 'shape': (1,), }";
    const size_t offset = dict_start(1) + dict.find("'>");
    expect_error(
        [&] { parse(npy_file(dict, std::string(8, '\0'))); },
        {"big-endian dtype '" + dtype + "' at offset " + std::to_string(offset), "little-endian"});
  }
}

TEST(NpyReject, FortranOrder) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }";
  const size_t offset = dict_start(1) + dict.find("True");
  expect_error([&] { parse(npy_file(dict, std::string(24, '\0'))); },
               {"Fortran-order arrays are not supported ('fortran_order': True at offset " +
                std::to_string(offset) + ")"});
  const std::string as_int = "{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }";
  expect_error([&] { parse(npy_file(as_int, std::string(24, '\0'))); },
               {"'fortran_order' at offset", "is an integer, expected False"});
}

TEST(NpyReject, NegativeSize) {
  const std::string dict = f4_dict("(2, -3)");
  const size_t offset = dict_start(1) + dict.find("-3");
  expect_error([&] { parse(npy_file(dict)); },
               {"negative size -3 in shape at offset " + std::to_string(offset)});
}

TEST(NpyReject, ShapeProductOverflow) {
  // 2^31 * 2^31 elements overflow int64 before any byte is counted.
  const std::string dict = f4_dict("(2147483648, 2147483648)");
  expect_error([&] { parse(npy_file(dict)); },
               {"shape [2147483648, 2147483648]", "of <f4 is too large", "overflows"});
  // Fits in int64 as elements but not as bytes of <f8.
  expect_error(
      [&] {
        parse(
            npy_file("{'descr': '<f8', 'fortran_order': False, "
                     "'shape': (1152921504606846976, 2)}"));
      },
      {"of <f8 is too large"});
  // A zero does not excuse an overflowing product (NumPy rejects it too).
  expect_error([&] { parse(npy_file(f4_dict("(0, 4611686018427387904, 4)"))); },
               {"[0, 4611686018427387904, 4]", "too large"});
  // Beyond int64 altogether.
  const std::string huge = f4_dict("(99999999999999999999,)");
  expect_error([&] { parse(npy_file(huge)); },
               {"integer '99999999999999999999' does not fit in 64 bits at offset " +
                std::to_string(dict_start(1) + huge.find("999"))});
}

TEST(NpyReject, RankAboveFour) {
  const std::string dict = f4_dict("(1, 2, 1, 1, 1)");
  expect_error([&] { parse(npy_file(dict, std::string(8, '\0'))); },
               {"shape [1, 2, 1, 1, 1] at offset " + std::to_string(dict_start(1) + dict.find('(')),
                "has rank 5; at most 4 is supported"});
}

TEST(NpyReject, TruncatedData) {
  const std::string bytes = npy_file(f4_dict("(2, 3)"), std::string(20, '\0'));
  const std::string data_offset = std::to_string(bytes.size() - 20);  // 128: NumPy's padding
  const std::string expected =
      "truncated data: header says shape [2, 3] of <f4 (24 bytes) but only 20 bytes follow at "
      "offset " +
      data_offset;
  expect_error([&] { parse(bytes); }, {"parse_npy: test.npy: " + expected});
  TempDir dir;
  const std::string path = dir / "data.npy";
  write_bytes(path, bytes);
  expect_error([&] { read_npy(path); }, {"read_npy: " + path + ": " + expected});
  // The same from a version 2.0 header, and with nothing after the header.
  const std::string v2 = npy_file(f4_dict("(2, 3)"), std::string(4, '\0'), 2);
  expect_error([&] { parse(v2); },
               {"only 4 bytes follow at offset " + std::to_string(v2.size() - 4)});
  const std::string empty = npy_file(f4_dict("(2, 3)"));
  expect_error([&] { parse(empty); },
               {"only 0 bytes follow at offset " + std::to_string(empty.size())});
}

TEST(NpyReject, DataLongerThanTheShapeSays) {
  const std::string bytes = npy_file(f4_dict("(2, 3)"), std::string(30, '\0'));
  const std::string expected =
      "header lies about size: it says shape [2, 3] of <f4 (24 bytes) but 30 bytes follow at "
      "offset " +
      std::to_string(bytes.size() - 30) + " (6 extra)";
  expect_error([&] { parse(bytes); }, {"parse_npy: test.npy: " + expected});
  TempDir dir;
  write_bytes(dir / "long.npy", bytes);
  expect_error([&] { read_npy(dir / "long.npy"); },
               {"read_npy: " + (dir / "long.npy") + ": " + expected});
  // A zero-size array followed by anything at all.
  expect_error([&] { parse(npy_file(f4_dict("(0, 3)"), "x")); },
               {"shape [0, 3] of <f4 (0 bytes) but 1 bytes follow"});
}

TEST(NpyReject, MalformedHeaderSyntaxNamesTheOffset) {
  struct Case {
    std::string dict;
    std::string at;  // the text at the reported offset
    std::string what;
  };
  const std::vector<Case> cases = {
      {"'descr': '<f4'", "'descr'", "expected '{' to open the header dict"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "", "expected ',' or '}'"},
      {"{'descr' '<f4'}", "'<f4'", "expected ':'"},
      {"{'descr': '<f4}", "'<f4}", "unterminated string"},
      {"{'descr': '<f4', 'fortran_order': false, 'shape': (2,)}", "false", "unknown name 'false'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} x", "x",
       "unexpected text after the header dict"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}", ".0", "expected an integer"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}", "3)", "expected ',' or ')'"},
      {"{'descr': '<f\\x34', 'fortran_order': False, 'shape': (2,)}", "\\x34", "escape sequences"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (,)}", ",)", "expected a value"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': " + std::string(100, '(') + "}",
       std::string(68, '(') + "}", "tuples and lists nested too deeply"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dict);
    // Unpadded, so the end of the dict is the end of the header.
    const std::string bytes = npy_file(c.dict, {}, 1, false);
    const size_t offset = c.at.empty() ? bytes.size() : dict_start(1) + c.dict.find(c.at);
    expect_error([&] { parse(bytes); },
                 {"test.npy: malformed header: " + c.what, "at offset " + std::to_string(offset)});
  }
}

TEST(NpyReject, ShapeMustBeATupleOfIntegers) {
  expect_error([&] { parse(npy_file(f4_dict("(3)"), std::string(12, '\0'))); },
               {"'shape' at offset", "is an integer, expected a tuple"});
  expect_error([&] { parse(npy_file(f4_dict("[2, 3]"), std::string(24, '\0'))); },
               {"'shape' at offset", "is a list, expected a tuple"});
  const std::string dict = f4_dict("(2, 'x')");
  expect_error([&] { parse(npy_file(dict)); },
               {"shape entry at offset " + std::to_string(dict_start(1) + dict.find("'x'")),
                "is a string, expected an integer"});
}

TEST(NpyReject, MissingOrUnreadableFile) {
  TempDir dir;
  const std::string path = dir / "nope.npy";
  expect_error([&] { read_npy(path); },
               {"read_npy: " + path + ": cannot open: No such file or directory"});
  expect_error([&] { read_npy(dir.path()); }, {"read_npy: " + dir.path(), "Is a directory"});
}

TEST(NpyRead, FromAPipe) {
  // Non-regular files are read whole and parsed like memory.
  TempDir dir;
  const std::string fifo = dir / "fifo.npy";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const Tensor<double> t = pattern_tensor<double>({3, 2});
  const std::string bytes = npy_bytes(t.view());
  write_bytes(dir / "src.npy", bytes);
  const std::string command = "cat '" + (dir / "src.npy") + "' > '" + fifo + "' &";
  ASSERT_EQ(std::system(command.c_str()), 0);
  expect_bitwise_equal(held<double>(read_npy(fifo)), t, "from a pipe");
}

// Feeds a FIFO from a thread: `head` then `fill_size` zero bytes, counting
// what the reader takes. The reader's close ends the writing (EPIPE, with
// SIGPIPE blocked in the writer's thread).
class FifoWriter {
 public:
  FifoWriter(std::string path, std::string head, size_t fill_size)
      : thread_([this, path, head = std::move(head), fill_size] {
          sigset_t pipe_set;
          sigemptyset(&pipe_set);
          sigaddset(&pipe_set, SIGPIPE);
          pthread_sigmask(SIG_BLOCK, &pipe_set, nullptr);
          const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
          if (fd < 0) return;
          const std::string zeros(65536, '\0');
          size_t left = fill_size;
          if (put(fd, head)) {
            while (left > 0 &&
                   put(fd, std::string_view(zeros).substr(0, std::min(left, zeros.size())))) {
              left -= std::min(left, zeros.size());
            }
          }
          ::close(fd);
        }) {}
  ~FifoWriter() { join(); }
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  size_t written() const { return written_; }

 private:
  bool put(int fd, std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      written_ += static_cast<size_t>(n);
      bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  std::atomic<size_t> written_{0};
  std::thread thread_;
};

TEST(NpyRead, AStreamThatIsNotNpyFailsAfterItsFirstBytes) {
  // Like /dev/zero, but bounded: a reader that read the whole stream before
  // looking at it would take all 64 MiB.
  TempDir dir;
  const std::string fifo = dir / "zeros.npy";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  FifoWriter writer(fifo, "", size_t{64} << 20);
  expect_error([&] { read_npy(fifo); }, {"read_npy: " + fifo, "not a .npy file: bad magic"});
  writer.join();
  EXPECT_LT(writer.written(), size_t{1} << 20) << "the reader kept reading after the magic";
}

TEST(NpyRead, AStreamIsReadOnlyAsFarAsItsHeaderSays) {
  TempDir dir;
  const std::string fifo = dir / "long.npy";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const Tensor<float> t = pattern_tensor<float>({3, 4});
  FifoWriter writer(fifo, npy_bytes(t.view()), size_t{64} << 20);
  expect_error([&] { read_npy(fifo); },
               {"read_npy: " + fifo, "header lies about size", "[3, 4]", "more bytes follow"});
  writer.join();
  EXPECT_LT(writer.written(), size_t{1} << 20) << "the reader kept reading past the data";
}

TEST(NpyRead, AShortStreamClaimingAHugeShapeIsTruncated) {
  // 2^40 float64 claimed, 64 bytes sent: an error, not a 8 TiB allocation.
  TempDir dir;
  const std::string fifo = dir / "huge.npy";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const Tensor<double> t = pattern_tensor<double>({1, 1});
  std::string bytes = npy_bytes(t.view());
  const size_t shape = bytes.find("(1, 1)");
  ASSERT_NE(shape, std::string::npos);
  bytes.replace(shape, 6, "(1099511627776,)");
  bytes.erase(bytes.find('\n') - 10, 10);  // keep the header length as written
  FifoWriter writer(fifo, bytes, 56);
  expect_error([&] { read_npy(fifo); }, {"read_npy: " + fifo, "truncated data"});
}

TEST(NpyRead, FromADescriptorWhoseFirstBytesWereRead) {
  // How a caller that told .npy from CSV by the magic hands the rest over.
  TempDir dir;
  const Tensor<int32_t> t = pattern_tensor<int32_t>({2, 3, 4});
  const std::string bytes = npy_bytes(t.view());
  write_bytes(dir / "t.npy", bytes);
  const std::string fifo = dir / "t.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  FifoWriter writer(fifo, bytes, 0);
  for (const std::string& path : {dir / "t.npy", fifo}) {
    SCOPED_TRACE(path);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    char magic[6];
    ASSERT_EQ(::read(fd, magic, sizeof magic), 6);
    expect_bitwise_equal(held<int32_t>(read_npy(fd, path, std::string_view(magic, 6))), t,
                         "after the magic");
    ::close(fd);
  }
}

// ---- atomic writes -------------------------------------------------------------

TEST(NpyWrite, IntoAMissingDirectoryThrowsAndLeavesNothing) {
  TempDir dir;
  const std::string path = dir / "missing/out.npy";
  const Tensor<float> t = pattern_tensor<float>({2, 2});
  expect_error([&] { write_npy(path, t.view()); },
               {"write_npy: " + path, "No such file or directory"});
  EXPECT_TRUE(dir.entries().empty());
}

TEST(NpyWrite, ReplacesAnExistingFileFully) {
  TempDir dir;
  const std::string path = dir / "out.npy";
  const Tensor<double> big = pattern_tensor<double>({50, 40});
  const Tensor<int32_t> small = pattern_tensor<int32_t>({2});
  write_bytes(path, std::string(100000, 'z'));
  write_npy(path, big.view());
  EXPECT_EQ(read_bytes(path), npy_bytes(big.view()));
  write_npy(path, small.view());  // shorter: nothing of the old file may remain
  EXPECT_EQ(read_bytes(path), npy_bytes(small.view()));
  expect_bitwise_equal(held<int32_t>(read_npy(path)), small, "replaced");
  EXPECT_EQ(dir.entries(), std::set<std::string>{"out.npy"});
}

TEST(NpyWrite, PermissionsAreThoseNumpyWouldLeave) {
  // A new file gets 0666 minus the umask (not mkstemp's 0600) ...
  TempDir dir;
  const std::string path = dir / "p.npy";
  const mode_t old = ::umask(027);
  write_npy(path, pattern_tensor<float>({2}).view());
  ::umask(old);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  // ... and a replaced file keeps its own.
  ASSERT_EQ(::chmod(path.c_str(), 0604), 0);
  write_npy(path, pattern_tensor<float>({3}).view());
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0604u);
}

TEST(NpyWrite, AFailedWriteLeavesTheOldFileAndNoTemporaryFile) {
  TempDir dir;
  const std::string path = dir / "keep.npy";
  const Tensor<float> old_contents = pattern_tensor<float>({4});
  write_npy(path, old_contents.view());
  const std::string before = read_bytes(path);

  const Tensor<double> big = pattern_tensor<double>({100, 100});  // 80 kB > the limit
  {
    // A full disk is a failure of the system, not of the arguments: IoError.
    FileSizeLimit limit(4096);
    expect_io_error([&] { write_npy(path, big.view()); }, {"write_npy: " + path, "File too large"});
  }
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(dir.entries(), std::set<std::string>{"keep.npy"});
}

TEST(NpyWrite, ADirectoryIsRefusedBeforeAnythingIsWritten) {
  TempDir dir;
  const std::string path = dir / "taken";
  fs::create_directory(path);
  write_bytes(path + "/inside", "x");
  expect_error([&] { write_npy(path, pattern_tensor<int64_t>({3}).view()); },
               {"write_npy: " + path, "is a directory"});
  EXPECT_EQ(dir.entries(), std::set<std::string>{"taken"});
  EXPECT_EQ(read_bytes(path + "/inside"), "x");
}

TEST(NpyWrite, ThroughSymlinksTheTargetIsReplacedAndTheLinksStay) {
  TempDir dir;
  fs::create_directory(dir / "real");
  write_bytes(dir / "real/t.npy", "old");
  fs::create_symlink("real/t.npy", dir / "link.npy");        // relative, into a folder
  fs::create_symlink(dir / "link.npy", dir / "chain.npy");   // a link to the link
  fs::create_symlink("real/new.npy", dir / "dangling.npy");  // its target does not exist yet
  const Tensor<float> t = pattern_tensor<float>({3, 2});
  for (const char* link : {"link.npy", "chain.npy", "dangling.npy"}) {
    SCOPED_TRACE(link);
    const fs::path before = fs::read_symlink(dir / link);
    write_npy(dir / link, t.view());
    EXPECT_TRUE(fs::is_symlink(dir / link));
    EXPECT_EQ(fs::read_symlink(dir / link), before);
  }
  EXPECT_EQ(read_bytes(dir / "real/t.npy"), npy_bytes(t.view()));
  EXPECT_EQ(read_bytes(dir / "real/new.npy"), npy_bytes(t.view()));
  EXPECT_EQ(dir.entries(),
            (std::set<std::string>{"chain.npy", "dangling.npy", "link.npy", "real"}));
  std::set<std::string> real;
  for (const auto& e : fs::directory_iterator(dir / "real")) real.insert(e.path().filename());
  EXPECT_EQ(real, (std::set<std::string>{"new.npy", "t.npy"}));
}

TEST(NpyWrite, AFifoIsWrittenThroughAndStaysAFifo) {
  TempDir dir;
  const std::string fifo = dir / "out.npy";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::string got;
  std::thread reader([&] { got = read_bytes(fifo); });
  const Tensor<double> t = pattern_tensor<double>({4, 5});
  write_npy(fifo, t.view());
  reader.join();
  EXPECT_EQ(got, npy_bytes(t.view()));
  struct stat st;
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the FIFO was replaced";
  EXPECT_EQ(dir.entries(), std::set<std::string>{"out.npy"});
}

// A character device to write to: as root a private copy of /dev/null (so a
// regression cannot replace the system's), else /dev/null itself, which a
// user cannot replace anyway.
std::string null_device(const TempDir& dir) {
  if (::geteuid() != 0) return "/dev/null";
  const std::string path = dir / "null";
  EXPECT_EQ(::mknod(path.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0) << std::strerror(errno);
  return path;
}

TEST(NpyWrite, ACharacterDeviceIsWrittenThroughNotReplaced) {
  TempDir dir;
  const std::string device = null_device(dir);
  write_npy(device, pattern_tensor<float>({100}).view());
  struct stat st;
  ASSERT_EQ(::stat(device.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << device << " is no longer a device";
  for (const std::string& name : dir.entries()) EXPECT_EQ(name, "null");
}

TEST(NpyWrite, InvalidViewsAreRejectedBeforeAnythingIsWritten) {
  TempDir dir;
  const float x = 1.0f;
  const ConstView<float> negative(&x, {2, -1}, {1, 1});
  expect_error([&] { npy_bytes(negative); }, {"npy_bytes", "negative size", "[2, -1]"});
  expect_error([&] { write_npy(dir / "n.npy", negative); }, {"write_npy", "[2, -1]"});
  const ConstView<float> no_data(nullptr, {3});
  expect_error([&] { npy_bytes(no_data); }, {"npy_bytes", "[3]", "has no data"});
  EXPECT_TRUE(dir.entries().empty());
}

}  // namespace
}  // namespace qkv::test

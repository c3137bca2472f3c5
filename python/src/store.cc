// The on-disk key-value store (qkv/store.h) and its index (qkv/index.h) for
// NumPy: qkv.KeyValueStore (create, open, append, verify, its rows read
// back, attention over every row) and qkv.Index (build, open, verify,
// attention through its lists, certified or exact). The store holds float32
// or bfloat16 and computes in float32, so float32 arrays are read in place
// (any strides) and float64 ones are rounded to float32 (a copy); results are
// new arrays.
#include "qkv/store.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "qkv/error.h"
#include "qkv/index.h"
#include "qkv/kernel_regression.h"
#include "qkv/scoring.h"
#include "qkv/store_attention.h"

namespace qkv::python {
namespace {

// qkv.StoreAttentionResult and qkv.IndexAttentionResult: namedtuples made at
// import, held by the module.
py::handle store_result_type, index_result_type;

constexpr double kFloat32Max = std::numeric_limits<float>::max();

// The shortest text that reads back as the same double: "1e+39", "0.5".
std::string number_text(double x) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, x).ptr;
  return std::string(text, end);
}

// A computed number in 3 significant digits: "1e+50", "5.43e-20".
std::string rounded_text(double x) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, x, std::chars_format::general, 3).ptr;
  return std::string(text, end);
}

// Rows (N, C) as float32: a float32 array viewed in place, a float64 one
// rounded to a new float32 array. A float64 element beyond float32's range
// is an Error naming it, not an inf in the store or its scores. `axes`
// names the shape in messages: "(N, D)".
py::array float32_rows(py::handle obj, std::string_view fn, std::string_view name,
                       std::string_view axes) {
  py::array array = float_array(obj, fn, name);
  if (array.ndim() != 2) {
    throw Error(std::string(fn) + ": " + std::string(name) + " has shape " + shape_str(array) +
                "; expected rank 2 " + std::string(axes));
  }
  if (dtype_of(array) == Dtype::kFloat32) return array;
  const ConstView<double> wide = view_of<double>(array);
  auto [narrow, view] = new_array<float>(wide.shape());
  for (int64_t i = 0; i < wide.size(0); ++i) {
    for (int64_t c = 0; c < wide.size(1); ++c) {
      const double x = wide(i, c);
      const auto f = static_cast<float>(x);
      if (std::isfinite(x) && !std::isfinite(f)) {
        throw Error(std::string(fn) + ": " + std::string(name) + "[" + std::to_string(i) + ", " +
                    std::to_string(c) + "] is " + number_text(x) +
                    ", beyond float32's range (about ±3.4e38); stores hold and compute in "
                    "float32");
      }
      view(i, c) = f;
    }
  }
  return narrow;
}

StoreDtype store_dtype_of(const std::string& name, std::string_view fn) {
  if (name == "float32") return StoreDtype::kFloat32;
  if (name == "bfloat16") return StoreDtype::kBFloat16;
  throw Error(std::string(fn) + ": dtype = '" + name +
              "' is not a store dtype; expected 'float32' or 'bfloat16'");
}

StoreCheck check_of(const std::string& name, std::string_view fn) {
  if (name == "checksums") return StoreCheck::kChecksums;
  if (name == "structure") return StoreCheck::kStructure;
  throw Error(std::string(fn) + ": check = '" + name +
              "' is not a check; expected 'checksums' (every file's checksum: reads every byte) "
              "or 'structure' (the manifest, and each file's header and size)");
}

Scoring scoring_of(const std::string& name, std::string_view fn) {
  const ScoringRules* rules = find_scoring(name);
  if (rules == nullptr || !rules->over_store) {
    throw Error(std::string(fn) + ": scoring = '" + name +
                "' is not a scoring function over a store; expected 'dot' or 'distance'");
  }
  return rules->scoring;
}

Kernel kernel_of(const std::string& name, std::string_view fn) {
  try {
    return kernel_from_name(name);
  } catch (const Error&) {
    throw Error(std::string(fn) + ": kernel = '" + name +
                "' is not a kernel; expected 'gaussian' (softmax of the scores), 'boxcar' (or "
                "'uniform'), 'epanechnikov' or 'triangular'");
  }
}

void check_positive(std::string_view fn, std::string_view name, double x) {
  if (!(std::isfinite(x) && x > 0)) {
    throw Error(std::string(fn) + ": " + std::string(name) + " = " + number_text(x) +
                "; expected a finite number > 0");
  }
}

// The scale of softmax attention over a store: `scale`, or for distance
// scoring 1/h^2 from `bandwidth` h (the Gaussian kernel's width, as the
// command's --bandwidth). A distance scale beyond float32's range, which
// stores compute in, would make every score overflow: refused before
// computing, as the command does. `other_use` names what else bandwidth is
// for in fn, for the message when scoring is dot.
std::optional<double> softmax_scale(std::string_view fn, Scoring scoring,
                                    std::optional<double> scale, std::optional<double> bandwidth,
                                    std::string_view other_use = "") {
  const std::string f(fn);
  if (bandwidth) {
    if (scoring != Scoring::kDistance) {
      throw Error(f + ": bandwidth = " + number_text(*bandwidth) +
                  " is for scoring='distance' (its scale is 1/bandwidth^2)" +
                  std::string(other_use) + "; scoring='dot' takes scale");
    }
    if (scale) {
      throw Error(f + ": bandwidth = " + number_text(*bandwidth) + " and scale = " +
                  number_text(*scale) + " are one setting (scale = 1/bandwidth^2); give one");
    }
    check_positive(fn, "bandwidth", *bandwidth);
    const double s = 1.0 / (*bandwidth * *bandwidth);
    if (s > kFloat32Max) {
      // The smallest bandwidth that fits, rounded up so that it does.
      const double smallest = 1.0 / std::sqrt(kFloat32Max) * (1 + 1e-3);
      throw Error(f + ": bandwidth = " + number_text(*bandwidth) +
                  " is too small: the scale 1/bandwidth^2 = " + rounded_text(s) +
                  " is beyond float32's range (3.4e+38), which stores compute in; give a "
                  "bandwidth of at least " +
                  rounded_text(smallest));
    }
    return s;
  }
  if (scale && scoring == Scoring::kDistance && std::isfinite(*scale) && *scale > kFloat32Max) {
    throw Error(f + ": scale = " + number_text(*scale) +
                " is too large: beyond float32's range (3.4e+38), which stores compute in; give "
                "a scale of at most 3.4e+38");
  }
  return scale;
}

// (Nq, k) top rows as NumPy arrays: the library leaves them empty for k = 0.
template <class T>
py::array top_array(Tensor<T>&& top, int64_t nq, int64_t k) {
  if (k == 0) return new_array<T>(Shape{nq, 0}).first;
  return to_numpy(std::move(top), Shape{nq, k});
}

// ---- qkv.KeyValueStore ------------------------------------------------------

// The store as it was last created, opened or appended to, held as an
// immutable snapshot: a call takes the snapshot (with the GIL) and reads it
// while it runs without the GIL, and append swaps in a new one when it is
// done, so one Python thread's append never changes the C++ object another
// thread's attend is reading (KeyValueStore::append changes its object).
class PyStore {
 public:
  explicit PyStore(KeyValueStore store)
      : store_(std::make_shared<const KeyValueStore>(std::move(store))) {}

  std::shared_ptr<const KeyValueStore> snapshot() const { return store_; }
  const KeyValueStore& store() const { return *store_; }
  void replace(KeyValueStore store) {
    store_ = std::make_shared<const KeyValueStore>(std::move(store));
  }

 private:
  std::shared_ptr<const KeyValueStore> store_;
};

PyStore create_store(py::handle dir_obj, py::handle keys_obj, py::handle values_obj,
                     const std::string& dtype_name, int64_t chunk_rows) {
  constexpr std::string_view kFn = "KeyValueStore.create";
  const std::string dir = path_of(dir_obj, kFn, "dir");
  const StoreDtype dtype = store_dtype_of(dtype_name, kFn);
  py::array keys = float32_rows(keys_obj, kFn, "keys", "(N, D)");
  py::array values = float32_rows(values_obj, kFn, "values", "(N, Dv)");
  const ConstView<float> k = view_of<float>(keys), v = view_of<float>(values);
  return PyStore(released(kFn, "KeyValueStore::create",
                          [&] { return KeyValueStore::create(dir, k, v, dtype, chunk_rows); }));
}

PyStore open_store(py::handle dir_obj, const std::string& check_name) {
  constexpr std::string_view kFn = "KeyValueStore.open";
  const std::string dir = path_of(dir_obj, kFn, "dir");
  const StoreCheck check = check_of(check_name, kFn);
  return PyStore(
      released(kFn, "KeyValueStore::open", [&] { return KeyValueStore::open(dir, check); }));
}

void append_rows(PyStore& self, py::handle keys_obj, py::handle values_obj) {
  constexpr std::string_view kFn = "KeyValueStore.append";
  py::array keys = float32_rows(keys_obj, kFn, "keys", "(N, D)");
  py::array values = float32_rows(values_obj, kFn, "values", "(N, Dv)");
  const ConstView<float> k = view_of<float>(keys), v = view_of<float>(values);
  KeyValueStore appended = self.store();  // a copy: the snapshot stays as it was
  released(kFn, "KeyValueStore::append", [&] { appended.append(k, v); });
  self.replace(std::move(appended));
}

// Rows [start, stop) of the keys (or values) as a new float32 array
// (bfloat16 widened): read chunk by chunk, each checked intact after its copy.
py::array read_rows(const PyStore& self, bool keys, int64_t start, std::optional<int64_t> stop) {
  const std::string_view fn = keys ? "KeyValueStore.keys" : "KeyValueStore.values";
  const std::shared_ptr<const KeyValueStore> store = self.snapshot();
  const int64_t n = store->rows(), end = stop.value_or(n);
  if (!(0 <= start && start <= end && end <= n)) {
    throw Error(std::string(fn) + ": start = " + std::to_string(start) +
                ", stop = " + (stop ? std::to_string(*stop) : "None") +
                "; expected 0 <= start <= " + "stop <= " + std::to_string(n) +
                " (the store's rows)");
  }
  const int64_t dim = keys ? store->key_dim() : store->value_dim();
  auto [array, out] = new_array<float>(Shape{end - start, dim});
  released(fn, "KeyValueStore::read_chunk", [&] {
    for (size_t c = 0; c < store->num_chunks(); ++c) {
      const ChunkRange range = store->chunk_range(c);
      const int64_t lo = std::max(start, range.first_row);
      const int64_t hi = std::min(end, range.first_row + range.rows);
      if (lo >= hi) continue;
      const SourceChunk chunk = store->read_chunk(c);
      for (int64_t r = lo; r < hi; ++r) {
        float* row = &out(r - start, 0);
        if (store->dtype() == StoreDtype::kFloat32) {
          const ConstView<float> from = keys ? chunk.keys<float>() : chunk.values<float>();
          std::copy_n(&from(r - range.first_row, 0), dim, row);
        } else {
          const ConstView<bfloat16> from = keys ? chunk.keys<bfloat16>() : chunk.values<bfloat16>();
          const bfloat16* x = &from(r - range.first_row, 0);
          for (int64_t col = 0; col < dim; ++col) row[col] = static_cast<float>(x[col]);
        }
      }
      chunk.check_intact();
    }
  });
  return array;
}

py::object store_attend(const PyStore& self, py::handle queries_obj, py::handle valid_lens_obj,
                        const std::string& scoring, std::optional<double> scale,
                        std::optional<double> bandwidth, int64_t top_k) {
  constexpr std::string_view kFn = "KeyValueStore.attend";
  const std::shared_ptr<const KeyValueStore> store = self.snapshot();
  StoreAttentionOptions options;
  options.scoring = scoring_of(scoring, kFn);
  options.scale = softmax_scale(kFn, options.scoring, scale, bandwidth);
  options.top_k = top_k;
  py::array queries = float32_rows(queries_obj, kFn, "queries", "(Nq, D)");
  const ConstView<float> q = view_of<float>(queries);
  py::object lens_storage;
  // Checked here for the Python argument's name (the library's is valid_rows).
  const ValidLens lens = valid_lens_of(valid_lens_obj, kFn, lens_storage)
                             .for_batch_of_one(kFn, "valid_lens", "queries", q.shape());
  StoreAttentionResult r =
      released(kFn, "attend", [&] { return attend(q, *store, lens, options); });
  const int64_t nq = q.size(0);
  return store_result_type(to_numpy(std::move(r.output)), to_numpy(std::move(r.lse)),
                           top_array(std::move(r.top_ids), nq, top_k),
                           top_array(std::move(r.top_weights), nq, top_k));
}

// ---- qkv.Index ----------------------------------------------------------------

// The store a Python argument holds, as it is now (PyStore::snapshot);
// TypeError naming `fn` unless it is a qkv.KeyValueStore.
std::shared_ptr<const KeyValueStore> store_of(py::handle obj, std::string_view fn) {
  if (!py::isinstance<PyStore>(obj)) {
    throw py::type_error(std::string(fn) + ": store is a " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                         "; expected a qkv.KeyValueStore (KeyValueStore.open(dir))");
  }
  return obj.cast<const PyStore&>().snapshot();
}

StoreIndex build_index(py::handle store_obj, py::handle dir_obj, int64_t lists, int64_t iterations,
                       py::handle seed, int64_t sample_per_list) {
  constexpr std::string_view kFn = "Index.build";
  const std::shared_ptr<const KeyValueStore> store = store_of(store_obj, kFn);
  const std::string dir = path_of(dir_obj, kFn, "dir");
  if (iterations < 0 || iterations > 1000) {
    throw Error(std::string(kFn) + ": iterations = " + std::to_string(iterations) +
                "; expected 0 to 1000");
  }
  IndexBuildOptions options;
  options.lists = lists;
  options.iterations = static_cast<int>(iterations);
  options.seed = seed_of(seed, kFn);
  options.sample_per_list = sample_per_list;
  return released(kFn, "StoreIndex::build",
                  [&] { return StoreIndex::build(*store, dir, options); });
}

StoreIndex open_index(py::handle dir_obj, const std::string& check_name) {
  constexpr std::string_view kFn = "Index.open";
  const std::string dir = path_of(dir_obj, kFn, "dir");
  const StoreCheck check = check_of(check_name, kFn);
  return released(kFn, "StoreIndex::open", [&] { return StoreIndex::open(dir, check); });
}

// Each list's member `field` as a NumPy array (L).
template <class T, class Field>
py::array list_array(const StoreIndex& index, Field field) {
  const std::vector<IndexList>& lists = index.lists();
  auto [array, view] = new_array<T>(Shape{static_cast<int64_t>(lists.size())});
  for (size_t j = 0; j < lists.size(); ++j) view(static_cast<int64_t>(j)) = lists[j].*field;
  return array;
}

// Index.attend's and Index.attend_backward's options, checked as the
// command checks them.
IndexAttentionOptions index_options(std::string_view kFn, const StoreIndex& index,
                                    const std::string& scoring, std::optional<double> scale,
                                    std::optional<double> epsilon, int64_t probe, int64_t top_k,
                                    const std::string& kernel, std::optional<double> bandwidth) {
  const std::string f(kFn);
  IndexAttentionOptions options;
  options.scoring = scoring_of(scoring, kFn);
  options.kernel = kernel_of(kernel, kFn);
  if (options.kernel != Kernel::kGaussian) {
    const std::string named = "kernel = '" + kernel + "'";
    if (!bandwidth) {
      throw Error(f + ": " + named +
                  " needs bandwidth, its width h > 0 (a row weighs K((q - k) / h))");
    }
    check_positive(kFn, "bandwidth", *bandwidth);
    const auto refuse = [&](const std::string& given) {
      throw Error(f + ": " + given + " does not go with " + named +
                  ": its weights are K((q - k) / bandwidth), exact; scoring, scale, epsilon and "
                  "probe are for kernel = 'gaussian' (softmax attention)");
    };
    if (options.scoring != Scoring::kDotProduct) refuse("scoring = '" + scoring + "'");
    if (scale) refuse("scale = " + number_text(*scale));
    if (epsilon) refuse("epsilon = " + number_text(*epsilon));
    if (probe != 0) refuse("probe = " + std::to_string(probe));
    options.bandwidth = bandwidth;
  } else {
    options.scale = softmax_scale(kFn, options.scoring, scale, bandwidth, " or a compact kernel");
    if (epsilon && probe > 0) {
      throw Error(f + ": epsilon = " + number_text(*epsilon) +
                  " and probe = " + std::to_string(probe) +
                  " are two ways to stop; give one (epsilon: visit lists until the certificate "
                  "is at most epsilon; probe: visit that many lists)");
    }
    if (epsilon && !(std::isfinite(*epsilon) && *epsilon >= 0)) {
      throw Error(f + ": epsilon = " + number_text(*epsilon) +
                  "; expected a finite number >= 0 (0 visits every list: exact attention)");
    }
    if (probe < 0) {
      throw Error(f + ": probe = " + std::to_string(probe) +
                  "; expected 0 (certified, by epsilon) or a number of lists >= 1");
    }
    if (epsilon) options.epsilon = *epsilon;
    options.probe = probe;
  }
  if (top_k < 0 || top_k > index.rows()) {
    throw Error(f + ": top_k = " + std::to_string(top_k) + "; expected 0 to the index's " +
                std::to_string(index.rows()) + " rows");
  }
  options.top_k = top_k;
  return options;
}

// An (L, D) matrix of the index's, as a new NumPy array.
py::array list_matrix(ConstView<float> m) {
  auto [array, view] = new_array<float>(m.shape());
  for (int64_t j = 0; j < m.size(0); ++j) {
    for (int64_t d = 0; d < m.size(1); ++d) view(j, d) = m(j, d);
  }
  return array;
}

py::object index_attend(const StoreIndex& index, py::handle queries_obj, const std::string& scoring,
                        std::optional<double> scale, std::optional<double> epsilon, int64_t probe,
                        int64_t top_k, const std::string& kernel, std::optional<double> bandwidth) {
  constexpr std::string_view kFn = "Index.attend";
  const IndexAttentionOptions options =
      index_options(kFn, index, scoring, scale, epsilon, probe, top_k, kernel, bandwidth);
  py::array queries = float32_rows(queries_obj, kFn, "queries", "(Nq, D)");
  const ConstView<float> q = view_of<float>(queries);
  IndexAttentionResult r = released(kFn, "attend", [&] { return attend(q, index, options); });
  const int64_t nq = q.size(0);
  auto [certified, certified_view] = new_array<bool>(Shape{nq});
  for (int64_t i = 0; i < nq; ++i) certified_view(i) = r.top_certified[static_cast<size_t>(i)];
  return index_result_type(to_numpy(std::move(r.output)), to_numpy(std::move(r.lse)),
                           to_numpy(std::move(r.certificate)), to_numpy(std::move(r.lists_visited)),
                           to_numpy(std::move(r.rows_visited)),
                           top_array(std::move(r.top_ids), nq, top_k),
                           top_array(std::move(r.top_weights), nq, top_k), certified);
}

py::array index_attend_backward(const StoreIndex& index, py::handle queries_obj, py::handle forward,
                                py::handle d_output_obj, const std::string& scoring,
                                std::optional<double> scale, std::optional<double> epsilon,
                                int64_t probe) {
  constexpr std::string_view kFn = "Index.attend_backward";
  const IndexAttentionOptions options =
      index_options(kFn, index, scoring, scale, epsilon, probe, 0, "gaussian", std::nullopt);
  if (!py::hasattr(forward, "lists_visited")) {
    throw py::type_error(std::string(kFn) + ": forward is a " +
                         std::string(py::str(py::type::handle_of(forward).attr("__name__"))) +
                         "; expected the IndexAttentionResult of Index.attend on the same queries");
  }
  py::array queries = float32_rows(queries_obj, kFn, "queries", "(Nq, D)");
  py::array d_output = float32_rows(d_output_obj, kFn, "d_output", "(Nq, Dv)");
  py::array visited = int_array(forward.attr("lists_visited"), kFn, "forward.lists_visited", false);
  const ConstView<int64_t> visited_view = view_of<int64_t>(visited);
  IndexAttentionResult saved;
  saved.lists_visited = Tensor<int64_t>(visited_view.shape());
  for (int64_t i = 0; i < visited_view.numel(); ++i) {
    saved.lists_visited.data()[i] = visited_view.shape().rank() == 1 ? visited_view(i) : 0;
  }
  const ConstView<float> q = view_of<float>(queries), d_o = view_of<float>(d_output);
  Tensor<float> d_queries = released(
      kFn, "attend_backward", [&] { return attend_backward(q, index, options, saved, d_o); });
  return to_numpy(std::move(d_queries));
}

StoreIndex update_index(py::handle dir_obj, py::handle store_obj) {
  constexpr std::string_view kFn = "Index.update";
  const std::string dir = path_of(dir_obj, kFn, "dir");
  const std::shared_ptr<const KeyValueStore> store = store_of(store_obj, kFn);
  return released(kFn, "StoreIndex::update", [&] { return StoreIndex::update(dir, *store); });
}

// "qkv.KeyValueStore('/data/memory.qkv', rows=1000, key_dim=8, value_dim=4,
// dtype='float32')", with `more` before the closing parenthesis.
std::string repr_of(std::string_view type, const std::string& dir, int64_t rows, int64_t d,
                    int64_t dv, StoreDtype dtype, const std::string& more = "") {
  return "qkv." + std::string(type) + "(" + std::string(py::repr(py::str(dir))) +
         ", rows=" + std::to_string(rows) + ", key_dim=" + std::to_string(d) +
         ", value_dim=" + std::to_string(dv) + ", dtype='" + std::string(store_dtype_name(dtype)) +
         "'" + more + ")";
}

}  // namespace

void register_store(py::module_& m) {
  const py::object namedtuple = py::module_::import("collections").attr("namedtuple");
  m.attr("StoreAttentionResult") =
      namedtuple("StoreAttentionResult", py::make_tuple("output", "lse", "top_ids", "top_weights"));
  m.attr("StoreAttentionResult").attr("__module__") = "qkv";
  m.attr("StoreAttentionResult").attr("__doc__") =
      "The result of KeyValueStore.attend: output (Nq, Dv) float32; lse (Nq) float32, the "
      "log-sum-exp of each query's scores over its rows (-inf for a query with none); top_ids "
      "(Nq, top_k) int64, each query's rows of largest weight, largest first (-1 past its "
      "rows); top_weights (Nq, top_k) float32, their weights over the whole store (0 past its "
      "rows).";
  store_result_type = m.attr("StoreAttentionResult");
  m.attr("IndexAttentionResult") =
      namedtuple("IndexAttentionResult",
                 py::make_tuple("output", "lse", "certificate", "lists_visited", "rows_visited",
                                "top_ids", "top_weights", "top_certified"));
  m.attr("IndexAttentionResult").attr("__module__") = "qkv";
  m.attr("IndexAttentionResult").attr("__doc__") =
      "The result of Index.attend: output (Nq, Dv) float32, attention over the visited rows; "
      "lse (Nq) float32 over the visited rows; certificate (Nq) float64, a bound on (weight of "
      "the rows not visited) / (weight visited), so the output is within certificate * 2 "
      "max|v| of attention over every row (0: every list visited, or a compact kernel: "
      "exact); lists_visited, rows_visited (Nq) int64; top_ids (Nq, top_k) int64, store row "
      "ids (-1 past the rows); top_weights (Nq, top_k) float32, over the visited rows; "
      "top_certified (Nq) bool, whether no unvisited row can be among the query's top_k.";
  index_result_type = m.attr("IndexAttentionResult");

  py::class_<PyStore>(m, "KeyValueStore",
                      R"(An on-disk key-value store: keys (N, D) and values (N, Dv) of an attention
database, in a directory of .npy chunk files (float32 or bfloat16) and a
manifest with each file's checksum (docs/scale.md). Attention over it reads
one chunk at a time, so memory does not grow with the store.

Make one with KeyValueStore.create or open one with KeyValueStore.open (the
class is not constructed directly). Changes are atomic: a failed or killed
create leaves nothing, a failed or killed append leaves the store as it was.
The computing calls release the GIL. The object is the store as this process
last created, opened or appended to it: rows another process appends later
are seen by a new open (or by this object's next append, which reads the
manifest again).

>>> import os, tempfile
>>> tmp = tempfile.TemporaryDirectory()
>>> rng = np.random.default_rng(0)
>>> keys = rng.standard_normal((1000, 8)).astype(np.float32)
>>> values = rng.standard_normal((1000, 4)).astype(np.float32)
>>> store = qkv.KeyValueStore.create(os.path.join(tmp.name, 'memory.qkv'), keys, values,
...                                  chunk_rows=256)
>>> store.rows, store.key_dim, store.value_dim, store.dtype, store.num_chunks
(1000, 8, 4, 'float32', 4)
>>> queries = rng.standard_normal((3, 8)).astype(np.float32)
>>> r = store.attend(queries, top_k=2)
>>> r.output.shape, r.lse.shape, r.top_ids.shape
((3, 4), (3,), (3, 2))
>>> exact = qkv.scaled_dot_product_attention(queries, keys, values)
>>> bool(np.allclose(r.output, exact, atol=1e-6))
True
)")
      .def_static("create", &create_store, py::arg("dir"), py::arg("keys"), py::arg("values"),
                  py::kw_only(), py::arg("dtype") = "float32",
                  py::arg("chunk_rows") = kDefaultChunkRows,
                  R"(Creates a new store at `dir` from keys (N, D) and values (N, Dv).

The store is built in a temporary directory beside `dir` and renamed into
place when complete, so a failed or killed create leaves nothing at `dir`.

Arguments:
    dir: the new store's directory (str or os.PathLike); it must not exist,
        its parent must.
    keys: (N, D); values: (N, Dv); float32 (read in place, any strides) or
        float64 (rounded to float32), each its own dtype. N = 0 makes an
        empty store.
    dtype: 'float32' or 'bfloat16' (rounded to nearest, ties to even; a
        float64 input is rounded to float32 first).
    chunk_rows: the most rows per chunk file, >= 1 (default 262144).

Returns:
    The new KeyValueStore.

Raises:
    TypeError: keys or values not float arrays, dir not a path.
    qkv.Error (a ValueError): shapes that do not fit (not 2-D, another N,
        D or Dv of 0), a float64 element beyond float32's range (named),
        an unknown dtype, chunk_rows < 1, an existing dir.
    qkv.IoError (an OSError): the system failed a write (a full disk).

>>> small = qkv.KeyValueStore.create(os.path.join(tmp.name, 'small.qkv'), keys[:10],
...                                  values[:10], dtype='bfloat16', chunk_rows=4)
>>> small.rows, small.dtype, small.num_chunks
(10, 'bfloat16', 3)
)")
      .def_static("open", &open_store, py::arg("dir"), py::kw_only(),
                  py::arg("check") = "checksums",
                  R"(Opens an existing store, checking it as `check` says.

Arguments:
    dir: the store's directory (str or os.PathLike).
    check: 'checksums' (the default, as in C++: every chunk file's header and
        checksum, which reads the whole store) or 'structure' (the manifest,
        and each chunk file's presence and size: about a microsecond per
        chunk; each chunk's header is checked when it is first read, as
        `qkv attend --store` does).

Returns:
    The KeyValueStore.

Raises:
    qkv.Error (a ValueError): no store at dir, or a damaged one: the message
        names the file and what is wrong (a malformed manifest, a missing,
        truncated or altered chunk); an unknown check.

>>> again = qkv.KeyValueStore.open(store.dir, check='structure')
>>> again.rows == store.rows
True
)")
      .def("append", &append_rows, py::arg("keys"), py::arg("values"),
           R"(Appends rows: keys (N, D) and values (N, Dv) with this store's D and Dv.

The rows become new chunks after the last (the last chunk is never
rewritten). Atomic: the chunk files are written, flushed and renamed into
place, then the manifest is replaced by a rename, so a failed or killed
append leaves the store as it was. A second append running at the same time
(in any process) fails at once and writes nothing. The manifest is read again
under the store's lock, so rows other processes appended since open are kept;
this object then describes the store after the append. An index built
before is stale afterwards (Index.check_built_over says so).

Arguments:
    keys: (N, D); values: (N, Dv); float32 (read in place) or float64
        (rounded to float32).

Returns:
    None.

Raises:
    TypeError: keys or values not float arrays.
    qkv.Error (a ValueError): another D or Dv than the store's, another N
        for keys and values, a float64 element beyond float32's range,
        another append running.
    qkv.IoError (an OSError): the system failed a write.

>>> grown = qkv.KeyValueStore.create(os.path.join(tmp.name, 'grown.qkv'), keys[:5], values[:5])
>>> grown.append(keys[5:8], values[5:8])
>>> grown.rows, grown.num_chunks
(8, 2)
)")
      .def(
          "verify",
          [](const PyStore& self) {
            const std::shared_ptr<const KeyValueStore> store = self.snapshot();
            released("KeyValueStore.verify", "KeyValueStore::verify", [&] { store->verify(); });
          },
          R"(Reads every chunk file and checks its size, header and checksum against
the manifest.

Returns:
    None: the store is intact.

Raises:
    qkv.Error (a ValueError): the first file that disagrees, named, and
        what is wrong with it (e.g. 'KeyValueStore.verify: DIR/keys-000000.npy:
        checksum ... does not match the manifest's ...').

>>> store.verify()
)")
      .def(
          "keys",
          [](const PyStore& self, int64_t start, std::optional<int64_t> stop) {
            return read_rows(self, true, start, stop);
          },
          py::arg("start") = 0, py::arg("stop") = py::none(),
          R"(The keys of rows [start, stop) as a new float32 array (stop - start, D).

Always a copy, read chunk by chunk: a bfloat16 store's keys are widened to
float32 (exactly: every bfloat16 is a float32). A float32 store's values
are the bits it holds, so create(keys) then keys() gives keys back (float64
input: rounded to float32). The store's files are memory-mapped, and no view
of them is handed out: a view would outlive the check that its file was not
truncated while it was read.

Arguments:
    start: the first row, 0 <= start <= stop.
    stop: one past the last row, <= rows; None for rows.

Returns:
    float32 array (stop - start, D).

Raises:
    qkv.Error (a ValueError): a range outside the store's rows; a chunk
        file that is damaged, missing or changed while it was read (named).

>>> bool(np.array_equal(store.keys(), keys))
True
>>> store.keys(998).shape
(2, 8)
)")
      .def(
          "values",
          [](const PyStore& self, int64_t start, std::optional<int64_t> stop) {
            return read_rows(self, false, start, stop);
          },
          py::arg("start") = 0, py::arg("stop") = py::none(),
          R"(The values of rows [start, stop) as a new float32 array (stop - start, Dv).

A copy, as keys(): a bfloat16 store's values widened to float32.

Arguments:
    start: the first row, 0 <= start <= stop.
    stop: one past the last row, <= rows; None for rows.

Returns:
    float32 array (stop - start, Dv).

Raises:
    qkv.Error (a ValueError): a range outside the store's rows; a damaged
        chunk file (named).

>>> bool(np.array_equal(store.values(10, 20), values[10:20]))
True
)")
      .def("attend", &store_attend, py::arg("queries"), py::arg("valid_lens") = py::none(),
           py::kw_only(), py::arg("scoring") = "dot", py::arg("scale") = py::none(),
           py::arg("bandwidth") = py::none(), py::arg("top_k") = 0,
           R"(Attention of queries (Nq, D) over every row of the store, chunk by chunk.

softmax(scores) V over the rows, the chunks' partial results merged by their
log-sum-exps in chunk order: attention over every row at once, to float
rounding (`qkv attend --store`). Memory: the queries, the results and one
chunk's partial output, whatever the store's size. A bfloat16 store takes
the queries rounded to bfloat16 (products in float32).

Arguments:
    queries: (Nq, D), float32 (read in place, any strides) or float64
        (rounded to float32).
    valid_lens: None (every row), one count (a scalar or (1)) or one per
        query ((Nq) or (1, Nq)), integers: query i sees rows [0, valid_lens[i])
        only, and chunks no query sees are not read. A query with no row gets
        output 0 and lse -inf.
    scoring: 'dot' (scale q . k, scale default 1/sqrt(D)) or 'distance'
        (-scale/2 |q - k|^2, scale default 1: Nadaraya-Watson's Gaussian
        kernel of bandwidth 1/sqrt(scale)).
    scale: the scores' scale: any finite number for dot; > 0 for distance.
    bandwidth: for scoring='distance', the Gaussian kernel's width h > 0
        instead of scale (scale = 1/h^2, as the command's --bandwidth).
    top_k: also each query's top_k rows by weight, 0 <= top_k <= rows.

Returns:
    StoreAttentionResult(output, lse, top_ids, top_weights): output (Nq, Dv)
    float32, lse (Nq) float32, top_ids (Nq, top_k) int64 store row ids by
    weight, largest first (ties: the smaller id; -1 past a query's rows),
    top_weights (Nq, top_k) float32, their weights over the whole store.

Raises:
    TypeError: queries not a float array, valid_lens not integers.
    qkv.Error (a ValueError): queries not 2-D or of another D (named with
        the store's D), valid_lens of another shape or outside [0, rows],
        an unknown scoring, a scale or bandwidth out of range (or both
        given), top_k outside [0, rows], a damaged chunk file (named).

>>> r = store.attend(queries, scoring='distance', bandwidth=2.0)
>>> want = qkv.distance_attention(queries, keys, values, scale=0.25)
>>> bool(np.allclose(r.output, want, atol=1e-5))
True
>>> float(store.attend(queries, valid_lens=[0, 10, 1000]).lse[0])
-inf
)")
      .def_property_readonly(
          "dir", [](const PyStore& self) { return self.store().dir(); },
          "The store's directory, as it was given.")
      .def_property_readonly(
          "rows", [](const PyStore& self) { return self.store().rows(); }, "The number of rows N.")
      .def_property_readonly(
          "key_dim", [](const PyStore& self) { return self.store().key_dim(); },
          "D, the keys' size.")
      .def_property_readonly(
          "value_dim", [](const PyStore& self) { return self.store().value_dim(); },
          "Dv, the values' size.")
      .def_property_readonly(
          "dtype",
          [](const PyStore& self) { return std::string(store_dtype_name(self.store().dtype())); },
          "What the chunk files hold: 'float32' or 'bfloat16'.")
      .def_property_readonly(
          "chunk_rows", [](const PyStore& self) { return self.store().chunk_rows(); },
          "The most rows a chunk file holds (create's chunk_rows).")
      .def_property_readonly(
          "num_chunks",
          [](const PyStore& self) { return static_cast<int64_t>(self.store().num_chunks()); },
          "The number of chunks (each a keys file and a values file).")
      .def("__repr__", [](const PyStore& self) {
        const KeyValueStore& s = self.store();
        return repr_of("KeyValueStore", s.dir(), s.rows(), s.key_dim(), s.value_dim(), s.dtype());
      });

  py::class_<StoreIndex>(
      m, "Index",
      R"(An index over a key-value store (an inverted file, docs/index.md): its keys
clustered by k-means into lists, each with a centroid, a radius and a
largest key norm, the rows copied in list order. Attention through it
visits the lists in the order of a bound on their scores and stops when the
weight the unvisited rows could hold is at most epsilon of the weight
visited: the result carries that bound per query, its certificate. With a
compact kernel (boxcar, Epanechnikov, triangular) it reads only the lists
that can hold a row in reach, and is exact.

Make one with Index.build or open one with Index.open (the class is not
constructed directly). The index describes the store as it was built: after
rows are appended to the store it is stale (check_built_over says so) and
must be built again.

>>> index = qkv.Index.build(store, os.path.join(tmp.name, 'memory.index'), lists=16)
>>> index.num_lists, index.rows, int(index.list_rows.sum())
(16, 1000, 1000)
>>> r = index.attend(queries, epsilon=1e-3)
>>> bool(np.all(r.certificate <= 1e-3))
True
>>> bound = r.certificate * 2 * np.abs(values).max()
>>> bool(np.all(np.abs(r.output - exact).max(axis=1) <= bound + 1e-5))
True
)")
      .def_static("build", &build_index, py::arg("store"), py::arg("dir"), py::kw_only(),
                  py::arg("lists") = 0, py::arg("iterations") = 10, py::arg("seed") = 0,
                  py::arg("sample_per_list") = 64,
                  R"(Builds the index of `store` at `dir`.

A sample of min(rows, lists * sample_per_list) keys, drawn from `seed`, is
clustered by k-means; every key is assigned to its nearest centroid and the
rows are written in list order. The same store, options and seed give the
same index. Built in a hidden directory beside `dir` and renamed into place
when complete: a failed or killed build leaves nothing (`qkv index build`).

Arguments:
    store: the qkv.KeyValueStore to index.
    dir: the new index's directory (str or os.PathLike); it must not exist,
        its parent must.
    lists: the number of lists L, 1 <= L <= rows; 0 picks 4 sqrt(rows).
    iterations: k-means rounds on the sample, 0 to 1000.
    seed: the sample's seed, a whole number in [0, 2**64).
    sample_per_list: training keys per list, 1 to 2**20.

Returns:
    The new Index.

Raises:
    TypeError: store not a KeyValueStore, dir not a path, seed not a whole
        number.
    qkv.Error (a ValueError): options out of range, an existing dir, a
        damaged chunk of the store (named).
    qkv.IoError (an OSError): the system failed a write.

>>> small_index = qkv.Index.build(small, os.path.join(tmp.name, 'small.index'), lists=2,
...                               seed=7)
>>> small_index.num_lists, small_index.dtype
(2, 'bfloat16')
)")
      .def_static("open", &open_index, py::arg("dir"), py::kw_only(),
                  py::arg("check") = "structure",
                  R"(Opens an index, checking it as `check` says.

Arguments:
    dir: the index's directory (str or os.PathLike).
    check: 'structure' (the default, as in C++: the manifest, and each
        file's header and size) or 'checksums' (every file's checksum too,
        which reads the whole index).

Returns:
    The Index.

Raises:
    qkv.Error (a ValueError): no index at dir, or a damaged one: the
        message names the file and what is wrong; an unknown check.

>>> qkv.Index.open(index.dir, check='checksums').num_lists
16
)")
      .def(
          "verify",
          [](const StoreIndex& self) {
            released("Index.verify", "StoreIndex::verify", [&] { self.verify(); });
          },
          R"(Reads every file of the index and checks it against its checksum.

Returns:
    None: the index is intact.

Raises:
    qkv.Error (a ValueError): the first file that disagrees, named.

>>> index.verify()
)")
      .def(
          "check_built_over",
          [](const StoreIndex& self, py::handle store_obj) {
            const std::shared_ptr<const KeyValueStore> store =
                store_of(store_obj, "Index.check_built_over");
            released("Index.check_built_over", "StoreIndex::check_built_over",
                     [&] { self.check_built_over(*store); });
          },
          py::arg("store"),
          R"(Checks that the index was built over `store` as it is now.

Use it before attending through an index opened from disk: its rows are the
store's rows as they were when it was built.

Arguments:
    store: a qkv.KeyValueStore.

Returns:
    None: the index describes this store.

Raises:
    TypeError: store not a KeyValueStore.
    qkv.Error (a ValueError): another dtype, D or Dv, another store (its
        chunks' checksums differ), or rows appended since the build: the
        index is stale and must be built again.

>>> index.check_built_over(store)
>>> index.check_built_over(grown)  # doctest: +ELLIPSIS
Traceback (most recent call last):
qkv.Error: Index.check_built_over: index ... was built over another store than store ... (its chunks' checksums differ): build it again over this one
)")
      .def_static("update", &update_index, py::arg("dir"), py::arg("store"),
                  R"(Brings the index at `dir` up to date with `store` after appends.

Each row appended to the store since the index was built (or last updated)
joins its nearest list; the centroids stay as built and the lists' radii
and norms widen to hold the new rows, so the certificates hold as after a
build. The files are written again (a copy of the index, no k-means) in a
hidden directory swapped in for the old one: whoever opens the index finds
the old one or the new one, whole (`qkv index update`). An index current
with `store` is returned as it is. Objects opened before keep reading the
old files.

Arguments:
    dir: the index's directory (str or os.PathLike).
    store: the qkv.KeyValueStore it was built over, with rows appended since.

Returns:
    The updated Index.

Raises:
    TypeError: store not a KeyValueStore, dir not a path.
    qkv.Error (a ValueError): no index at dir or a damaged one, another
        store, an index without lists (built over an empty store).
    qkv.IoError (an OSError): another process is updating it, or the system
        failed a write.

>>> growing = qkv.KeyValueStore.create(os.path.join(tmp.name, 'growing.qkv'), keys[:600],
...                                    values[:600])
>>> growing_index = qkv.Index.build(growing, os.path.join(tmp.name, 'growing.index'), lists=8)
>>> growing.append(keys[600:], values[600:])
>>> growing_index = qkv.Index.update(growing_index.dir, growing)
>>> growing_index.rows, growing_index.num_lists
(1000, 8)
>>> growing_index.check_built_over(growing)
)")
      .def("attend", &index_attend, py::arg("queries"), py::kw_only(), py::arg("scoring") = "dot",
           py::arg("scale") = py::none(), py::arg("epsilon") = py::none(), py::arg("probe") = 0,
           py::arg("top_k") = 0, py::arg("kernel") = "gaussian", py::arg("bandwidth") = py::none(),
           R"(Attention of queries (Nq, D) through the index's lists (`qkv attend --index`).

kernel='gaussian' (the default) is softmax attention by `scoring`, certified:
lists are visited in the order of a bound on their scores until the weight
the unvisited rows could hold is at most epsilon of the weight visited (or,
with probe, a fixed number of lists). The output is then within
certificate * 2 max|v| of attention over every row; epsilon=0 visits every
list and is exact attention (to float rounding). A compact kernel instead
weighs row j by K((q - k_j) / bandwidth), Nadaraya-Watson's product kernel
(0 outside the box |q_c - k_c| <= bandwidth), reads only the blocks of 64
rows whose bounding box meets that box, and is exact: certificate 0, top_k certain; a query
with no row in reach gets output 0 and lse -inf. A bfloat16 index takes the
queries rounded to bfloat16 for dot scores.

Arguments:
    queries: (Nq, D), float32 (read in place) or float64 (rounded to
        float32); finite.
    scoring: 'dot' (scale q . k, scale default 1/sqrt(D)) or 'distance'
        (-scale/2 |q - k|^2, scale default 1).
    scale: the scores' scale (finite; > 0 for distance).
    epsilon: the certified visit's bound, finite and >= 0; None is 1e-3.
    probe: visit this many lists (> 0), those whose centroids score
        highest (as FAISS's nprobe), instead of certifying; the certificate
        still bounds what was left out. Not with epsilon.
    top_k: also each query's top_k rows, 0 <= top_k <= rows: store row ids
        and weights over the visited rows, largest first; the certified visit
        goes on until they are certain.
    kernel: 'gaussian' (softmax of the scores), or the compact 'boxcar'
        (or 'uniform'), 'epanechnikov' or 'triangular'; a compact kernel
        takes bandwidth and none of scoring='distance', scale, epsilon,
        probe.
    bandwidth: a compact kernel's width h > 0 (required with one), or for
        scoring='distance' the Gaussian kernel's width instead of scale
        (scale = 1/h^2).

Returns:
    IndexAttentionResult(output, lse, certificate, lists_visited,
    rows_visited, top_ids, top_weights, top_certified): output (Nq, Dv) and
    lse (Nq) float32 over the visited rows, certificate (Nq) float64,
    lists_visited and rows_visited (Nq) int64, top_ids (Nq, top_k) int64,
    top_weights (Nq, top_k) float32, top_certified (Nq) bool.

Raises:
    TypeError: queries not a float array.
    qkv.Error (a ValueError): queries not 2-D, of another D or not finite;
        an unknown scoring or kernel; epsilon < 0, probe < 0, both given; a
        compact kernel without bandwidth or with an option that does not
        go with it; top_k outside [0, rows].

>>> r = index.attend(queries, kernel='epanechnikov', bandwidth=1.5, top_k=1)
>>> float(r.certificate.max()), bool(r.top_certified.all())
(0.0, True)
>>> r = index.attend(queries, epsilon=0)
>>> bool(np.allclose(r.output, exact, atol=1e-5)), int(r.lists_visited[0])
(True, 16)
)")
      .def("attend_backward", &index_attend_backward, py::arg("queries"), py::arg("forward"),
           py::arg("d_output"), py::kw_only(), py::arg("scoring") = "dot",
           py::arg("scale") = py::none(), py::arg("epsilon") = py::none(), py::arg("probe") = 0,
           R"(The gradient with respect to the queries of attend()'s softmax output.

The gradient of what attend() computed: attention over the rows each query
visited (the first forward.lists_visited[i] lists in the order of their
bounds, as attend() took them), not of attention over every row; for
epsilon=0 the two are the same. The lists visited stay the same under a
small enough change of a query, so this is the derivative of the output
attend() returned wherever it has one (docs/index.md, "The backward").
Give the same queries and options as the forward.

Arguments:
    queries: (Nq, D), float32 or float64 (rounded to float32), as given
        to attend().
    forward: the IndexAttentionResult attend() returned for them.
    d_output: (Nq, Dv), dLoss/d(output).
    scoring, scale, epsilon, probe: as given to attend() (softmax
        attention; compact kernels have no backward).

Returns:
    float32 array (Nq, D): dLoss/d(queries).

Raises:
    TypeError: forward not an attend() result, arrays not float.
    qkv.Error (a ValueError): shapes that do not fit (named), options out of
        range, lists_visited not of these queries' forward.

>>> r = index.attend(queries, epsilon=1e-3)
>>> d_q = index.attend_backward(queries, r, np.ones_like(r.output), epsilon=1e-3)
>>> d_q.shape == queries.shape, d_q.dtype
(True, dtype('float32'))
)")
      .def_property_readonly("dir", &StoreIndex::dir, "The index's directory, as it was given.")
      .def_property_readonly("rows", &StoreIndex::rows, "The number of rows N (the store's).")
      .def_property_readonly("key_dim", &StoreIndex::key_dim, "D, the keys' size.")
      .def_property_readonly("value_dim", &StoreIndex::value_dim, "Dv, the values' size.")
      .def_property_readonly(
          "dtype",
          [](const StoreIndex& self) { return std::string(store_dtype_name(self.dtype())); },
          "What the index's rows are held as, the store's dtype: 'float32' or 'bfloat16'.")
      .def_property_readonly(
          "num_lists",
          [](const StoreIndex& self) { return static_cast<int64_t>(self.lists().size()); },
          "The number of lists L.")
      .def_property_readonly(
          "list_rows",
          [](const StoreIndex& self) { return list_array<int64_t>(self, &IndexList::rows); },
          "Each list's number of rows, int64 (L); they sum to rows.")
      .def_property_readonly(
          "radii",
          [](const StoreIndex& self) { return list_array<double>(self, &IndexList::radius); },
          "Each list's radius, the largest |k - centroid| of its keys (0 if empty), float64 (L).")
      .def_property_readonly(
          "max_norms",
          [](const StoreIndex& self) { return list_array<double>(self, &IndexList::max_norm); },
          "Each list's largest key norm |k| (0 if empty), float64 (L).")
      .def_property_readonly(
          "centroids", [](const StoreIndex& self) { return list_matrix(self.centroids()); },
          "The lists' centroids, a new float32 array (L, D).")
      .def_property_readonly(
          "box_low", [](const StoreIndex& self) { return list_matrix(self.box_low()); },
          "Each list's bounding box, its least corner: the smallest value of each coordinate "
          "over the list's keys, a new float32 array (L, D) (inf for an empty list).")
      .def_property_readonly(
          "box_high", [](const StoreIndex& self) { return list_matrix(self.box_high()); },
          "Each list's bounding box, its greatest corner, a new float32 array (L, D) (-inf for "
          "an empty list).")
      .def_property_readonly(
          "block_low", [](const StoreIndex& self) { return list_matrix(self.block_low()); },
          "Each block's bounding box, its least corner, a new float32 array (B, D). A list's "
          "rows are cut into blocks of 64 (its last block the rest), in list order: a range "
          "query reads only the blocks whose box meets its own.")
      .def_property_readonly(
          "block_high", [](const StoreIndex& self) { return list_matrix(self.block_high()); },
          "Each block's bounding box, its greatest corner, a new float32 array (B, D).")
      .def("__repr__", [](const StoreIndex& self) {
        return repr_of("Index", self.dir(), self.rows(), self.key_dim(), self.value_dim(),
                       self.dtype(), ", lists=" + std::to_string(self.lists().size()));
      });
}

}  // namespace qkv::python

// Attention through a store's index (qkv/index.h): per query, a bound on
// every list's scores from its centroid, radius and largest key norm; the
// lists visited in the order of their bounds with an online softmax in
// double; stopped when the weight the unvisited rows could hold is at most
// epsilon of the visited weight (or after `probe` lists). docs/index.md has
// the bounds and the proof of the certificate. Then attention through the
// indexes of several parts of a key set, merged (merge_parts).
#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "core/check.h"
#include "kernels/runtime/parallel.h"
#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/index.h"
#include "qkv/kernel_regression.h"
#include "qkv/scoring.h"
#include "qkv/store_attention.h"
#include "store/scored_rows.h"

namespace qkv {
namespace {

constexpr std::string_view kFn = "attend";
constexpr std::string_view kMergeFn = "merge_parts";
constexpr double kInf = std::numeric_limits<double>::infinity();

// log(exp(a) + exp(b)), -inf allowed.
double log_add(double a, double b) {
  if (a < b) std::swap(a, b);
  if (b == -kInf) return a;
  return a + std::log1p(std::exp(b - a));
}

// What one query's visit gives.
struct QueryResult {
  std::vector<double> output;  // (Dv)
  double lse = -kInf;
  double certificate = 0.0;
  int64_t lists = 0, rows = 0;
  std::vector<ScoredRow> top;  // best first
  bool top_certified = true;
};

// The most a key of a list can score, for one query, from the list's
// centroid c, radius r and largest norm m. Dot: s q.k = s q.c + s q.(k - c)
// <= s q.c + |s| |q| r, and s q.k <= |s| |q| |k| <= |s| |q| m. Distance:
// |q - k| >= |q - c| - r, so -s/2 |q - k|^2 <= -s/2 max(0, |q - c| - r)^2.
// Each is widened by what the scores' float arithmetic can add: a float
// dot product of D terms is within gamma_D sum |q_i k_i| <= gamma_D |q| |k|
// of the exact one (Higham, Accuracy and Stability of Numerical
// Algorithms, 3.1), gamma_D = D u / (1 - D u), u = 2^-24; gamma is taken
// as (D + 2) 2^-23, which covers it and the differences' rounding.
struct Bounds {
  bool distance;
  double scale, gamma;

  // The score of a centroid c itself, from q . c: a probe's order.
  double centroid_score(double q_dot_c, double q_norm, double c_norm) const {
    return distance ? -0.5 * scale * squared_distance(q_dot_c, q_norm, c_norm) : scale * q_dot_c;
  }

  // |q - c|^2 = |q|^2 - 2 q . c + |c|^2 from q . c in double. Each product of
  // two floats is exact in double and a sum of D of them is within
  // D 2^-53 |q| |c|, so the result is within 2 (D + 2) 2^-53 (|q| + |c|)^2
  // of |q - c|^2 (far below the bounds' float slack, gamma).
  static double squared_distance(double q_dot_c, double q_norm, double c_norm) {
    return std::max(0.0, q_norm * q_norm - 2.0 * q_dot_c + c_norm * c_norm);
  }

  // The bound of a list from q . c (c its centroid, in double).
  double of(double q_dot_c, double q_norm, double c_norm, const IndexList& list, int64_t d) const {
    if (distance) {
      const double slack =
          2.0 * static_cast<double>(d + 2) * 0x1.0p-53 * (q_norm + c_norm) * (q_norm + c_norm);
      const double squared = std::max(0.0, squared_distance(q_dot_c, q_norm, c_norm) - slack);
      const double gap = std::max(0.0, std::sqrt(squared) - list.radius);
      return -0.5 * scale * gap * gap * (1.0 - gamma);
    }
    const double s = std::abs(scale);
    const double key_norm = std::min(list.max_norm, c_norm + list.radius);
    return std::min(scale * q_dot_c + s * q_norm * list.radius, s * q_norm * list.max_norm) +
           s * gamma * q_norm * key_norm;
  }
};

// q . c_j for every list j, in double: the centroids by coordinate (D, L)
// times q, a loop over the lists inside a loop over the coordinates, which
// the compiler vectorises (a dot product per list does not vectorise
// without reordering its sum: 44 % of a query's 0.3 ms at 4,000 lists).
std::vector<double> centroid_products(const float* q, const StoreIndex& index) {
  const auto lists = static_cast<int64_t>(index.lists().size());
  const int64_t d = index.key_dim();
  const double* by_coordinate = index.centroid_columns().data();
  std::vector<double> products(static_cast<size_t>(lists));
  double* out = products.data();
  for (int64_t k = 0; k < d; ++k) {
    const double x = q[k];
    const double* column = by_coordinate + k * lists;
    for (int64_t j = 0; j < lists; ++j) out[j] += x * column[j];
  }
  return products;
}

template <bool kDistance, class T>
void visit_rows(const float* q, ConstView<T> keys, ConstView<T> values, double scale,
                int64_t first_row, const StoreIndex& index, int64_t k, double& max_score,
                double& sum, std::vector<double>& acc, std::vector<ScoredRow>& top) {
  const int64_t rows = keys.size(0), d = keys.size(1), dv = values.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    const double score = scale * double{raw_score<kDistance>(q, &keys(r, 0), d)};
    if (score > max_score) {
      const double shrink = std::exp(max_score - score);  // 0 for the first row
      sum *= shrink;
      for (double& a : acc) a *= shrink;
      max_score = score;
    }
    const double w = std::exp(score - max_score);
    sum += w;
    const T* v = &values(r, 0);
    for (int64_t c = 0; c < dv; ++c) acc[static_cast<size_t>(c)] += w * double{widen(v[c])};
    if (k > 0 && (static_cast<int64_t>(top.size()) < k || score >= top.back().first)) {
      keep_best(top, {score, index.store_row(first_row + r)}, k);
    }
  }
}

// A compact kernel's profile at |u| <= 1 (qkv/kernel_regression_types.h).
double profile(Kernel kernel, double u) {
  switch (kernel) {
    case Kernel::kEpanechnikov:
      return 1.0 - u * u;
    case Kernel::kTriangular:
      return 1.0 - std::abs(u);
    default:
      return 1.0;  // boxcar
  }
}

// Rows of one list weighed by a compact kernel of width h, summed into
// `sum` and `acc` (weights at most 1: no rescaling). A row is in reach when
// |q_c - k_c| <= h for every c, tested on the exact difference (two floats'
// difference is exact in double), so the support is exact; a row of
// weight 0 (Epanechnikov's edge) is not in reach.
// Weighs rows [begin, end) of a list's chunk (first_row: the list's first
// index row).
template <class T>
void weigh_rows(const float* q, ConstView<T> keys, ConstView<T> values, int64_t begin, int64_t end,
                Kernel kernel, double h, int64_t first_row, const StoreIndex& index, int64_t k,
                double& sum, std::vector<double>& acc, std::vector<ScoredRow>& top) {
  const int64_t d = keys.size(1), dv = values.size(1);
  for (int64_t r = begin; r < end; ++r) {
    const T* key = &keys(r, 0);
    double w = 1.0;
    for (int64_t c = 0; c < d && w > 0; ++c) {
      const double diff = double{q[c]} - double{widen(key[c])};
      w = std::abs(diff) <= h ? w * profile(kernel, diff / h) : 0.0;
    }
    if (!(w > 0)) continue;
    sum += w;
    const T* v = &values(r, 0);
    for (int64_t c = 0; c < dv; ++c) acc[static_cast<size_t>(c)] += w * double{widen(v[c])};
    if (k > 0) keep_best(top, {std::log(w), index.store_row(first_row + r)}, k);
  }
}

// Whether the box [low, high] meets the query's box |q - x|_inf <= h:
// q_c - h <= high_c and low_c <= q_c + h for every c (differences of
// floats, exact in double, as the rows' own test).
bool box_meets(const float* q, const float* low, const float* high, int64_t d, double h) {
  for (int64_t i = 0; i < d; ++i) {
    if (!(double{q[i]} - double{high[i]} <= h && double{low[i]} - double{q[i]} <= h)) return false;
  }
  return true;
}

// Attention with a compact kernel: of every list whose box meets the
// query's box |q - x|_inf <= h and whose ball (c, r) meets it too (its
// centroid within r of the box: the distance from c to the box is
// |max(0, |c - q| - h)|), the blocks whose boxes meet it; no other row is
// in reach. The ball test is widened by a relative 1e-9 (r is already
// rounded up): the distance's own rounding is far below that.
QueryResult kernel_one(const float* q, const StoreIndex& index,
                       const IndexAttentionOptions& options) {
  const int64_t d = index.key_dim(), dv = index.value_dim(), k = options.top_k;
  const double h = *options.bandwidth;
  QueryResult result;
  result.output.assign(static_cast<size_t>(dv), 0.0);
  std::vector<double> acc(static_cast<size_t>(dv));
  double sum = 0.0;
  // Pointers, not a view per list: a view's strides cost 20 % of a query.
  const float* centroids = index.centroids().data();
  const float* box_low = index.box_low().data();
  const float* box_high = index.box_high().data();
  const float* block_low = index.block_low().data();
  const float* block_high = index.block_high().data();
  for (size_t j = 0; j < index.lists().size(); ++j) {
    const IndexList& list = index.lists()[j];
    if (list.rows == 0) continue;
    // In 64 dimensions the box is the sharper test for a box-shaped
    // support: at 10^6 clustered rows and a width covering 0.4 % of the
    // keys, the balls alone let through lists of 28 % of the rows.
    const int64_t at = static_cast<int64_t>(j) * d;
    if (!box_meets(q, box_low + at, box_high + at, d, h)) continue;
    const float* c = centroids + static_cast<int64_t>(j) * d;
    double squared = 0.0;
    for (int64_t i = 0; i < d; ++i) {
      const double gap = std::max(0.0, std::abs(double{c[i]} - double{q[i]}) - h);
      squared += gap * gap;
    }
    if (std::sqrt(squared) > list.radius * (1 + 1e-9) + 1e-9 * h) continue;
    std::optional<SourceChunk> chunk;
    for (int64_t begin = 0, b = list.first_block; begin < list.rows;
         begin += kIndexBlockRows, ++b) {
      if (!box_meets(q, block_low + b * d, block_high + b * d, d, h)) continue;
      if (!chunk) chunk = index.read_list(j);
      const int64_t end = std::min(list.rows, begin + kIndexBlockRows);
      if (index.dtype() == StoreDtype::kFloat32) {
        weigh_rows(q, chunk->keys<float>(), chunk->values<float>(), begin, end, options.kernel, h,
                   list.first_row, index, k, sum, acc, result.top);
      } else {
        weigh_rows(q, chunk->keys<bfloat16>(), chunk->values<bfloat16>(), begin, end,
                   options.kernel, h, list.first_row, index, k, sum, acc, result.top);
      }
      result.rows += end - begin;
    }
    if (!chunk) continue;
    chunk->check_intact();
    ++result.lists;
  }
  if (sum > 0) {
    result.lse = std::log(sum);
    for (int64_t c = 0; c < dv; ++c) {
      result.output[static_cast<size_t>(c)] = acc[static_cast<size_t>(c)] / sum;
    }
  }
  return result;
}

// The nonempty lists in the order attend() visits them (and
// attend_backward() again), each with its bound. Certified: by bound,
// largest first, which shrinks the bound on what is left fastest. With a
// probe: by the score of the list's centroid, largest first, as FAISS's
// nprobe: at 200,000 clustered rows the bound order's first list held 1.3
// of a query's 10 nearest rows on average, the nearest centroid's 9.9
// (a list of wide radius gets a high bound wherever its centroid is). Ties:
// the smaller list.
//
// Sorted lazily: a query usually visits a few of thousands of lists, and
// sorting them all, with a log-add per list for the tails, took 0.5 of a
// query's 1.5 ms at 4,000 lists. The first kFirstSorted lists are picked
// (nth_element) and sorted, then 4 times as many when the visit goes past
// them; what lies beyond the sorted ones counts in the tail as one sum.
class VisitOrder {
 public:
  VisitOrder(const float* q, double q_norm, const StoreIndex& index, const Bounds& bounds,
             bool by_centroid) {
    const std::vector<IndexList>& lists = index.lists();
    const int64_t d = index.key_dim();
    const std::vector<double>& centroid_norms = index.centroid_norms();
    const std::vector<double> products = centroid_products(q, index);
    items_.reserve(lists.size());
    for (size_t j = 0; j < lists.size(); ++j) {
      if (lists[j].rows == 0) continue;
      Item item;
      item.list = j;
      item.bound = bounds.of(products[j], q_norm, centroid_norms[j], lists[j], d);
      item.log_weight = item.bound + index.log_list_rows()[j];
      item.key =
          by_centroid ? bounds.centroid_score(products[j], q_norm, centroid_norms[j]) : item.bound;
      items_.push_back(item);
    }
    sort_more();
  }

  size_t size() const { return items_.size(); }
  // The p-th list to visit (p < size()), its bound.
  size_t list(size_t p) {
    while (p >= sorted_) sort_more();
    return items_[p].list;
  }
  // After visiting the first p lists: the log of the most weight the others
  // could hold (their rows x exp(bound)), and the largest of their bounds.
  double log_tail(size_t p) const { return p < sorted_ ? tail_[p] : rest_log_; }
  double highest(size_t p) const { return p < sorted_ ? highest_[p] : rest_highest_; }

 private:
  static constexpr size_t kFirstSorted = 16;
  struct Item {
    double key, bound, log_weight;
    size_t list;
  };

  // Sorts the next lists into place and forms the tails of the sorted ones
  // and of the rest.
  void sort_more() {
    const size_t begin = sorted_;
    const size_t end = std::min(items_.size(), std::max(kFirstSorted, 4 * sorted_));
    const auto before = [](const Item& a, const Item& b) {
      return a.key > b.key || (a.key == b.key && a.list < b.list);
    };
    if (end < items_.size()) {
      std::nth_element(items_.begin() + static_cast<std::ptrdiff_t>(begin),
                       items_.begin() + static_cast<std::ptrdiff_t>(end), items_.end(), before);
    }
    std::sort(items_.begin() + static_cast<std::ptrdiff_t>(begin),
              items_.begin() + static_cast<std::ptrdiff_t>(end), before);
    // The rest: log sum exp of its log weights (one exp each) and its
    // largest bound.
    double most = -kInf, highest = -kInf;
    for (size_t p = end; p < items_.size(); ++p) {
      most = std::max(most, items_[p].log_weight);
      highest = std::max(highest, items_[p].bound);
    }
    double sum = 0.0;
    if (most > -kInf) {
      for (size_t p = end; p < items_.size(); ++p) sum += std::exp(items_[p].log_weight - most);
    }
    rest_log_ = most > -kInf ? most + std::log(sum) : -kInf;
    rest_highest_ = highest;
    tail_.resize(end);
    highest_.resize(end);
    double tail = rest_log_, top = rest_highest_;
    for (size_t p = end; p-- > begin;) {
      // tail_[p], highest_[p]: of the lists after the p-th.
      tail_[p] = tail;
      highest_[p] = top;
      tail = log_add(tail, items_[p].log_weight);
      top = std::max(top, items_[p].bound);
    }
    sorted_ = end;
  }

  std::vector<Item> items_;
  size_t sorted_ = 0;
  std::vector<double> tail_, highest_;  // per sorted list: of the lists after it
  double rest_log_ = -kInf, rest_highest_ = -kInf;
};

double norm_of(const float* x, int64_t d) {
  double s = 0.0;
  for (int64_t c = 0; c < d; ++c) s += double{x[c]} * double{x[c]};
  return std::sqrt(s);
}

QueryResult attend_one(const float* q, const StoreIndex& index, const Bounds& bounds,
                       const IndexAttentionOptions& options) {
  const int64_t d = index.key_dim(), dv = index.value_dim(), k = options.top_k;
  const double q_norm = norm_of(q, d);
  VisitOrder order(q, q_norm, index, bounds, options.probe > 0);
  QueryResult result;
  result.output.assign(static_cast<size_t>(dv), 0.0);
  std::vector<double> acc(static_cast<size_t>(dv));
  double max_score = -kInf, sum = 0.0;
  const bool distance = bounds.distance;
  for (size_t p = 0; p < order.size(); ++p) {
    const size_t j = order.list(p);
    const SourceChunk chunk = index.read_list(j);
    const int64_t first_row = chunk.range().first_row;
    if (index.dtype() == StoreDtype::kFloat32) {
      const ConstView<float> keys = chunk.keys<float>(), values = chunk.values<float>();
      distance ? visit_rows<true>(q, keys, values, bounds.scale, first_row, index, k, max_score,
                                  sum, acc, result.top)
               : visit_rows<false>(q, keys, values, bounds.scale, first_row, index, k, max_score,
                                   sum, acc, result.top);
    } else {
      const ConstView<bfloat16> keys = chunk.keys<bfloat16>(), values = chunk.values<bfloat16>();
      distance ? visit_rows<true>(q, keys, values, bounds.scale, first_row, index, k, max_score,
                                  sum, acc, result.top)
               : visit_rows<false>(q, keys, values, bounds.scale, first_row, index, k, max_score,
                                   sum, acc, result.top);
    }
    chunk.check_intact();
    ++result.lists;
    result.rows += chunk.range().rows;
    result.lse = max_score + std::log(sum);
    const double tail = order.log_tail(p);
    result.certificate = tail == -kInf ? 0.0 : std::exp(tail - result.lse);
    // The top k are certain once the k-th visited score is at least every
    // unvisited bound.
    const bool last = p + 1 == order.size();
    result.top_certified = last || k == 0 ||
                           (static_cast<int64_t>(result.top.size()) == k &&
                            result.top.back().first >= order.highest(p));
    if (last) break;
    if (options.probe > 0 ? result.lists == options.probe
                          : result.certificate <= options.epsilon && result.top_certified) {
      break;
    }
  }
  if (sum > 0) {
    for (int64_t c = 0; c < dv; ++c)
      result.output[static_cast<size_t>(c)] = acc[static_cast<size_t>(c)] / sum;
  }
  return result;
}

// What attend() and attend_backward() check and compute before any list is
// read: the queries as the scores take them, the scale and the bounds.
struct Prepared {
  Tensor<float> q;
  double scale = 1.0;
  Bounds bounds;
};

Prepared prepare(std::string_view function, ConstView<float> queries, const StoreIndex& index,
                 const IndexAttentionOptions& options) {
  detail::check_rank(function, "queries", queries, 2, "(Nq, D)");
  if (queries.size(1) != index.key_dim()) {
    fail(function, "queries has shape " + queries.shape().str() + " but index " + index.dir() +
                       " has keys of D = " + std::to_string(index.key_dim()));
  }
  const ScoringRules& rules = rules_of(options.scoring);
  if (!rules.over_store) {
    fail(function, "options.scoring is " + std::string(rules.name) +
                       "; attention through an index scores by " + scoring_names(true));
  }
  const bool distance = options.scoring == Scoring::kDistance;
  if (options.scale && !(std::isfinite(*options.scale) && (!distance || *options.scale > 0))) {
    fail(function, "options.scale = " + std::to_string(*options.scale) +
                       "; expected a finite number" +
                       (distance ? " > 0 for distance scoring" : ""));
  }
  if (!(options.epsilon >= 0 && std::isfinite(options.epsilon))) {
    fail(function, "options.epsilon = " + std::to_string(options.epsilon) +
                       "; expected a finite number >= 0");
  }
  if (options.probe < 0) {
    fail(function, "options.probe = " + std::to_string(options.probe) +
                       "; expected 0 (certified) or a number of lists >= 1");
  }
  if (options.kernel != Kernel::kGaussian) {
    const std::string named = "options.kernel is " + std::string(kernel_name(options.kernel));
    if (!options.bandwidth || !(std::isfinite(*options.bandwidth) && *options.bandwidth > 0)) {
      fail(function, named + " and options.bandwidth = " +
                         (options.bandwidth ? std::to_string(*options.bandwidth) : "none") +
                         "; a compact kernel needs a finite width > 0");
    }
    if (options.scale || options.probe > 0 || options.scoring != Scoring::kDotProduct) {
      fail(function, named +
                         ": its weights are K((q - k) / bandwidth), exact; options.scoring, "
                         "options.scale and options.probe are for softmax attention (kGaussian)");
    }
  } else if (options.bandwidth) {
    fail(function, "options.bandwidth = " + std::to_string(*options.bandwidth) +
                       " is for a compact kernel (options.kernel); distance scores take "
                       "options.scale = 1 / h^2");
  }
  if (options.top_k < 0 || options.top_k > index.rows()) {
    fail(function, "options.top_k = " + std::to_string(options.top_k) +
                       "; expected 0 to the index's " + std::to_string(index.rows()) + " rows");
  }
  for (int64_t i = 0; i < queries.size(0); ++i) {
    for (int64_t c = 0; c < queries.size(1); ++c) {
      if (!std::isfinite(queries(i, c))) {
        fail(function, "queries[" + std::to_string(i) + ", " + std::to_string(c) + "] is " +
                           std::to_string(queries(i, c)) + "; expected finite numbers");
      }
    }
  }
  const int64_t nq = queries.size(0), d = index.key_dim();
  const double scale = options.scale ? *options.scale
                       : rules.scale == ScaleRule::kInverseSqrtDim
                           ? 1.0 / std::sqrt(static_cast<double>(d))
                           : 1.0;
  // The queries as the scores take them: rounded to bf16 for dot scoring
  // over a bf16 index (as attention over a store does), else as given
  // (distances and compact kernels take differences in float).
  Tensor<float> q(Shape{nq, d});
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t c = 0; c < d; ++c) {
      const float x = queries(i, c);
      q(i, c) =
          !distance && options.kernel == Kernel::kGaussian && index.dtype() == StoreDtype::kBFloat16
              ? static_cast<float>(bfloat16(x))
              : x;
    }
  }
  return {std::move(q), scale, Bounds{distance, scale, static_cast<double>(d + 2) * 0x1.0p-23}};
}

// One query's gradient: attention over the first `visited` lists of its
// visit order, recomputed in double (its lse and output), then
// dQ = sum_j p_j (dO . v_j - dO . o) ds_j/dq, with ds_j/dq = scale k_j (dot)
// or scale (k_j - q) (distance).
template <bool kDistance, class T>
void backward_rows(const float* q, ConstView<T> keys, ConstView<T> values, double scale, double lse,
                   double d_o_dot_o, const float* d_o, std::vector<double>& dq) {
  const int64_t rows = keys.size(0), d = keys.size(1), dv = values.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    const T* key = &keys(r, 0);
    const double p = std::exp(scale * double{raw_score<kDistance>(q, key, d)} - lse);
    const T* v = &values(r, 0);
    double g = 0.0;
    for (int64_t c = 0; c < dv; ++c) g += double{d_o[c]} * double{widen(v[c])};
    const double ds = p * (g - d_o_dot_o) * scale;
    for (int64_t c = 0; c < d; ++c) {
      dq[static_cast<size_t>(c)] +=
          ds * (kDistance ? double{widen(key[c])} - double{q[c]} : double{widen(key[c])});
    }
  }
}

std::vector<double> backward_one(const float* q, const StoreIndex& index, const Prepared& prepared,
                                 int64_t probe, int64_t visited, const float* d_o) {
  const int64_t d = index.key_dim(), dv = index.value_dim();
  VisitOrder order(q, norm_of(q, d), index, prepared.bounds, probe > 0);
  const size_t lists = std::min(order.size(), static_cast<size_t>(visited));
  const bool distance = prepared.bounds.distance;
  const double scale = prepared.scale;
  double max_score = -kInf, sum = 0.0;
  std::vector<double> acc(static_cast<size_t>(dv));
  std::vector<ScoredRow> no_top;
  for (size_t p = 0; p < lists; ++p) {
    const SourceChunk chunk = index.read_list(order.list(p));
    const int64_t first_row = chunk.range().first_row;
    if (index.dtype() == StoreDtype::kFloat32) {
      const ConstView<float> keys = chunk.keys<float>(), values = chunk.values<float>();
      distance ? visit_rows<true>(q, keys, values, scale, first_row, index, 0, max_score, sum, acc,
                                  no_top)
               : visit_rows<false>(q, keys, values, scale, first_row, index, 0, max_score, sum, acc,
                                   no_top);
    } else {
      const ConstView<bfloat16> keys = chunk.keys<bfloat16>(), values = chunk.values<bfloat16>();
      distance ? visit_rows<true>(q, keys, values, scale, first_row, index, 0, max_score, sum, acc,
                                  no_top)
               : visit_rows<false>(q, keys, values, scale, first_row, index, 0, max_score, sum, acc,
                                   no_top);
    }
    chunk.check_intact();
  }
  std::vector<double> dq(static_cast<size_t>(d));
  if (!(sum > 0)) return dq;
  const double lse = max_score + std::log(sum);
  double d_o_dot_o = 0.0;
  for (int64_t c = 0; c < dv; ++c)
    d_o_dot_o += double{d_o[c]} * (acc[static_cast<size_t>(c)] / sum);
  for (size_t p = 0; p < lists; ++p) {
    const SourceChunk chunk = index.read_list(order.list(p));
    if (index.dtype() == StoreDtype::kFloat32) {
      const ConstView<float> keys = chunk.keys<float>(), values = chunk.values<float>();
      distance ? backward_rows<true>(q, keys, values, scale, lse, d_o_dot_o, d_o, dq)
               : backward_rows<false>(q, keys, values, scale, lse, d_o_dot_o, d_o, dq);
    } else {
      const ConstView<bfloat16> keys = chunk.keys<bfloat16>(), values = chunk.values<bfloat16>();
      distance ? backward_rows<true>(q, keys, values, scale, lse, d_o_dot_o, d_o, dq)
               : backward_rows<false>(q, keys, values, scale, lse, d_o_dot_o, d_o, dq);
    }
    chunk.check_intact();
  }
  return dq;
}

}  // namespace

IndexAttentionResult attend(ConstView<float> queries, const StoreIndex& index,
                            const IndexAttentionOptions& options) {
  const Prepared prepared = prepare(kFn, queries, index, options);
  const Tensor<float>& q = prepared.q;
  const int64_t nq = queries.size(0), dv = index.value_dim();
  std::vector<QueryResult> results(static_cast<size_t>(nq));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(nq));
  for (int64_t first = 0; first < nq; first += kIndexProgressQueries) {
    const int64_t block = std::min(kIndexProgressQueries, nq - first);
    const auto one = [&, first](int64_t t) {
      const int64_t i = first + t;
      try {
        results[static_cast<size_t>(i)] =
            options.kernel != Kernel::kGaussian
                ? kernel_one(&q(i, 0), index, options)
                : attend_one(&q(i, 0), index, prepared.bounds, options);
      } catch (...) {
        errors[static_cast<size_t>(i)] = std::current_exception();
      }
    };
    // One query on the calling thread: waking the pool for it cost 20 % of
    // a 0.3 ms query (its threads yield while they wait).
    if (block == 1) {
      one(0);
    } else {
      kernels::parallel_for(block, one);
    }
    if (std::any_of(errors.begin() + first, errors.begin() + first + block,
                    [](const std::exception_ptr& e) { return e != nullptr; })) {
      break;
    }
    if (options.progress) options.progress(first + block, nq);
  }
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }

  IndexAttentionResult out;
  const int64_t k = options.top_k;
  out.output = Tensor<float>(Shape{nq, dv});
  out.lse = Tensor<float>(Shape{nq});
  out.certificate = Tensor<double>(Shape{nq});
  out.lists_visited = Tensor<int64_t>(Shape{nq});
  out.rows_visited = Tensor<int64_t>(Shape{nq});
  if (k > 0) {
    out.top_ids = Tensor<int64_t>(Shape{nq, k}, -1);
    out.top_weights = Tensor<float>(Shape{nq, k});
  }
  out.top_certified.assign(static_cast<size_t>(nq), true);
  for (int64_t i = 0; i < nq; ++i) {
    const QueryResult& r = results[static_cast<size_t>(i)];
    for (int64_t c = 0; c < dv; ++c)
      out.output(i, c) = static_cast<float>(r.output[static_cast<size_t>(c)]);
    out.lse(i) = static_cast<float>(r.lse);
    out.certificate(i) = r.certificate;
    out.lists_visited(i) = r.lists;
    out.rows_visited(i) = r.rows;
    out.top_certified[static_cast<size_t>(i)] = r.top_certified;
    for (size_t t = 0; t < r.top.size(); ++t) {
      out.top_ids(i, static_cast<int64_t>(t)) = r.top[t].second;
      out.top_weights(i, static_cast<int64_t>(t)) =
          static_cast<float>(std::min(1.0, std::exp(r.top[t].first - r.lse)));
    }
  }
  return out;
}

namespace {

// The certificate of the parts together, for one query: sum_p c_p W_p with
// W_p = V_p / V, part p's share of the visited weight V = sum_p V_p.
// Proof: the missed weight M = sum_p M_p and M_p <= c_p V_p (part p's
// certificate), so M / V = sum_p (M_p / V_p) (V_p / V) <= sum_p c_p W_p.
// W_p = exp(lse_p - lse), in double from the parts' float lses (each within
// 2^-24 |lse_p| of its part's own: the certificate holds to that rounding,
// as a part's holds to its float scores'). A weighted mean of the c_p, so
// at most the largest: with every c_p <= epsilon, so is the merged one (the
// min keeps double rounding from adding an ulp). A part with lse -inf
// visited no row and left none (no lists; or a compact kernel, which leaves
// nothing out): it adds nothing.
double merged_certificate(const std::vector<IndexAttentionResult>& parts, int64_t i) {
  double largest_lse = -kInf, largest_certificate = 0.0;
  for (const IndexAttentionResult& part : parts) {
    const double lse = part.lse(i);
    if (std::isnan(lse)) return lse;  // NaN scores: nothing is bounded
    if (lse == -kInf) continue;
    largest_lse = std::max(largest_lse, lse);
    largest_certificate = std::max(largest_certificate, part.certificate(i));
  }
  if (largest_lse == -kInf) return 0.0;
  double sum = 0.0;
  for (const IndexAttentionResult& part : parts) {
    if (part.lse(i) > -kInf) sum += std::exp(part.lse(i) - largest_lse);
  }
  const double lse = largest_lse + std::log(sum);
  // Each term as exp(log c_p + lse_p - lse): a part's certificate beyond
  // double's range (inf, for a probe far from the rows) times a share that
  // underflows to 0 would be NaN; this way a huge certificate over a tiny
  // share is the small number it is, and inf stays inf.
  double certificate = 0.0;
  for (const IndexAttentionResult& part : parts) {
    if (part.lse(i) == -kInf || part.certificate(i) == 0) continue;
    certificate += std::exp(std::log(part.certificate(i)) + part.lse(i) - lse);
  }
  return std::min(certificate, largest_certificate);
}

}  // namespace

IndexAttentionResult merge_parts(const std::vector<IndexAttentionResult>& parts,
                                 const std::vector<int64_t>& part_rows, int64_t top_k) {
  // The output, lse and top rows merge as attention over a store's parts
  // does (store_attention.h's merge_parts, which checks their shapes).
  std::vector<StoreAttentionResult> attention;
  for (const IndexAttentionResult& part : parts) {
    attention.push_back({part.output, part.lse, part.top_ids, part.top_weights});
  }
  StoreAttentionResult merged = merge_parts(attention, part_rows, top_k);
  const int64_t nq = merged.lse.numel();
  for (size_t p = 0; p < parts.size(); ++p) {
    const std::string at = "parts[" + std::to_string(p) + "]";
    detail::check_shape(kMergeFn, at + ".certificate", parts[p].certificate.view(), Shape{nq});
    detail::check_shape(kMergeFn, at + ".lists_visited", parts[p].lists_visited.view(), Shape{nq});
    detail::check_shape(kMergeFn, at + ".rows_visited", parts[p].rows_visited.view(), Shape{nq});
    if (static_cast<int64_t>(parts[p].top_certified.size()) != nq) {
      fail(kMergeFn, at + ".top_certified has " + std::to_string(parts[p].top_certified.size()) +
                         " entries; expected " + std::to_string(nq) + ", one per query");
    }
  }
  IndexAttentionResult out;
  out.output = std::move(merged.output);
  out.lse = std::move(merged.lse);
  out.top_ids = std::move(merged.top_ids);
  out.top_weights = std::move(merged.top_weights);
  out.certificate = Tensor<double>(Shape{nq});
  out.lists_visited = Tensor<int64_t>(Shape{nq});
  out.rows_visited = Tensor<int64_t>(Shape{nq});
  // The merged top k are certain when every part's are. Part p's are when
  // its k-th visited score (k = min(top_k, its rows)) is at least the
  // bound of each of its unvisited rows, or it visited every row. The
  // merged k-th score is at least each part's k-th (a part's k best
  // visited rows are candidates among all the visited rows), so no
  // unvisited row of any part scores above it: none can be among the
  // merged top k. One more case: a top row whose weight in its part is
  // below float's range (0 in its top_weights, < 2^-150) has no score left
  // to be placed by, and the merge leaves it out. Its weight over every row
  // is smaller still, so it cannot belong when the merged k-th weight is
  // above 0; otherwise the top k are not certain.
  out.top_certified.assign(static_cast<size_t>(nq), true);
  for (int64_t i = 0; i < nq; ++i) {
    out.certificate(i) = merged_certificate(parts, i);
    bool certain = true, left_out = false;
    for (const IndexAttentionResult& part : parts) {
      out.lists_visited(i) += part.lists_visited(i);
      out.rows_visited(i) += part.rows_visited(i);
      certain = certain && part.top_certified[static_cast<size_t>(i)];
      const int64_t k = top_k > 0 && part.top_ids.rank() == 2 ? part.top_ids.size(1) : 0;
      for (int64_t t = 0; t < k; ++t) {
        left_out = left_out || (part.top_ids(i, t) >= 0 && !(part.top_weights(i, t) > 0.0f));
      }
    }
    if (left_out && !(out.top_weights(i, top_k - 1) > 0.0f)) certain = false;
    out.top_certified[static_cast<size_t>(i)] = certain;
  }
  return out;
}

IndexAttentionResult attend(ConstView<float> queries, std::span<const StoreIndex* const> indexes,
                            const IndexAttentionOptions& options) {
  if (indexes.empty()) fail(kFn, "indexes is empty; expected at least one index");
  int64_t rows = 0;
  for (size_t p = 0; p < indexes.size(); ++p) {
    const StoreIndex* index = indexes[p];
    if (index == nullptr) fail(kFn, "indexes[" + std::to_string(p) + "] is null");
    if (index->key_dim() != indexes[0]->key_dim() ||
        index->value_dim() != indexes[0]->value_dim()) {
      fail(kFn, "index " + index->dir() + " has D = " + std::to_string(index->key_dim()) +
                    ", Dv = " + std::to_string(index->value_dim()) + " but index " +
                    indexes[0]->dir() + " has D = " + std::to_string(indexes[0]->key_dim()) +
                    ", Dv = " + std::to_string(indexes[0]->value_dim()) +
                    "; the parts of one key set agree");
    }
    rows += index->rows();
  }
  if (options.top_k < 0 || options.top_k > rows) {
    fail(kFn, "options.top_k = " + std::to_string(options.top_k) + "; expected 0 to the indexes' " +
                  std::to_string(rows) + " rows");
  }
  const auto parts_count = static_cast<int64_t>(indexes.size());
  std::vector<IndexAttentionResult> parts;
  std::vector<int64_t> part_rows;
  for (int64_t p = 0; p < parts_count; ++p) {
    const StoreIndex& index = *indexes[static_cast<size_t>(p)];
    IndexAttentionOptions part = options;
    part.top_k = std::min(options.top_k, index.rows());
    if (options.progress) {
      part.progress = [&options, p, parts_count](int64_t done, int64_t all) {
        options.progress(p * all + done, parts_count * all);
      };
    }
    parts.push_back(attend(queries, index, part));
    part_rows.push_back(index.rows());
  }
  return merge_parts(parts, part_rows, options.top_k);
}

}  // namespace qkv

namespace qkv {

Tensor<float> attend_backward(ConstView<float> queries, const StoreIndex& index,
                              const IndexAttentionOptions& options,
                              const IndexAttentionResult& forward, ConstView<float> d_output) {
  constexpr std::string_view kBackwardFn = "attend_backward";
  if (options.kernel != Kernel::kGaussian) {
    fail(kBackwardFn, "options.kernel is " + std::string(kernel_name(options.kernel)) +
                          "; the backward is softmax attention's (kGaussian, certified or with a "
                          "probe)");
  }
  const Prepared prepared = prepare(kBackwardFn, queries, index, options);
  const int64_t nq = queries.size(0), d = index.key_dim(), dv = index.value_dim();
  detail::check_rank(kBackwardFn, "d_output", d_output, 2, "(Nq, Dv)");
  if (d_output.size(0) != nq || d_output.size(1) != dv) {
    fail(kBackwardFn, "d_output has shape " + d_output.shape().str() + "; expected " +
                          Shape{nq, dv}.str() + " (Nq, Dv) as the forward's output");
  }
  if (forward.lists_visited.shape() != Shape{nq}) {
    fail(kBackwardFn, "forward.lists_visited has shape " + forward.lists_visited.shape().str() +
                          "; expected " + Shape{nq}.str() +
                          ": the result of attend() of the same queries");
  }
  const auto lists = static_cast<int64_t>(index.lists().size());
  for (int64_t i = 0; i < nq; ++i) {
    if (forward.lists_visited(i) < 0 || forward.lists_visited(i) > lists) {
      fail(kBackwardFn, "forward.lists_visited[" + std::to_string(i) + "] = " +
                            std::to_string(forward.lists_visited(i)) + "; expected 0 to the " +
                            std::to_string(lists) + " lists of index " + index.dir());
    }
  }
  Tensor<float> d_queries(Shape{nq, d});
  std::vector<std::exception_ptr> errors(static_cast<size_t>(nq));
  kernels::parallel_for(nq, [&](int64_t i) {
    try {
      // d_output's row as float, contiguous.
      std::vector<float> d_o(static_cast<size_t>(dv));
      for (int64_t c = 0; c < dv; ++c) d_o[static_cast<size_t>(c)] = d_output(i, c);
      const std::vector<double> dq = backward_one(&prepared.q(i, 0), index, prepared, options.probe,
                                                  forward.lists_visited(i), d_o.data());
      for (int64_t c = 0; c < d; ++c)
        d_queries(i, c) = static_cast<float>(dq[static_cast<size_t>(c)]);
    } catch (...) {
      errors[static_cast<size_t>(i)] = std::current_exception();
    }
  });
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  return d_queries;
}

}  // namespace qkv

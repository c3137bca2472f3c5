// ValidLens: which keys each query may attend to. Absent (every key valid),
// one length per batch element (B), or one per query (B, Nq); int32 or int64,
// borrowed from the caller like any other view. The attention front ends add
// causal masking on top (AttentionOptions::causal) with causal(offset).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <variant>

#include "qkv/tensor.h"

namespace qkv {

class ValidLens {
 public:
  // No lengths: every key is valid for every query.
  ValidLens() = default;
  ValidLens(ConstView<int32_t> lens) : lens_(lens) {}
  ValidLens(ConstView<int64_t> lens) : lens_(lens) {}
  // A default-constructed (empty) tensor means no lengths.
  ValidLens(const Tensor<int32_t>& lens) {
    if (!lens.empty()) lens_ = lens.view();
  }
  ValidLens(const Tensor<int64_t>& lens) {
    if (!lens.empty()) lens_ = lens.view();
  }

  // The same lengths with a causal cap: query i also sees no key past
  // i + offset, so its valid length is min(length, clamp(i + 1 + offset, 0,
  // Nk)). offset 0 is torch's is_causal (top-left); Nk - Nq aligns the last
  // query with the last key (queries that continue a key cache). On lengths
  // that already have a cap, the tighter of the two.
  ValidLens causal(int64_t offset) const {
    ValidLens out = *this;
    out.causal_offset_ = causal_ ? std::min(causal_offset_, offset) : offset;
    out.causal_ = true;
    return out;
  }

  // Whether any key can be masked: lengths given, or a causal cap.
  bool present() const { return has_lengths() || causal_; }
  // Whether lengths were given (a causal cap alone gives none).
  bool has_lengths() const { return !std::holds_alternative<std::monostate>(lens_); }
  // Whether the valid length can differ between the queries of one batch
  // element: (B, Nq) lengths, or a causal cap.
  bool per_query() const { return causal_ || shape().rank() == 2; }
  // Shape of the given lengths; rank 0 when none were given.
  Shape shape() const;
  int rank() const { return shape().rank(); }

  // The valid length for query i of batch element b: the given length (or
  // num_keys without one), capped by the causal mask if there is one.
  int64_t operator()(int64_t b, int64_t i, int64_t num_keys) const {
    const int64_t len = given(b, i, num_keys);
    if (!causal_) return len;
    return std::min(len, std::clamp<int64_t>(i + 1 + causal_offset_, 0, num_keys));
  }

  // Throws Error unless the lengths fit scores of shape (B, Nq, Nk): shape
  // (B) or (B, Nq), every value in [0, Nk]. `scores_name`/`scores_shape`
  // name the tensor the message compares against, e.g. "scores" [2, 4, 5].
  void check(std::string_view function, std::string_view scores_name, const Shape& scores_shape,
             int64_t batch, int64_t num_queries, int64_t num_keys) const;

  // An owning copy of the given lengths as int64 (B) or (B, Nq) (without the
  // causal cap); empty Tensor when none were given.
  Tensor<int64_t> to_tensor() const;

  // The lengths of a batch of one: 2-D inputs (scores (Nq, Nk), queries
  // (Nq, D)) stand for a batch of one, as in the qkv command and the Python
  // bindings. A scalar or (1) is one length; (Nq) or (1, Nq) one per query.
  // Returns the same memory viewed as (1) or (1, Nq) (absent stays absent);
  // the values are checked later, by check(). Throws Error otherwise:
  //   "<function>: <lens_name> has shape [4] but <input_name> has shape
  //    [3, 5]; expected [] or [1] (one length), or [3] or [1, 3] (one per query)"
  // (the message alone when `function` is empty). The tensors' half of the
  // rule: qkv::with_batch_axis and without_batch_axis (qkv/tensor.h).
  ValidLens for_batch_of_one(std::string_view function, std::string_view lens_name,
                             std::string_view input_name, const Shape& input_shape) const;

 private:
  // The given length (num_keys without one), before the causal cap.
  int64_t given(int64_t b, int64_t i, int64_t num_keys) const {
    if (const auto* v32 = std::get_if<ConstView<int32_t>>(&lens_)) {
      return v32->rank() == 1 ? (*v32)(b) : (*v32)(b, i);
    }
    if (const auto* v64 = std::get_if<ConstView<int64_t>>(&lens_)) {
      return v64->rank() == 1 ? (*v64)(b) : (*v64)(b, i);
    }
    return num_keys;
  }

  std::variant<std::monostate, ConstView<int32_t>, ConstView<int64_t>> lens_;
  bool causal_ = false;
  int64_t causal_offset_ = 0;
};

}  // namespace qkv

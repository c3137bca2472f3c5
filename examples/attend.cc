// The README's C++ example: the chapter's dot-product attention example.
#include <qkv/qkv.h>

#include <cstdio>

int main() {
  qkv::Tensor<float> queries({2, 1, 2}, {0.5f, -1.f, 2.f, 0.3f});
  qkv::Tensor<float> keys({2, 10, 2}, 1.0f);  // all keys equal: uniform weights
  qkv::Tensor<float> values({2, 10, 4});
  for (int64_t n = 0; n < values.numel(); ++n) values.data()[n] = float(n % 40);
  qkv::Tensor<int64_t> valid_lens({2}, {2, 6});  // batch 0 sees 2 keys, batch 1 sees 6
  auto result = qkv::scaled_dot_product_attention(queries, keys, values, valid_lens);
  for (int64_t b = 0; b < 2; ++b)  // prints [2 3 4 5] and [10 11 12 13]
    std::printf("[%g %g %g %g]\n", result.output(b, 0, 0), result.output(b, 0, 1),
                result.output(b, 0, 2), result.output(b, 0, 3));
}

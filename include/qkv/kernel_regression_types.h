// The types kernel regression's front end (qkv/kernel_regression.h) and its
// kernels (src/kernels/regression/nadaraya_watson.h) share; types only, so a kernel
// includes no front-end header.
#pragma once

namespace qkv {

// Product kernels: K(u) = prod_c k(u_c) with u_c = (q_c - x_c) / h_c and the
// profile k: gaussian exp(-u^2/2), boxcar 1{|u| <= 1}, epanechnikov
// (1 - u^2) 1{|u| <= 1}, triangular (1 - |u|) 1{|u| <= 1}. (Constant factors
// cancel in the ratio.)
enum class Kernel { kGaussian, kBoxcar, kEpanechnikov, kTriangular };

}  // namespace qkv

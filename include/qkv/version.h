// The library's version and license (the file LICENSE at the root of the sources).
#pragma once

namespace qkv {
inline constexpr const char* kVersion = "0.1.0";
inline constexpr const char* kLicense = "MIT";  // SPDX identifier
}  // namespace qkv

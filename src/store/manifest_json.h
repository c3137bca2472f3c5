// Reading and writing the JSON manifests of the store and of its index
// (store.cc, index.cc): values checked one by one, with messages that name
// the file, the member and what was expected. Private to the library.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "qkv/chunk_source.h"
#include "qkv/error.h"

namespace qkv {

using Json = nlohmann::ordered_json;

// 16 lower-case hex digits: how manifests write an XXH3-64.
inline std::string hex64(uint64_t x) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(x));
  return text;
}

// A value as JSON text for a message; the parser took only valid UTF-8, but
// replace rather than throw all the same.
inline std::string shown(const Json& v) {
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

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
  // `manifest` parsed: a JSON object of only `members`, whose "format" is
  // `format` and "version" `version`.
  Json parse(std::string_view manifest, std::initializer_list<const char*> members,
             std::string_view format, int64_t version) const {
    Json json;
    try {
      json = Json::parse(manifest.begin(), manifest.end());
    } catch (const Json::exception& e) {  // a parse error, or a number out of range (1e400)
      fail(std::string("not valid JSON: ") + e.what());
    }
    if (!json.is_object())
      fail(std::string("is a JSON ") + json.type_name() + "; expected an object");
    // The format first: another kind of manifest is named as such, not by
    // its first member this one lacks.
    if (text(json, "format", "") != format) {
      fail("\"format\" is " + shown(json["format"]) + "; expected \"" + std::string(format) + "\"");
    }
    only(json, members, "");
    const int64_t got = integer(json, "version", "", 0, std::numeric_limits<int>::max());
    if (got != version) {
      fail("\"version\" is " + std::to_string(got) + "; this qkv reads version " +
           std::to_string(version));
    }
    return json;
  }
  // The "dtype" member: "float32" or "bfloat16".
  StoreDtype dtype(const Json& object) const {
    const std::string name = text(object, "dtype", "");
    if (name == "float32") return StoreDtype::kFloat32;
    if (name != "bfloat16")
      fail("\"dtype\" is \"" + name + "\"; expected \"float32\" or \"bfloat16\"");
    return StoreDtype::kBFloat16;
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

}  // namespace qkv

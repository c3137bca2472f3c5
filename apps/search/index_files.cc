#include "search/index_files.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "qkv/error.h"

namespace qkv::search {
namespace {

using Json = nlohmann::ordered_json;
constexpr std::string_view kFn = "SearchIndex::open";

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

// Text for a message: bytes outside printable ASCII as \xNN (a parser's
// "last read" may hold any byte of a damaged file, and stderr is a terminal).
std::string printable(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7F) {
      out += c;
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", byte);
      out += buf;
    }
  }
  return out;
}

// A member's value as the file has it, for messages.
std::string shown(const Json& value) {
  return printable(value.dump(-1, ' ', false, Json::error_handler_t::replace));
}

Json parse_json(std::string_view text, const std::string& name) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {  // a parse error, or a number out of range (1e400)
    fail(kFn, name + ": not valid JSON (" + printable(e.what()) + "); build the index again");
  }
}

// The member `key` of `object`, or Error naming it.
const Json& member(const Json& object, const char* key, const std::string& name) {
  const auto at = object.find(key);
  if (at == object.end()) fail(kFn, name + ": no \"" + key + "\"; build the index again");
  return *at;
}

double number_in(const Json& object, const char* key, double low, bool low_open, double high,
                 const std::string& name) {
  const Json& v = member(object, key, name);
  const double x = v.is_number() ? v.get<double>() : NAN;
  if (!(std::isfinite(x) && (low_open ? x > low : x >= low) && x <= high)) {
    char range[96];
    std::snprintf(range, sizeof range, "%c%g, %g]", low_open ? '(' : '[', low, high);
    fail(kFn, name + ": \"" + key + "\" is " + shown(v) + "; expected a number in " + range +
                  " (the manifest was edited or damaged; build the index again)");
  }
  return x;
}

}  // namespace

std::vector<std::string> index_checked_files() {
  std::vector<std::string> files{"packages.json", "query_head.npy", "bm25.sqlite"};
  for (const char* file : kModelFiles) files.push_back(std::string("model/") + file);
  return files;
}

std::string index_manifest_text(const Json& manifest) {
  Json out = manifest;
  const std::string body = manifest.dump();
  out["xxh3"] = hex64(XXH3_64bits(body.data(), body.size()));
  return out.dump(2) + "\n";
}

IndexManifest parse_index_manifest(std::string_view text, const std::string& name) {
  Json m = parse_json(text, name);
  if (!m.is_object()) fail(kFn, name + ": is a JSON " + m.type_name() + "; expected an object");
  if (m.value("format", Json()) != kIndexFormat || m.value("version", Json()) != kIndexVersion) {
    fail(kFn, name + ": not a qkv search index of version " + std::to_string(kIndexVersion) +
                  " (\"format\" " + shown(m.value("format", Json())) + ", \"version\" " +
                  shown(m.value("version", Json())) + ")");
  }
  IndexManifest out;
  const Json& dim = member(m, "dim", name);
  if (!dim.is_number_integer() || dim.get<int64_t>() < 1 || dim.get<int64_t>() > kMaxDim) {
    fail(kFn, name + ": \"dim\" is " + shown(dim) + "; expected an integer in [1, " +
                  std::to_string(kMaxDim) + "] (build the index again)");
  }
  out.dim = dim.get<int64_t>();
  out.score_scale = number_in(m, "score_scale", 0.0, true, kMaxScoreScale, name);
  out.hybrid_weight = number_in(m, "hybrid_weight", 0.0, false, kMaxHybridWeight, name);
  const Json& fusion = member(m, "hybrid_fusion", name);
  const auto* known =
      fusion.is_string()
          ? std::find(std::begin(kFusionNames), std::end(kFusionNames), fusion.get<std::string>())
          : std::end(kFusionNames);
  if (known == std::end(kFusionNames)) {
    fail(kFn, name + ": \"hybrid_fusion\" is " + shown(fusion) +
                  "; expected \"linear\", \"normalized\" or \"ranks\" (build the index again)");
  }
  out.hybrid_fusion = static_cast<int>(known - std::begin(kFusionNames));
  const Json& sections = member(m, "sections", name);
  if (!sections.is_array() || sections.empty())
    fail(kFn, name + ": \"sections\" is " + shown(sections) + "; expected a list of names");
  for (const Json& s : sections) {
    if (!s.is_string() || s.get<std::string>().empty())
      fail(kFn, name + ": \"sections\" holds " + shown(s) + "; expected a section's name");
    out.sections.push_back(s.get<std::string>());
  }
  const Json& files = member(m, "files", name);
  if (!files.is_object())
    fail(kFn, name + ": \"files\" is " + shown(files) + "; expected an object");
  for (const std::string& file : index_checked_files()) {
    const Json& sum = member(files, file.c_str(), name + ": \"files\"");
    const std::string hex = sum.is_string() ? sum.get<std::string>() : std::string();
    if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
      fail(kFn, name + ": \"files\" \"" + file + "\" is " + shown(sum) +
                    "; expected 16 hex digits (an XXH3-64)");
    }
    out.files[file] = hex;
  }
  // Last, so every other mistake is named as itself.
  const Json& sum = member(m, "xxh3", name);
  const std::string want = sum.is_string() ? sum.get<std::string>() : shown(sum);
  m.erase("xxh3");
  const std::string body = m.dump();
  const std::string got = hex64(XXH3_64bits(body.data(), body.size()));
  if (got != want) {
    fail(kFn, name + ": its checksum \"xxh3\" " + printable(want) +
                  " does not match its contents' " + got +
                  " (the manifest was edited or damaged; build the index again)");
  }
  return out;
}

std::vector<IndexedPackage> parse_packages(std::string_view text, const std::string& name) {
  const Json list = parse_json(text, name);
  if (!list.is_array()) fail(kFn, name + ": is a JSON " + list.type_name() + "; expected a list");
  std::vector<IndexedPackage> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const Json& p = list[i];
    const std::string where = name + ": [" + std::to_string(i) + "]";
    if (!p.is_object()) fail(kFn, where + " is " + shown(p) + "; expected an object");
    IndexedPackage package;
    for (const auto& [key, field] : {std::pair{"name", &package.name},
                                     std::pair{"short_description", &package.short_description},
                                     std::pair{"section", &package.section}}) {
      const Json& v = member(p, key, where);
      if (!v.is_string())
        fail(kFn, where + " \"" + key + "\" is " + shown(v) + "; expected a string");
      *field = v.get<std::string>();
    }
    const Json& held_out = member(p, "held_out", where);
    if (!held_out.is_boolean())
      fail(kFn, where + " \"held_out\" is " + shown(held_out) + "; expected true or false");
    package.held_out = held_out.get<bool>();
    out.push_back(std::move(package));
  }
  return out;
}

}  // namespace qkv::search

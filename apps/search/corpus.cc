// The search engine's corpus: apt's package lists read with libapt-pkg's own
// deb822 parser (FileFd decompresses .lz4/.gz/.xz/...; pkgTagFile splits
// stanzas), the highest version of each name kept, long descriptions joined
// from Translation-en on (Package, Description-md5).
#include "search/corpus.h"

#include <apt-pkg/configuration.h>
#include <apt-pkg/debversion.h>
#include <apt-pkg/error.h>
#include <apt-pkg/fileutl.h>
#include <apt-pkg/init.h>
#include <apt-pkg/tagfile.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <mutex>
#include <system_error>
#include <unordered_map>
#include <utility>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "qkv/error.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;

// A fixed seed for the split, apart from the training seed.
constexpr uint64_t kSplitSeed = 0x5ea2c4;
constexpr std::string_view kFn = "read_apt_lists";

// apt's configuration (Dir::State::lists, the compressors FileFd knows), read
// once per process.
void init_apt_config() {
  static std::once_flag once;
  std::call_once(once, [] {
    _error->PushToStack();
    pkgInitConfig(*_config);
    _error->RevertToStack();  // a broken apt.conf only costs the defaults
  });
}

// libapt reports through its own per-thread error stack (_error). While one
// of these lives, messages raised by apt go to a fresh level of that stack,
// which is dropped again at the end, so a caller's pending apt errors are
// neither read nor lost.
class AptErrorScope {
 public:
  AptErrorScope() { _error->PushToStack(); }
  ~AptErrorScope() { _error->RevertToStack(); }
  AptErrorScope(const AptErrorScope&) = delete;
  AptErrorScope& operator=(const AptErrorScope&) = delete;

  // The pending error messages joined by "; " (empty if none), and cleared.
  static std::string take() {
    std::string all, one;
    while (!_error->empty(GlobalError::DEBUG)) {
      _error->PopMessage(one);
      if (!all.empty()) all += "; ";
      all += one;
    }
    return all;
  }
};

// A list file's name: "<anything>_<kind>" or "<kind>.<compressor>", where kind
// is "Packages" or "i18n_Translation-en". ".diff_Index" and the like are not lists.
bool is_list(const std::string& name, std::string_view kind) {
  std::string marker("_");  // appended: GCC 12's -Wrestrict misfires on "_" + kind
  marker.append(kind);
  const size_t at = name.rfind(marker);
  if (at == std::string::npos) return false;
  const std::string_view rest = std::string_view(name).substr(at + marker.size());
  if (rest.empty()) return true;
  static constexpr std::string_view kCompressed[] = {".lz4", ".gz", ".xz", ".bz2", ".lzma", ".zst"};
  return std::find(std::begin(kCompressed), std::end(kCompressed), rest) != std::end(kCompressed);
}

// The lists of one kind in `dir`, sorted by name (so equal versions resolve the
// same way on every run).
std::vector<std::string> find_lists(const std::string& dir, std::string_view kind) {
  std::vector<std::string> lists;
  std::error_code error;
  fs::directory_iterator it(dir, error);
  if (error) fail(kFn, "cannot read the apt lists directory " + dir + ": " + error.message());
  for (const fs::directory_entry& entry : it) {
    std::error_code ignored;
    if (!entry.is_regular_file(ignored)) continue;
    const std::string name = entry.path().filename().string();
    if (is_list(name, kind)) lists.push_back(entry.path().string());
  }
  std::sort(lists.begin(), lists.end());
  return lists;
}

// Calls `stanza` with each stanza of the list at `path`; an Error naming the
// file for anything apt could not open, decompress or parse, and for a stanza
// without a Package field (every stanza of both kinds of list has one; a
// file of other bytes parses into such stanzas).
template <class OnStanza>
void for_each_stanza(const std::string& path, OnStanza&& stanza) {
  AptErrorScope scope;
  FileFd file;
  if (!file.Open(path, FileFd::ReadOnly, FileFd::Extension) || file.Failed()) {
    const std::string why = AptErrorScope::take();
    fail(kFn, "cannot open the apt list " + path + (why.empty() ? "" : ": " + why));
  }
  pkgTagFile tags(&file);
  pkgTagSection section;
  while (true) {
    const unsigned long long offset = tags.Offset();
    const bool more = tags.Step(section);
    if (_error->PendingError() || file.Failed()) {
      const std::string why = AptErrorScope::take();
      fail(kFn, "cannot read the apt list " + path + ": " +
                    (why.empty() ? "read or decompression failed" : why));
    }
    if (!more) break;
    if (!section.Exists("Package"))
      fail(kFn, "the apt list " + path + " has a stanza without a Package field at byte " +
                    std::to_string(offset) + " (of the decompressed text): not a deb822 list");
    stanza(section);
  }
}

std::string field(const pkgTagSection& section, std::string_view name) {
  const APT::StringView value = section.Find(APT::StringView(name.data(), name.size()));
  return std::string(value.data(), value.size());
}

// Splits a deb822 Description value into its first line and the long part:
// continuation lines without their one leading space, " ." as an empty line,
// joined by '\n'. Trailing whitespace of each line is dropped.
std::pair<std::string, std::string> split_description(std::string_view value) {
  size_t end = value.find('\n');
  std::string first(value.substr(0, end));
  while (!first.empty() && (first.back() == ' ' || first.back() == '\t' || first.back() == '\r'))
    first.pop_back();
  std::string rest;
  bool first_line = true;
  while (end != std::string_view::npos) {
    const size_t start = end + 1;
    end = value.find('\n', start);
    std::string_view line = value.substr(start, end == std::string_view::npos ? end : end - start);
    while (!line.empty() && (line.back() == ' ' || line.back() == '\t' || line.back() == '\r'))
      line.remove_suffix(1);
    if (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    if (line == ".") line = {};
    if (!first_line) rest += '\n';
    first_line = false;
    rest += line;
  }
  return {std::move(first), std::move(rest)};
}

// "a, b,\n c" -> {"a", "b", "c"}
std::vector<std::string> split_tags(std::string_view value) {
  std::vector<std::string> tags;
  size_t start = 0;
  while (start <= value.size()) {
    size_t end = value.find(',', start);
    if (end == std::string_view::npos) end = value.size();
    std::string_view tag = value.substr(start, end - start);
    while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.front())))
      tag.remove_prefix(1);
    while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back())))
      tag.remove_suffix(1);
    if (!tag.empty()) tags.emplace_back(tag);
    start = end + 1;
  }
  return tags;
}

struct Candidate {
  Package package;
  std::string version;
  std::string description_md5;
};

}  // namespace

std::vector<Package> read_apt_lists(const std::string& lists_dir) {
  init_apt_config();
  const std::vector<std::string> package_lists = find_lists(lists_dir, "Packages");
  if (package_lists.empty())
    fail(kFn, "no Packages lists (*_Packages, *_Packages.lz4, ...) in " + lists_dir +
                  "; `sudo apt-get update` fetches them");
  const std::vector<std::string> translation_lists = find_lists(lists_dir, "i18n_Translation-en");
  if (translation_lists.empty())
    fail(kFn, "no Translation-en lists (*_i18n_Translation-en*) in " + lists_dir +
                  ", which hold the long descriptions; "
                  "`sudo apt-get update -o Acquire::Languages=en` fetches them");

  std::vector<Candidate> candidates;
  std::unordered_map<std::string, size_t> by_name;
  for (const std::string& path : package_lists) {
    for_each_stanza(path, [&](const pkgTagSection& section) {
      std::string name = field(section, "Package");
      if (name.empty()) return;
      std::string version = field(section, "Version");
      const auto [it, added] = by_name.try_emplace(name, candidates.size());
      if (!added) {
        Candidate& old = candidates[it->second];
        if (debVS.CmpVersion(version, old.version) <= 0) return;  // the highest version wins
      }
      Candidate candidate;
      candidate.package.name = std::move(name);
      auto [short_description, long_description] = split_description(field(section, "Description"));
      candidate.package.short_description = std::move(short_description);
      // Lists with full descriptions in Packages (no Description-md5, or
      // apt configured so) give the long part here; Translation-en overrides.
      candidate.package.long_description = std::move(long_description);
      candidate.package.section = field(section, "Section");
      candidate.package.tags = split_tags(field(section, "Tag"));
      candidate.version = std::move(version);
      candidate.description_md5 = field(section, "Description-md5");
      if (added) {
        candidates.push_back(std::move(candidate));
      } else {
        candidates[it->second] = std::move(candidate);
      }
    });
  }

  for (const std::string& path : translation_lists) {
    for_each_stanza(path, [&](const pkgTagSection& section) {
      const auto it = by_name.find(field(section, "Package"));
      if (it == by_name.end()) return;
      Candidate& candidate = candidates[it->second];
      if (candidate.description_md5.empty() ||
          field(section, "Description-md5") != candidate.description_md5)
        return;
      candidate.package.long_description =
          split_description(field(section, "Description-en")).second;
    });
  }

  std::vector<Package> packages;
  packages.reserve(candidates.size());
  for (Candidate& candidate : candidates) packages.push_back(std::move(candidate.package));
  std::sort(packages.begin(), packages.end(),
            [](const Package& a, const Package& b) { return a.name < b.name; });
  return packages;
}

std::string default_lists_dir() {
  init_apt_config();
  return _config->FindDir("Dir::State::lists", "/var/lib/apt/lists/");
}

DocumentText document_text(const Package& package) {
  DocumentText text;
  text.name = package.name;
  if (package.name.find_first_of("-.+") != std::string::npos) {
    size_t start = 0;
    while (start <= package.name.size()) {
      size_t end = package.name.find_first_of("-.+", start);
      if (end == std::string::npos) end = package.name.size();
      if (end > start) text.name.append(" ").append(package.name, start, end - start);
      start = end + 1;
    }
  }
  text.description = package.long_description;
  const size_t slash = package.section.rfind('/');
  text.section = slash == std::string::npos ? package.section : package.section.substr(slash + 1);
  for (const std::string& tag : package.tags) {
    if (!text.tags.empty()) text.tags += ", ";
    for (size_t i = 0; i < tag.size(); ++i) {
      if (tag.compare(i, 2, "::") == 0) {
        text.tags += ' ';
        ++i;
      } else {
        text.tags += tag[i] == '-' ? ' ' : tag[i];
      }
    }
  }
  return text;
}

std::vector<std::string> words(std::string_view text) {
  std::vector<std::string> out;
  std::string word;
  auto alnum = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
  };
  for (const char c : text) {
    if (alnum(c)) {
      word += (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
    } else if (c == '+' && !word.empty()) {
      word += '+';
    } else if (!word.empty()) {
      out.push_back(std::move(word));
      word.clear();
    }
  }
  if (!word.empty()) out.push_back(std::move(word));
  return out;
}

Split split_of(const std::string& name) {
  const uint64_t h = XXH3_64bits_withSeed(name.data(), name.size(), kSplitSeed) % 20;
  return h < 2 ? Split::kTest : h == 2 ? Split::kValidation : Split::kTrain;
}

}  // namespace qkv::search

// The search engine's corpus: Debian's package index, as apt keeps it
// (/var/lib/apt/lists: *_Packages and *_i18n_Translation-en, compressed or
// not), read with apt's own deb822 parser (libapt-pkg: FileFd, pkgTagFile).
// One Package per name; documents and queries are made from its fields
// (docs/search.md).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::search {

struct Package {
  std::string name;               // "gnuplot-nox"
  std::string short_description;  // the Description's first line: a query, never in a document
  // The long description from Translation-en (Description-en after its first
  // line), paragraphs as in deb822: continuation lines with their leading
  // space removed, joined by '\n', a " ." line an empty line. Empty when the
  // lists have none for this package.
  std::string long_description;
  std::string section;            // "math", "contrib/utils"
  std::vector<std::string> tags;  // debtags: "role::program", "interface::commandline"
};

// Reads every *_Packages* list in `lists_dir` and the long descriptions of
// the *_i18n_Translation-en* lists (joined on Package and Description-md5).
// A name in several lists (bookworm, -updates, -security) is the stanza with
// the highest version (apt's version comparison). Sorted by name; a
// package's position is its document id everywhere (index, BM25, metrics).
// Throws qkv::Error naming the directory when it has no Packages lists, or
// no Translation-en lists (with the command that fetches them:
// `sudo apt-get update -o Acquire::Languages=en`), or a list cannot be read.
std::vector<Package> read_apt_lists(const std::string& lists_dir);

// apt's configured lists directory (Dir::State::lists), "/var/lib/apt/lists/" by default.
std::string default_lists_dir();

// Which queries a package's short description serves: the test split (one
// in ten: `qkv search eval`'s held-out queries), the validation split (one in
// twenty: never trained on, they stop the head's training and choose the
// hybrid's mix), or training; by a hash of the name alone, so the split is
// the same for any seed and any corpus that has the package.
enum class Split { kTrain, kValidation, kTest };
Split split_of(const std::string& name);
inline bool held_out(const std::string& name) { return split_of(name) == Split::kTest; }

// A document's text fields, as both engines index them: the name with its
// '-'/'.'/'+' parts spelled out as words ("gnuplot-nox" -> "gnuplot-nox
// gnuplot nox"), the long description, the section's last part ("utils" for
// "contrib/utils") and the tags with "::" and '-' as spaces
// ("implemented-in::c" -> "implemented in c").
struct DocumentText {
  std::string name, description, section, tags;
};
DocumentText document_text(const Package& package);

// Lower-case words of `text`: maximal runs of ASCII letters and digits
// (and '+' inside or after a word, so "c++" and "g++" stay words); other
// bytes (including UTF-8 sequences) separate words.
std::vector<std::string> words(std::string_view text);

}  // namespace qkv::search

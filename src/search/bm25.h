// The baseline: SQLite FTS5's BM25 ranking (libsqlite3-dev; FTS5 is built
// into Debian's SQLite) over the same documents as the learned engine. The
// database is one file in the search index (docs/search.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "search/corpus.h"

struct sqlite3;

namespace qkv::search {

struct Hit {
  int64_t doc;   // the package's position in read_apt_lists' order
  double score;  // higher is better (for BM25: -bm25(), FTS5's k1 = 1.2, b = 0.75)
};

class Bm25 {
 public:
  // Writes an FTS5 database of `packages`' document_text at `path` (one row
  // per package, rowid = position + 1; columns name, description, section,
  // tags with equal weights; tokenizer unicode61). `path` must not exist.
  static void build(const std::string& path, const std::vector<Package>& packages);

  // Opens a database build() wrote, read-only; throws qkv::Error naming the
  // file if it is missing or not such a database.
  explicit Bm25(const std::string& path);
  ~Bm25();
  Bm25(const Bm25&) = delete;
  Bm25& operator=(const Bm25&) = delete;

  // The best `k` documents for free text `query` (its words() OR-ed, each
  // quoted, so no FTS5 syntax in the query is interpreted; words are cut at
  // '+' as FTS5's tokenizer does, "c++" -> "c", and each distinct piece counts
  // once), best first; ties by smaller doc. Fewer than k when fewer documents
  // share a word with the query; none for a query without words or k = 0;
  // qkv::Error for k < 0. Safe to call from several threads.
  std::vector<Hit> search(std::string_view query, int64_t k) const;

  int64_t size() const;  // documents

 private:
  sqlite3* db_ = nullptr;
};

}  // namespace qkv::search

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
  // Beside the FTS5 table, the file holds each term's postings (document,
  // occurrences) and each document's length in tokens, read from FTS5's own
  // index (fts5vocab), from which search() computes FTS5's bm25() itself.
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

  // The same ranking computed by FTS5 itself: `SELECT rowid, bm25(docs) FROM
  // docs WHERE docs MATCH ? ORDER BY bm25(docs), rowid LIMIT ?`. The same
  // hits and scores as search() (tests hold them equal), but FTS5 scores
  // every matching row through its auxiliary-function API: 50-200 ms for a
  // query with common words over the ~63,000 packages, against ~1 ms.
  std::vector<Hit> search_fts5(std::string_view query, int64_t k) const;

  // Whether some document holds a term of `word` (as search() cuts it):
  // one lookup of each term's postings row, not a search.
  bool has_word(std::string_view word) const;

  int64_t size() const;  // documents

 private:
  sqlite3* db_ = nullptr;
  // Per document, bm25's length term k1 (1 - b + b D / avgdl) (D its tokens
  // in all columns, avgdl their mean over the documents), computed once.
  std::vector<double> length_norm_;
};

}  // namespace qkv::search

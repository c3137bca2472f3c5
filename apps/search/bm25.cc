// The BM25 baseline: an SQLite FTS5 table of the documents (built into a
// temporary file beside the destination and renamed into place), queried by a
// prepared statement that ranks by FTS5's bm25().
#include "search/bm25.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <unordered_set>

#include "qkv/error.h"
#include "search/postings.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;

// The FTS5 table; each term's postings read from it (a blob per term: for
// each document holding the term, in rowid order, the rowid's gap to the
// previous one and the term's occurrences in all columns, as LEB128
// varints); and a small table with the format marker the constructor checks,
// the document count and each document's length in tokens ("doc_tokens",
// uint32 per document, little-endian).
constexpr const char* kSchema =
    "CREATE TABLE qkv_bm25(key TEXT PRIMARY KEY, value) WITHOUT ROWID;"
    "CREATE VIRTUAL TABLE docs USING fts5(name, description, section, tags,"
    " tokenize = 'unicode61');"
    "CREATE TABLE qkv_postings(term TEXT PRIMARY KEY, postings BLOB NOT NULL,"
    " documents INTEGER NOT NULL) WITHOUT ROWID;";
constexpr const char* kFormat = "qkv-search-bm25 1";
constexpr const char* kQuery =
    "SELECT rowid, bm25(docs) FROM docs WHERE docs MATCH ?1"
    " ORDER BY bm25(docs), rowid LIMIT ?2";

constexpr const char* kPostings = "SELECT postings, documents FROM qkv_postings WHERE term = ?1";
// FTS5's bm25() constants (fts5_aux.c).
constexpr double kK1 = 1.2;
constexpr double kB = 0.75;

std::string errno_text(int error) { return std::strerror(error); }

// An sqlite3 handle closed on scope exit.
struct Db {
  sqlite3* db = nullptr;
  ~Db() {
    if (db != nullptr) sqlite3_close_v2(db);
  }
  std::string message() const { return db != nullptr ? sqlite3_errmsg(db) : "out of memory"; }
};

// A prepared statement finalized on scope exit.
struct Statement {
  sqlite3_stmt* stmt = nullptr;
  ~Statement() { sqlite3_finalize(stmt); }
};

void exec(std::string_view fn, const Db& db, const std::string& path, const char* sql) {
  char* error = nullptr;
  if (sqlite3_exec(db.db, sql, nullptr, nullptr, &error) != SQLITE_OK) {
    const std::string text = error != nullptr ? error : db.message();
    sqlite3_free(error);
    fail_io(fn, path + ": " + text);
  }
}

void bind_text(std::string_view fn, const Db& db, const std::string& path, sqlite3_stmt* stmt,
               int index, const std::string& text) {
  if (sqlite3_bind_text(stmt, index, text.data(), static_cast<int>(text.size()),
                        SQLITE_TRANSIENT) != SQLITE_OK)
    fail_io(fn, path + ": " + db.message());
}

// The terms of free text: its words() cut at '+' (unicode61 separates there:
// "c++" is the token "c", "a+b" the tokens "a" and "b"; on the ASCII letters
// and digits words() keeps, a piece is one unicode61 token), each distinct
// piece once, in first-occurrence order (so "c c++" does not count "c" twice
// in bm25's sum over phrases).
std::vector<std::string> query_terms(std::string_view query) {
  std::vector<std::string> terms;
  std::unordered_set<std::string> seen;
  for (const std::string& word : words(query)) {
    size_t start = 0;
    while (start < word.size()) {
      size_t end = word.find('+', start);
      if (end == std::string::npos) end = word.size();
      std::string piece = word.substr(start, end - start);
      start = end + 1;
      if (!piece.empty() && seen.insert(piece).second) terms.push_back(std::move(piece));
    }
  }
  return terms;
}

// The FTS5 expression for the terms: each a quoted string, joined by OR. FTS5
// interprets nothing inside a string: "and", "near", "*" and "-" are plain
// words (and terms hold only [a-z0-9]: nothing to escape).
std::string match_expression(const std::vector<std::string>& terms) {
  std::string expr;
  for (const std::string& term : terms) {
    if (!expr.empty()) expr += " OR ";
    expr.append("\"").append(term).append("\"");
  }
  return expr;
}

void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Fills qkv_postings and doc_tokens from FTS5's own index, through an
// fts5vocab table of every token instance (term, doc, col, offset; in term
// and then rowid order), so the tokens are exactly those FTS5 counted.
void write_postings(std::string_view fn, sqlite3* db, const std::string& path, int64_t documents) {
  const auto check = [&](int rc, int ok) {
    if (rc != ok) fail_io(fn, path + ": " + sqlite3_errmsg(db));
  };
  check(sqlite3_exec(
            db, "CREATE VIRTUAL TABLE temp.qkv_vocab USING fts5vocab(main, 'docs', 'instance')",
            nullptr, nullptr, nullptr),
        SQLITE_OK);
  check(sqlite3_exec(db, "BEGIN", nullptr, nullptr, nullptr), SQLITE_OK);
  std::vector<uint32_t> doc_tokens(static_cast<size_t>(documents), 0);
  {
    Statement scan, put;
    check(sqlite3_prepare_v2(db, "SELECT term, doc FROM temp.qkv_vocab", -1, &scan.stmt, nullptr),
          SQLITE_OK);
    check(sqlite3_prepare_v2(
              db, "INSERT INTO qkv_postings(term, postings, documents) VALUES (?1, ?2, ?3)", -1,
              &put.stmt, nullptr),
          SQLITE_OK);
    std::string term, blob;
    int64_t doc = 0, previous = 0, term_documents = 0;
    uint64_t count = 0;
    const auto end_doc = [&] {
      if (count == 0) return;
      put_varint(blob, static_cast<uint64_t>(doc - previous));
      put_varint(blob, count);
      ++term_documents;
      previous = doc;
      count = 0;
    };
    const auto end_term = [&] {
      end_doc();
      if (blob.empty()) return;
      check(
          sqlite3_bind_text(put.stmt, 1, term.data(), static_cast<int>(term.size()), SQLITE_STATIC),
          SQLITE_OK);
      check(
          sqlite3_bind_blob(put.stmt, 2, blob.data(), static_cast<int>(blob.size()), SQLITE_STATIC),
          SQLITE_OK);
      check(sqlite3_bind_int64(put.stmt, 3, term_documents), SQLITE_OK);
      check(sqlite3_step(put.stmt), SQLITE_DONE);
      sqlite3_reset(put.stmt);
      blob.clear();
      term_documents = 0;
      previous = 0;
    };
    int rc;
    while ((rc = sqlite3_step(scan.stmt)) == SQLITE_ROW) {
      const char* text = reinterpret_cast<const char*>(sqlite3_column_text(scan.stmt, 0));
      const std::string_view t(text != nullptr ? text : "",
                               static_cast<size_t>(sqlite3_column_bytes(scan.stmt, 0)));
      const int64_t d = sqlite3_column_int64(scan.stmt, 1);
      if (d < 1 || d > documents) fail_io(fn, path + ": fts5vocab gave rowid " + std::to_string(d));
      if (t != term) {
        end_term();
        term.assign(t);
        doc = d;
      } else if (d != doc) {
        if (d < doc) fail_io(fn, path + ": fts5vocab's instances are not in rowid order");
        end_doc();
        doc = d;
      }
      ++count;
      ++doc_tokens[static_cast<size_t>(d - 1)];
    }
    check(rc, SQLITE_DONE);
    end_term();
  }
  {
    Statement meta;
    check(sqlite3_prepare_v2(db, "INSERT INTO qkv_bm25(key, value) VALUES ('doc_tokens', ?1)", -1,
                             &meta.stmt, nullptr),
          SQLITE_OK);
    std::string bytes(doc_tokens.size() * 4, '\0');
    for (size_t i = 0; i < doc_tokens.size(); ++i)
      for (int j = 0; j < 4; ++j) bytes[4 * i + j] = static_cast<char>(doc_tokens[i] >> (8 * j));
    check(sqlite3_bind_blob(meta.stmt, 1, bytes.data(), static_cast<int>(bytes.size()),
                            SQLITE_STATIC),
          SQLITE_OK);
    check(sqlite3_step(meta.stmt), SQLITE_DONE);
  }
  check(sqlite3_exec(db, "COMMIT", nullptr, nullptr, nullptr), SQLITE_OK);
  check(sqlite3_exec(db, "DROP TABLE temp.qkv_vocab", nullptr, nullptr, nullptr), SQLITE_OK);
}

}  // namespace

void Bm25::build(const std::string& path, const std::vector<Package>& packages) {
  constexpr std::string_view kFn = "Bm25::build";
  if (path.empty()) fail(kFn, "the database path is empty");
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0)
    fail(kFn, path + ": already exists; a new database needs a new path");
  const fs::path target(path);
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");

  // The temporary file beside the destination: the rename is atomic, and a
  // killed build leaves only ".<name>.qkv-XXXXXX" (and its journal), never a
  // partial database at `path`.
  // (Appended, not "." + name: GCC 12's -Wrestrict misfires on that.)
  std::string temp_name(".");
  temp_name.append(target.filename().string()).append(".qkv-XXXXXX");
  std::string temp = (parent / temp_name).string();
  const int fd = ::mkstemp(temp.data());
  if (fd < 0)
    fail_io(kFn, path + ": cannot create a temporary file beside it: " + errno_text(errno));
  ::close(fd);
  try {
    {
      Db db;
      if (sqlite3_open_v2(temp.c_str(), &db.db, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK)
        fail_io(kFn, temp + ": " + db.message());
      // No journal: the file is not in place until it is complete, and a
      // failure discards it whole.
      exec(kFn, db, temp, "PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;");
      exec(kFn, db, temp, kSchema);
      exec(kFn, db, temp, "BEGIN");
      {
        Statement meta;
        if (sqlite3_prepare_v2(db.db, "INSERT INTO qkv_bm25(key, value) VALUES (?1, ?2)", -1,
                               &meta.stmt, nullptr) != SQLITE_OK)
          fail_io(kFn, temp + ": " + db.message());
        bind_text(kFn, db, temp, meta.stmt, 1, "format");
        bind_text(kFn, db, temp, meta.stmt, 2, kFormat);
        if (sqlite3_step(meta.stmt) != SQLITE_DONE) fail_io(kFn, temp + ": " + db.message());
        sqlite3_reset(meta.stmt);
        bind_text(kFn, db, temp, meta.stmt, 1, "documents");
        sqlite3_bind_int64(meta.stmt, 2, static_cast<sqlite3_int64>(packages.size()));
        if (sqlite3_step(meta.stmt) != SQLITE_DONE) fail_io(kFn, temp + ": " + db.message());
      }
      {
        Statement insert;
        if (sqlite3_prepare_v2(db.db,
                               "INSERT INTO docs(rowid, name, description, section, tags)"
                               " VALUES (?1, ?2, ?3, ?4, ?5)",
                               -1, &insert.stmt, nullptr) != SQLITE_OK)
          fail_io(kFn, temp + ": " + db.message());
        for (size_t i = 0; i < packages.size(); ++i) {
          const DocumentText text = document_text(packages[i]);
          sqlite3_bind_int64(insert.stmt, 1, static_cast<sqlite3_int64>(i + 1));
          bind_text(kFn, db, temp, insert.stmt, 2, text.name);
          bind_text(kFn, db, temp, insert.stmt, 3, text.description);
          bind_text(kFn, db, temp, insert.stmt, 4, text.section);
          bind_text(kFn, db, temp, insert.stmt, 5, text.tags);
          if (sqlite3_step(insert.stmt) != SQLITE_DONE) fail_io(kFn, temp + ": " + db.message());
          sqlite3_reset(insert.stmt);
        }
      }
      exec(kFn, db, temp, "COMMIT");
      // One b-tree instead of one per flushed segment: fewer lookups per query.
      exec(kFn, db, temp, "INSERT INTO docs(docs) VALUES ('optimize')");
      write_postings(kFn, db.db, temp, static_cast<int64_t>(packages.size()));
      exec(kFn, db, temp, "VACUUM");
      if (sqlite3_close(db.db) != SQLITE_OK) fail_io(kFn, temp + ": " + db.message());
      db.db = nullptr;
    }
    ::chmod(
        temp.c_str(), 0666 & ~[] {
          const mode_t mask = ::umask(0);
          ::umask(mask);
          return mask;
        }());
    fsync_path(temp, O_RDONLY);
    // RENAME_NOREPLACE: a file made at `path` meanwhile is never replaced.
    if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0) {
      const int error = errno;
      if (error == EEXIST) fail(kFn, path + ": already exists; a new database needs a new path");
      fail_io(kFn, path + ": cannot rename the finished database into place: " + errno_text(error));
    }
    fsync_path(parent.string(), O_RDONLY | O_DIRECTORY);
  } catch (...) {
    ::unlink(temp.c_str());
    ::unlink((temp + "-journal").c_str());
    throw;
  }
}

Bm25::Bm25(const std::string& path) {
  constexpr std::string_view kFn = "Bm25";
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    fail(kFn, "cannot open the BM25 database " + path + ": " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail(kFn, "the BM25 database " + path + " is not a regular file");
  Db db;
  if (sqlite3_open_v2(path.c_str(), &db.db, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK)
    fail(kFn, "cannot open the BM25 database " + path + ": " + db.message());
  // The file is ours if it holds our format marker and the docs table; any
  // SQLite error on the way (not a database, damaged) says it is not.
  const std::string not_ours = path + " is not a BM25 database of qkv search";
  {
    Statement check;
    if (sqlite3_prepare_v2(db.db, "SELECT value FROM qkv_bm25 WHERE key = 'format'", -1,
                           &check.stmt, nullptr) != SQLITE_OK)
      fail(kFn, not_ours + ": " + db.message());
    if (sqlite3_step(check.stmt) != SQLITE_ROW) fail(kFn, not_ours + ": it has no format marker");
    const unsigned char* format = sqlite3_column_text(check.stmt, 0);
    if (format == nullptr || std::string(reinterpret_cast<const char*>(format)) != kFormat)
      fail(kFn, not_ours + ": its format is not \"" + kFormat + "\"");
  }
  {
    Statement check;
    if (sqlite3_prepare_v2(db.db,
                           "SELECT sql FROM sqlite_schema WHERE name = 'docs' AND type = 'table'",
                           -1, &check.stmt, nullptr) != SQLITE_OK ||
        sqlite3_step(check.stmt) != SQLITE_ROW)
      fail(kFn, not_ours + ": it has no docs table");
    const unsigned char* sql = sqlite3_column_text(check.stmt, 0);
    if (sql == nullptr || std::strstr(reinterpret_cast<const char*>(sql), "USING fts5") == nullptr)
      fail(kFn, not_ours + ": its docs table is not an FTS5 table");
  }
  // The queries prepared once here check the tables' columns too.
  for (const char* sql : {kQuery, kPostings}) {
    Statement query;
    if (sqlite3_prepare_v2(db.db, sql, -1, &query.stmt, nullptr) != SQLITE_OK)
      fail(kFn, not_ours + ": " + db.message());
  }
  {
    Statement meta;
    int64_t documents = -1;
    if (sqlite3_prepare_v2(db.db, "SELECT value FROM qkv_bm25 WHERE key = 'documents'", -1,
                           &meta.stmt, nullptr) == SQLITE_OK &&
        sqlite3_step(meta.stmt) == SQLITE_ROW)
      documents = sqlite3_column_int64(meta.stmt, 0);
    if (documents < 0) fail(kFn, not_ours + ": it has no document count");
    Statement lengths;
    if (sqlite3_prepare_v2(db.db, "SELECT value FROM qkv_bm25 WHERE key = 'doc_tokens'", -1,
                           &lengths.stmt, nullptr) != SQLITE_OK ||
        sqlite3_step(lengths.stmt) != SQLITE_ROW)
      fail(kFn, not_ours + ": it has no document lengths");
    const auto* bytes = static_cast<const unsigned char*>(sqlite3_column_blob(lengths.stmt, 0));
    const int64_t size = sqlite3_column_bytes(lengths.stmt, 0);
    if (size != 4 * documents)
      fail(kFn, path + " is damaged: its document lengths are " + std::to_string(size) +
                    " bytes for " + std::to_string(documents) + " documents");
    std::vector<uint32_t> doc_tokens(static_cast<size_t>(documents));
    uint64_t total = 0;
    for (size_t i = 0; i < doc_tokens.size(); ++i) {
      doc_tokens[i] = static_cast<uint32_t>(bytes[4 * i]) |
                      static_cast<uint32_t>(bytes[4 * i + 1]) << 8 |
                      static_cast<uint32_t>(bytes[4 * i + 2]) << 16 |
                      static_cast<uint32_t>(bytes[4 * i + 3]) << 24;
      total += doc_tokens[i];
    }
    // As fts5Bm25GetData: avgdl = (double)nToken / (double)nRow; and the
    // length term as fts5Bm25Function writes it (the same operations, so
    // the same bits, computed once per document instead of once per posting).
    const double avgdl =
        static_cast<double>(total) / static_cast<double>(std::max<int64_t>(documents, 1));
    length_norm_.resize(doc_tokens.size());
    for (size_t i = 0; i < doc_tokens.size(); ++i) {
      const double length = doc_tokens[i];
      length_norm_[i] = kK1 * (1 - kB + kB * length / avgdl);
    }
  }
  // Postings blobs span overflow pages: read through a mapping, not a pread
  // per 4 KiB page (median query 1.8 -> 0.X ms over the ~63,000 packages).
  sqlite3_exec(db.db, "PRAGMA mmap_size = 4294967296", nullptr, nullptr, nullptr);
  db_ = db.db;
  db.db = nullptr;
}

Bm25::~Bm25() {
  if (db_ != nullptr) sqlite3_close_v2(db_);
}

std::vector<Hit> Bm25::search(std::string_view query, int64_t k) const {
  constexpr std::string_view kFn = "Bm25::search";
  if (k < 0) fail(kFn, "k is " + std::to_string(k) + "; expected k >= 0");
  std::vector<Hit> hits;
  const std::vector<std::string> terms = query_terms(query);
  const int64_t documents = static_cast<int64_t>(length_norm_.size());
  if (terms.empty() || k == 0 || documents == 0) return hits;
  // FTS5's bm25() for every document holding a term, term by term in the
  // query's order, each the same expression in the same order of operations
  // as fts5Bm25Function's (a term a document lacks adds 0.0 there), so the
  // scores are FTS5's to the bit. A document that holds a term scores > 0
  // (IDF >= 1e-6): the matches are the positive scores.
  std::vector<double> scores(static_cast<size_t>(documents), 0.0);
  Statement stmt;
  if (sqlite3_prepare_v2(db_, kPostings, -1, &stmt.stmt, nullptr) != SQLITE_OK)
    fail_io(kFn, sqlite3_errmsg(db_));
  for (const std::string& term : terms) {
    sqlite3_reset(stmt.stmt);
    if (sqlite3_bind_text(stmt.stmt, 1, term.data(), static_cast<int>(term.size()),
                          SQLITE_STATIC) != SQLITE_OK)
      fail_io(kFn, sqlite3_errmsg(db_));
    const int rc = sqlite3_step(stmt.stmt);
    if (rc == SQLITE_DONE) continue;  // in no document
    if (rc != SQLITE_ROW) fail_io(kFn, "term \"" + term + "\": " + sqlite3_errmsg(db_));
    const auto* p = static_cast<const unsigned char*>(sqlite3_column_blob(stmt.stmt, 0));
    const unsigned char* end = p + sqlite3_column_bytes(stmt.stmt, 0);
    const int64_t hit_count = sqlite3_column_int64(stmt.stmt, 1);
    // As fts5Bm25GetData: log((nRow - nHit + 0.5) / (nHit + 0.5)), at least 1e-6.
    double idf = std::log((static_cast<double>(documents - hit_count) + 0.5) /
                          (static_cast<double>(hit_count) + 0.5));
    if (idf <= 0.0) idf = 1e-6;
    const bool whole =
        for_each_posting(p, end, hit_count, documents, [&](size_t doc, uint64_t count) {
          const double freq = static_cast<double>(count);
          scores[doc] += idf * ((freq * (kK1 + 1.0)) / (freq + length_norm_[doc]));
        });
    if (!whole) {
      fail(kFn, "the postings of \"" + term + "\" are damaged (" + std::to_string(hit_count) +
                    " documents said; build the index again)");
    }
  }
  // The k best by a bounded heap (worst on top): most matches of a common
  // word lose one comparison against the k-th best and are never stored.
  const auto better = [](const Hit& x, const Hit& y) {
    return x.score > y.score || (x.score == y.score && x.doc < y.doc);
  };
  for (int64_t doc = 0; doc < documents; ++doc) {
    const double score = scores[static_cast<size_t>(doc)];
    if (!(score > 0.0)) continue;
    if (static_cast<int64_t>(hits.size()) < k) {
      hits.push_back({doc, score});
      std::push_heap(hits.begin(), hits.end(), better);
    } else if (score > hits.front().score) {  // a later doc never wins a tie
      std::pop_heap(hits.begin(), hits.end(), better);
      hits.back() = {doc, score};
      std::push_heap(hits.begin(), hits.end(), better);
    }
  }
  std::sort_heap(hits.begin(), hits.end(), better);
  return hits;
}

bool Bm25::has_word(std::string_view word) const {
  constexpr std::string_view kFn = "Bm25::has_word";
  Statement stmt;
  if (sqlite3_prepare_v2(db_, "SELECT 1 FROM qkv_postings WHERE term = ?1", -1, &stmt.stmt,
                         nullptr) != SQLITE_OK)
    fail_io(kFn, sqlite3_errmsg(db_));
  for (const std::string& term : query_terms(word)) {
    sqlite3_reset(stmt.stmt);
    if (sqlite3_bind_text(stmt.stmt, 1, term.data(), static_cast<int>(term.size()),
                          SQLITE_STATIC) != SQLITE_OK)
      fail_io(kFn, sqlite3_errmsg(db_));
    const int rc = sqlite3_step(stmt.stmt);
    if (rc == SQLITE_ROW) return true;
    if (rc != SQLITE_DONE) fail_io(kFn, "term \"" + term + "\": " + sqlite3_errmsg(db_));
  }
  return false;
}

std::vector<Hit> Bm25::search_fts5(std::string_view query, int64_t k) const {
  constexpr std::string_view kFn = "Bm25::search_fts5";
  if (k < 0) fail(kFn, "k is " + std::to_string(k) + "; expected k >= 0");
  std::vector<Hit> hits;
  const std::string expr = match_expression(query_terms(query));
  if (expr.empty() || k == 0) return hits;
  // Prepared per call (a few microseconds): search stays const and safe to
  // call from several threads on one Bm25 (SQLite's serialized mode).
  Statement stmt;
  if (sqlite3_prepare_v2(db_, kQuery, -1, &stmt.stmt, nullptr) != SQLITE_OK ||
      sqlite3_bind_text(stmt.stmt, 1, expr.data(), static_cast<int>(expr.size()), SQLITE_STATIC) !=
          SQLITE_OK ||
      sqlite3_bind_int64(stmt.stmt, 2, k) != SQLITE_OK)
    fail_io(kFn, sqlite3_errmsg(db_));
  int rc;
  while ((rc = sqlite3_step(stmt.stmt)) == SQLITE_ROW) {
    hits.push_back({sqlite3_column_int64(stmt.stmt, 0) - 1, -sqlite3_column_double(stmt.stmt, 1)});
  }
  if (rc != SQLITE_DONE) fail_io(kFn, "query " + expr + ": " + sqlite3_errmsg(db_));
  return hits;
}

int64_t Bm25::size() const {
  Statement count;
  if (sqlite3_prepare_v2(db_, "SELECT value FROM qkv_bm25 WHERE key = 'documents'", -1, &count.stmt,
                         nullptr) != SQLITE_OK ||
      sqlite3_step(count.stmt) != SQLITE_ROW)
    fail_io("Bm25::size", sqlite3_errmsg(db_));
  return sqlite3_column_int64(count.stmt, 0);
}

}  // namespace qkv::search

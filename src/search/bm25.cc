// The BM25 baseline: an SQLite FTS5 table of the documents (built into a
// temporary file beside the destination and renamed into place), queried by a
// prepared statement that ranks by FTS5's bm25().
#include "search/bm25.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <unordered_set>

#include "qkv/error.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;

// The table every query reads, and a small table that says the file is ours
// (its format string is checked by the constructor).
constexpr const char* kSchema =
    "CREATE TABLE qkv_bm25(key TEXT PRIMARY KEY, value) WITHOUT ROWID;"
    "CREATE VIRTUAL TABLE docs USING fts5(name, description, section, tags,"
    " tokenize = 'unicode61');";
constexpr const char* kFormat = "qkv-search-bm25 1";
constexpr const char* kQuery =
    "SELECT rowid, bm25(docs) FROM docs WHERE docs MATCH ?1"
    " ORDER BY bm25(docs), rowid LIMIT ?2";

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

// The FTS5 expression for free text: its words() cut at '+' (unicode61
// separates there: "c++" is the token "c", "a+b" the tokens "a" and "b"), each
// distinct piece once (first occurrence order, so "c c++" does not count "c"
// twice in bm25's sum over phrases), each a quoted string, joined by OR. FTS5
// interprets nothing inside a string: "and", "near", "*" and "-" are plain
// words. Empty when the text has no words.
std::string match_expression(std::string_view query) {
  std::string expr;
  std::unordered_set<std::string> seen;
  for (const std::string& word : words(query)) {
    size_t start = 0;
    while (start < word.size()) {
      size_t end = word.find('+', start);
      if (end == std::string::npos) end = word.size();
      std::string piece = word.substr(start, end - start);
      start = end + 1;
      // words() gives [a-z0-9+] only: nothing to escape inside the quotes.
      if (piece.empty() || !seen.insert(piece).second) continue;
      if (!expr.empty()) expr += " OR ";
      expr.append("\"").append(piece).append("\"");
    }
  }
  return expr;
}

void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
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
  // The query prepared once here checks the FTS5 table's columns too.
  Statement query;
  if (sqlite3_prepare_v2(db.db, kQuery, -1, &query.stmt, nullptr) != SQLITE_OK)
    fail(kFn, not_ours + ": " + db.message());
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
  const std::string expr = match_expression(query);
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

// qkv search's BM25 baseline (SQLite FTS5): scores and ranking held to a plain
// float64 loop over FTS5's documented formula (fts5_aux.c, fts5Bm25Function:
// k1 = 1.2, b = 0.75, IDF = ln((N - n + 0.5) / (n + 0.5)) floored at 1e-6,
// phrase frequency summed over the columns with weight 1, document length the
// tokens of all columns), on a hand-made corpus and on the fixture lists;
// query quoting, errors, atomic build.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "search/bm25.h"
#include "search/corpus.h"
#include "search_testing.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;
using testing::kFixture;

using testing::TempDir;

using testing::contains;
using testing::error_of;

// ---- the reference: FTS5's bm25 as plain loops in double ------------------------

// unicode61's tokens for the text this suite uses: lower-cased runs of ASCII
// letters and digits and of the non-ASCII characters U+00C0-U+024F (but for
// U+00D7, U+00F7) and U+0370-U+052F (letters there; make_fixture.py keeps only
// packages whose other non-ASCII characters are separators for unicode61).
// Non-ASCII tokens are kept as bytes (unicode61 folds diacritics; the queries
// here have no such words, so only the counts matter).
std::vector<std::string> ref_tokens(const std::string& text) {
  std::vector<std::string> tokens;
  std::string token;
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    uint32_t cp = c;
    size_t len = 1;
    if (c >= 0xF0) {
      len = 4;
    } else if (c >= 0xE0) {
      len = 3;
    } else if (c >= 0xC0) {
      len = 2;
    }
    if (len > 1) {
      cp = c & (0x7F >> len);
      for (size_t j = 1; j < len && i + j < text.size(); ++j)
        cp = (cp << 6) | (static_cast<unsigned char>(text[i + j]) & 0x3F);
    }
    const bool ascii_word = std::isalnum(c) != 0 && c < 0x80;
    const bool other_word = cp >= 0x80 && ((cp >= 0xC0 && cp < 0x250 && cp != 0xD7 && cp != 0xF7) ||
                                           (cp >= 0x370 && cp < 0x530));
    if (ascii_word) {
      token += static_cast<char>(std::tolower(c));
    } else if (other_word) {
      token.append(text, i, len);
    } else if (!token.empty()) {
      tokens.push_back(token);
      token.clear();
    }
    i += len;
  }
  if (!token.empty()) tokens.push_back(token);
  return tokens;
}

struct RefHit {
  int64_t doc;
  double score;
};

// Every document sharing a token with the query, best first (ties: smaller
// doc). The query's phrases are its distinct tokens, each counted once.
std::vector<RefHit> ref_bm25(const std::vector<std::vector<std::string>>& columns_text,
                             const std::string& query) {
  const double k1 = 1.2, b = 0.75;
  const size_t n_docs = columns_text.size();
  std::vector<std::vector<std::string>> docs(n_docs);
  double total = 0;
  for (size_t d = 0; d < n_docs; ++d) {
    for (const std::string& column : columns_text[d])
      for (const std::string& t : ref_tokens(column)) docs[d].push_back(t);
    total += static_cast<double>(docs[d].size());
  }
  const double avgdl = total / static_cast<double>(n_docs);
  std::vector<std::string> phrases;
  for (const std::string& t : ref_tokens(query))
    if (std::find(phrases.begin(), phrases.end(), t) == phrases.end()) phrases.push_back(t);
  std::vector<double> idf;
  for (const std::string& p : phrases) {
    double hits = 0;
    for (const auto& doc : docs) hits += std::find(doc.begin(), doc.end(), p) != doc.end() ? 1 : 0;
    double value = std::log((static_cast<double>(n_docs) - hits + 0.5) / (hits + 0.5));
    if (value <= 0.0) value = 1e-6;
    idf.push_back(value);
  }
  std::vector<RefHit> out;
  for (size_t d = 0; d < n_docs; ++d) {
    double score = 0;
    bool match = false;
    const double length = static_cast<double>(docs[d].size());
    for (size_t i = 0; i < phrases.size(); ++i) {
      const double f = static_cast<double>(std::count(docs[d].begin(), docs[d].end(), phrases[i]));
      if (f > 0) match = true;
      score += idf[i] * (f * (k1 + 1.0)) / (f + k1 * (1 - b + b * length / avgdl));
    }
    if (match) out.push_back({static_cast<int64_t>(d), score});
  }
  std::stable_sort(out.begin(), out.end(), [](const RefHit& x, const RefHit& y) {
    return x.score > y.score || (x.score == y.score && x.doc < y.doc);
  });
  return out;
}

std::vector<std::vector<std::string>> columns_of(const std::vector<Package>& packages) {
  std::vector<std::vector<std::string>> out;
  for (const Package& p : packages) {
    const DocumentText t = document_text(p);
    out.push_back({t.name, t.description, t.section, t.tags});
  }
  return out;
}

// Holds `got` (the first k of the ranking) to the reference: every hit's
// score, and its doc wherever the reference's neighbours' scores differ from
// its own by more than rounding (the order of near-equal scores may differ
// in the last bit).
void expect_matches_reference(const std::vector<Hit>& got, const std::vector<RefHit>& ref,
                              int64_t k, const std::string& query) {
  SCOPED_TRACE("query \"" + query + "\"");
  const size_t n = std::min(ref.size(), static_cast<size_t>(k));
  ASSERT_EQ(got.size(), n);
  std::map<int64_t, double> ref_score;
  for (const RefHit& h : ref) ref_score[h.doc] = h.score;
  for (size_t i = 0; i < n; ++i) {
    const double tol = 1e-12 * std::max(1.0, std::abs(ref[i].score));
    EXPECT_NEAR(got[i].score, ref[i].score, tol) << "rank " << i;
    ASSERT_TRUE(ref_score.count(got[i].doc))
        << "rank " << i << ": doc " << got[i].doc << " matches nothing";
    EXPECT_NEAR(got[i].score, ref_score[got[i].doc], tol) << "rank " << i << " doc " << got[i].doc;
    const bool near_prev = i > 0 && std::abs(ref[i - 1].score - ref[i].score) <= tol &&
                           ref[i - 1].score != ref[i].score;
    const bool near_next = i + 1 < ref.size() && std::abs(ref[i + 1].score - ref[i].score) <= tol &&
                           ref[i + 1].score != ref[i].score;
    if (!near_prev && !near_next) EXPECT_EQ(got[i].doc, ref[i].doc) << "rank " << i;
    if (i > 0) {
      EXPECT_TRUE(got[i - 1].score > got[i].score ||
                  (got[i - 1].score == got[i].score && got[i - 1].doc < got[i].doc))
          << "rank " << i << " out of order";
    }
  }
}

// search() (postings scored in C++) against search_fts5() (FTS5's bm25()):
// the same documents in the same order with the same scores, to the bit.
void expect_same_as_fts5(const Bm25& bm25, const std::string& query, int64_t k) {
  SCOPED_TRACE("query \"" + query + "\" k " + std::to_string(k));
  const std::vector<Hit> fast = bm25.search(query, k);
  const std::vector<Hit> fts5 = bm25.search_fts5(query, k);
  ASSERT_EQ(fast.size(), fts5.size());
  for (size_t i = 0; i < fast.size(); ++i) {
    EXPECT_EQ(fast[i].doc, fts5[i].doc) << "rank " << i;
    EXPECT_EQ(fast[i].score, fts5[i].score) << "rank " << i;
  }
}

Package package(const std::string& name, const std::string& description,
                const std::string& section = "", std::vector<std::string> tags = {}) {
  Package p;
  p.name = name;
  p.short_description = "never indexed " + name;
  p.long_description = description;
  p.section = section;
  p.tags = std::move(tags);
  return p;
}

// ---- tests -----------------------------------------------------------------------

TEST(Bm25, HandMadeCorpusMatchesTheFormula) {
  // Lengths from 1 to ~20 tokens, a word repeated in one document, words
  // across columns, one word ("data") in more than half the documents (IDF
  // floored at 1e-6), "c++" (unicode61: "c").
  const std::vector<Package> packages = {
      package("plotter", "plot data plot data plot", "math", {"field::mathematics"}),
      package("db", "an embedded sql database engine for data", "database", {"role::program"}),
      package("zip", "fast data compression", "utils"),
      package("cc", "the gnu c++ compiler for c and c++ code", "devel", {"implemented-in::c++"}),
      package("x", ""),
      package("longdoc",
              "data data data long long long long long long long long long long long long "
              "long plot words words words",
              "misc"),
      package("data-tools", "data", "contrib/utils")};
  TempDir dir;
  const std::string path = dir.file("bm25.sqlite");
  Bm25::build(path, packages);
  const Bm25 bm25(path);
  EXPECT_EQ(bm25.size(), 7);
  const auto columns = columns_of(packages);
  for (const std::string query :
       {"plot", "data", "plot data", "Plot, DATA and plot!", "c++", "compiler c", "sql database",
        "long words", "misc utils", "mathematics program", "nothing here", "x", "zip fast",
        "c c++ C", "a+b c+d", "data data data"}) {
    for (const int64_t k : {1, 3, 100}) {
      expect_matches_reference(bm25.search(query, k), ref_bm25(columns, query), k, query);
      expect_matches_reference(bm25.search_fts5(query, k), ref_bm25(columns, query), k, query);
      expect_same_as_fts5(bm25, query, k);
    }
  }
  // By hand for one case: "x" is in one of the 7 documents (the 5th, one
  // token long); the documents' tokens 9 + 11 + 5 + 14 + 1 + 22 + 6 = 68
  // ("data-tools data tools" is 4 tokens).
  const std::vector<Hit> x = bm25.search("x", 10);
  ASSERT_EQ(x.size(), 1u);
  EXPECT_EQ(x[0].doc, 4);
  EXPECT_NEAR(x[0].score, std::log(6.5 / 1.5) * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 1.0 / (68.0 / 7))),
              1e-12);
}

TEST(Bm25, FixtureQueriesMatchTheFormula) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  TempDir dir;
  const std::string path = dir.file("bm25.sqlite");
  Bm25::build(path, packages);
  const Bm25 bm25(path);
  ASSERT_EQ(bm25.size(), static_cast<int64_t>(packages.size()));
  const auto columns = columns_of(packages);
  for (const std::string query :
       {"gnuplot", "interactive plotting program", "fast compression library",
        "python numerical arrays", "secure shell client", "the", "c++ compiler", "g++ gcc c++ c",
        "sql database engine", "text editor", "Java library for JPEG images",
        "statistics computing"}) {
    const std::vector<RefHit> ref = ref_bm25(columns, query);
    for (const int64_t k : {10, 1000}) {
      expect_matches_reference(bm25.search(query, k), ref, k, query);
      expect_matches_reference(bm25.search_fts5(query, k), ref, k, query);
      expect_same_as_fts5(bm25, query, k);
    }
  }
}

TEST(Bm25, EveryFixtureShortDescriptionRanksAsFts5Does) {
  // The held-out queries of qkv search eval are short descriptions: each of
  // the fixture's, through both paths.
  const std::vector<Package> packages = read_apt_lists(kFixture);
  TempDir dir;
  Bm25::build(dir.file("bm25.sqlite"), packages);
  const Bm25 bm25(dir.file("bm25.sqlite"));
  int64_t found = 0;
  for (size_t i = 0; i < packages.size(); ++i) {
    expect_same_as_fts5(bm25, packages[i].short_description, 10);
    const std::vector<Hit> hits = bm25.search(packages[i].short_description, 10);
    for (const Hit& h : hits) found += h.doc == static_cast<int64_t>(i);
  }
  // Most packages are found by their own short description (its words are
  // mostly in the long one); not a tight bound, a sanity check.
  EXPECT_GT(found, static_cast<int64_t>(packages.size()) / 2);
}

TEST(Bm25, GnuplotRanksGnuplotPackagesFirst) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  TempDir dir;
  Bm25::build(dir.file("bm25.sqlite"), packages);
  const Bm25 bm25(dir.file("bm25.sqlite"));
  const std::vector<Hit> hits = bm25.search("gnuplot", 10);
  ASSERT_GE(hits.size(), 6u);
  // The fixture's six gnuplot packages come first.
  std::set<std::string> top;
  for (size_t i = 0; i < 6; ++i) top.insert(packages[hits[i].doc].name);
  EXPECT_EQ(top, (std::set<std::string>{"gnuplot", "gnuplot-data", "gnuplot-doc", "gnuplot-nox",
                                        "gnuplot-qt", "gnuplot-x11"}));
  for (size_t i = 1; i < hits.size(); ++i) EXPECT_GE(hits[i - 1].score, hits[i].score);
  EXPECT_GT(hits[0].score, 0);
  // has_word: exactly the words search() finds a document for.
  for (const char* word : {"gnuplot", "GNUPLOT", "plotting", "gnuplt", "qqqzzz", "the", "c++"}) {
    EXPECT_EQ(bm25.has_word(word), !bm25.search(word, 1).empty()) << word;
  }
  EXPECT_TRUE(bm25.has_word("gnuplot"));
  EXPECT_FALSE(bm25.has_word("gnuplt"));
}

TEST(Bm25, QuerySyntaxIsNeverInterpreted) {
  const std::vector<Package> packages = {package("alpha", "near and or not words"),
                                         package("beta", "plain words"), package("gamma", "other")};
  TempDir dir;
  Bm25::build(dir.file("bm25.sqlite"), packages);
  const Bm25 bm25(dir.file("bm25.sqlite"));
  for (const std::string query : {"\"",
                                  "\"unbalanced",
                                  "word*",
                                  "*",
                                  "NEAR(alpha beta)",
                                  "NEAR(",
                                  "-alpha",
                                  "alpha AND beta",
                                  "AND",
                                  "OR",
                                  "NOT",
                                  "alpha NOT beta",
                                  "^alpha",
                                  "name:alpha",
                                  "{name tags}: alpha",
                                  "(alpha",
                                  "alpha)",
                                  "a + b",
                                  "'",
                                  "''",
                                  "\\",
                                  ";DROP TABLE docs;",
                                  "\"\"\"\""}) {
    SCOPED_TRACE(query);
    EXPECT_NO_THROW(bm25.search(query, 10));
    EXPECT_NO_THROW(bm25.search_fts5(query, 10));
    expect_same_as_fts5(bm25, query, 10);
  }
  // "alpha AND beta" is three words OR-ed: both documents (and "and" in alpha's).
  std::vector<Hit> hits = bm25.search("alpha AND beta", 10);
  ASSERT_EQ(hits.size(), 2u);
  EXPECT_EQ(hits[0].doc, 0);  // "alpha" and "and"
  EXPECT_EQ(hits[1].doc, 1);
  // NEAR and NOT are words of alpha's description, not operators.
  hits = bm25.search("NEAR(", 10);
  ASSERT_EQ(hits.size(), 1u);
  EXPECT_EQ(hits[0].doc, 0);
  hits = bm25.search("-gamma", 10);  // not a negation
  ASSERT_EQ(hits.size(), 1u);
  EXPECT_EQ(hits[0].doc, 2);
}

TEST(Bm25, EmptyQueriesAndSmallK) {
  const std::vector<Package> packages = {package("alpha", "words"), package("beta", "words")};
  TempDir dir;
  Bm25::build(dir.file("bm25.sqlite"), packages);
  const Bm25 bm25(dir.file("bm25.sqlite"));
  EXPECT_TRUE(bm25.search("", 10).empty());
  EXPECT_TRUE(bm25.search("  ,.;!? \xe2\x80\x94 ", 10).empty());
  EXPECT_TRUE(bm25.search("words", 0).empty());
  EXPECT_TRUE(bm25.search("absent", 10).empty());
  // Equal scores: smaller doc first.
  const std::vector<Hit> hits = bm25.search("words", 10);
  ASSERT_EQ(hits.size(), 2u);
  EXPECT_EQ(hits[0].doc, 0);
  EXPECT_EQ(hits[1].doc, 1);
  EXPECT_EQ(hits[0].score, hits[1].score);
  EXPECT_EQ(bm25.search("words", 1).size(), 1u);
  EXPECT_THROW(bm25.search("words", -1), Error);
}

TEST(Bm25, EmptyCorpus) {
  TempDir dir;
  Bm25::build(dir.file("bm25.sqlite"), {});
  const Bm25 bm25(dir.file("bm25.sqlite"));
  EXPECT_EQ(bm25.size(), 0);
  EXPECT_TRUE(bm25.search("anything", 10).empty());
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}
std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Bm25, OpeningWhatIsNotOursIsAnErrorNamingTheFile) {
  TempDir dir;
  std::string message = error_of([&] { Bm25 bm25(dir.file("missing.sqlite")); });
  EXPECT_TRUE(contains(message, dir.file("missing.sqlite"))) << message;
  EXPECT_TRUE(contains(message, "Bm25")) << message;

  message = error_of([&] { Bm25 bm25(dir.file("")); });  // a directory
  EXPECT_FALSE(message.empty());

  write_file(dir.file("garbage"), std::string(4096, 'x'));
  message = error_of([&] { Bm25 bm25(dir.file("garbage")); });
  EXPECT_TRUE(contains(message, dir.file("garbage") + " is not a BM25 database")) << message;

  write_file(dir.file("empty"), "");
  message = error_of([&] { Bm25 bm25(dir.file("empty")); });
  EXPECT_TRUE(contains(message, dir.file("empty") + " is not a BM25 database")) << message;

  // SQLite databases of other shapes: a plain table named docs; an FTS5
  // table without our marker; our marker over a plain docs table.
  const auto make = [&](const std::string& name, const char* sql) {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(dir.file(name).c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, sql, nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    sqlite3_close(db);
  };
  make("plain.sqlite", "CREATE TABLE docs(name, description); INSERT INTO docs VALUES ('a', 'b');");
  make("fts5.sqlite", "CREATE VIRTUAL TABLE docs USING fts5(name, description, section, tags);");
  make("marker.sqlite",
       "CREATE TABLE qkv_bm25(key TEXT PRIMARY KEY, value) WITHOUT ROWID;"
       "INSERT INTO qkv_bm25 VALUES ('format', 'qkv-search-bm25 1'), ('documents', 0);"
       "CREATE TABLE docs(name, description, section, tags);");
  make("format.sqlite",
       "CREATE TABLE qkv_bm25(key TEXT PRIMARY KEY, value) WITHOUT ROWID;"
       "INSERT INTO qkv_bm25 VALUES ('format', 'qkv-search-bm25 99');"
       "CREATE VIRTUAL TABLE docs USING fts5(name, description, section, tags);");
  for (const std::string name : {"plain.sqlite", "fts5.sqlite", "marker.sqlite", "format.sqlite"}) {
    message = error_of([&] { Bm25 bm25(dir.file(name)); });
    EXPECT_TRUE(contains(message, dir.file(name) + " is not a BM25 database of qkv search"))
        << message;
  }
  // Opening read-only changed nothing (no journal, no WAL files).
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"empty", "format.sqlite", "fts5.sqlite",
                                                     "garbage", "marker.sqlite", "plain.sqlite"}));
}

TEST(Bm25, DamagedPostingsAreErrors) {
  TempDir dir;
  const std::vector<Package> packages = {package("alpha", "words here"), package("beta", "words")};
  const auto build_and = [&](const std::string& name, const char* sql) {
    Bm25::build(dir.file(name), packages);
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(dir.file(name).c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, sql, nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    sqlite3_close(db);
  };
  build_and("lengths.sqlite", "UPDATE qkv_bm25 SET value = x'0100' WHERE key = 'doc_tokens'");
  std::string message = error_of([&] { Bm25 bm25(dir.file("lengths.sqlite")); });
  EXPECT_TRUE(contains(message, dir.file("lengths.sqlite") + " is damaged")) << message;

  // A gap past the last document; a count of documents that disagrees.
  build_and("gap.sqlite", "UPDATE qkv_postings SET postings = x'0901' WHERE term = 'words'");
  build_and("count.sqlite", "UPDATE qkv_postings SET documents = 1 WHERE term = 'words'");
  build_and("cut.sqlite", "UPDATE qkv_postings SET postings = x'81' WHERE term = 'words'");
  for (const char* name : {"gap.sqlite", "count.sqlite", "cut.sqlite"}) {
    const Bm25 bm25(dir.file(name));
    EXPECT_EQ(bm25.search("alpha", 5).size(), 1u) << name;  // other terms still answer
    message = error_of([&] { bm25.search("here words", 5); });
    EXPECT_TRUE(contains(message, "the postings of \"words\" are damaged"))
        << name << ": " << message;
  }
}

TEST(Bm25, BuildOverAnExistingPathFailsAndLeavesIt) {
  TempDir dir;
  const std::string path = dir.file("bm25.sqlite");
  write_file(path, "precious");
  const std::string message = error_of([&] { Bm25::build(path, {package("a", "b")}); });
  EXPECT_TRUE(contains(message, path)) << message;
  EXPECT_TRUE(contains(message, "already exists")) << message;
  EXPECT_EQ(read_file(path), "precious");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"bm25.sqlite"});  // no temporary left

  // A database built once; a second build to it fails and leaves it working.
  const std::string db = dir.file("db.sqlite");
  Bm25::build(db, {package("alpha", "words")});
  EXPECT_THROW(Bm25::build(db, {package("beta", "words")}), Error);
  const Bm25 bm25(db);
  ASSERT_EQ(bm25.search("alpha", 5).size(), 1u);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"bm25.sqlite", "db.sqlite"}));

  // Into a missing directory: an error naming the path.
  EXPECT_THROW(Bm25::build(dir.file("no/such/dir.sqlite"), {}), std::exception);
}

}  // namespace
}  // namespace qkv::search

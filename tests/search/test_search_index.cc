// qkv search's index (index.h) on the fixture lists with a small random
// BERT written here (tiny_bert.h; its vocabulary letters and digits, so
// every word is spelled out): build, open, the three engines, the learned
// engine's weights against a float64 softmax over the stored documents, a
// package named by the query first, eval, verify finding a changed byte in
// every file open() does not read, and build's errors; the split and the
// metrics. The real encoder's index is tested through the command
// (tests/cli/test_search.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "qkv/store.h"
#include "search/corpus.h"
#include "search/index.h"
#include "search/metrics.h"
#include "search/search_testing.h"
#include "search/tiny_bert.h"
#include "test_util.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using testing::kFixture;
using testing::TempDir;
using testing::TinyBert;

// A BERT whose vocabulary is the letters and digits, alone and as
// continuations ("##a"), so the tokenizer spells every word of the fixture.
TinyBert spelling_bert(uint64_t seed) {
  std::vector<std::string> words;
  for (const std::string prefix : {"", "##"}) {
    for (char c = 'a'; c <= 'z'; ++c) words.push_back(prefix + c);
    for (char c = '0'; c <= '9'; ++c) words.push_back(prefix + c);
  }
  TinyBert bert(seed, words, 64);
  return bert;
}

IndexOptions small_options(const std::string& model) {
  IndexOptions o;
  o.model = model;
  o.document_tokens = 48;
  o.head.epochs = 3;
  o.head.batch = 64;
  return o;
}

void flip_middle_byte(const std::string& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto middle = static_cast<std::streamoff>(fs::file_size(file) / 2);
  f.seekg(middle);
  const char old = static_cast<char>(f.get());
  f.seekp(middle);
  f.put(static_cast<char>(old ^ 0x20));
}

TEST(SearchSplit, OneInTenHeldOutByNameAlone) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  int64_t test = 0, validation = 0;
  for (const Package& p : packages) {
    test += split_of(p.name) == Split::kTest;
    validation += split_of(p.name) == Split::kValidation;
    EXPECT_EQ(held_out(p.name), split_of(p.name) == Split::kTest);
    EXPECT_EQ(split_of(p.name), split_of(std::string(p.name)));
  }
  // 274 packages: about 27 test and 14 validation names.
  EXPECT_GT(test, 10);
  EXPECT_LT(test, 50);
  EXPECT_GT(validation, 3);
  EXPECT_LT(validation, 30);
}

TEST(SearchMetrics, RanksCount) {
  MetricsSum m;
  m.add({7, 3, 9}, 7);                             // rank 1
  m.add({1, 2, 3, 4}, 4);                          // rank 4
  m.add({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, 11);  // past 10
  m.add({}, 3);                                    // not found
  const Metrics r = m.metrics();
  EXPECT_EQ(r.queries, 4);
  EXPECT_DOUBLE_EQ(r.mrr_at_10, (1.0 + 0.25) / 4);
  EXPECT_DOUBLE_EQ(r.recall_at_1, 0.25);
  EXPECT_DOUBLE_EQ(r.recall_at_10, 0.5);
}

// One index of the fixture for the suite (about a second to build).
class SearchIndexTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new TempDir;
    tmp_ = new TempDir;
    const TinyBert bert = spelling_bert(test::test_seed());
    bert.write(*model_, bert.config());
    packages_ = new std::vector<Package>(read_apt_lists(kFixture));
    stages_ = new std::vector<std::pair<std::string, int64_t>>;
    SearchIndex::build(index_dir(), *packages_, small_options(model_->path()),
                       [&](std::string_view what, int64_t done, int64_t total) {
                         if (stages_->empty() || stages_->back().first != what)
                           stages_->push_back({std::string(what), 0});
                         stages_->back().second = total > 0 ? done : -1;
                       });
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tmp_;
    delete packages_;
    delete stages_;
  }
  static std::string index_dir() { return tmp_->file("index"); }
  // A copy of the index, to damage.
  static std::string copy_of_index(const std::string& name) {
    const std::string copy = tmp_->file(name);
    fs::remove_all(copy);
    fs::copy(index_dir(), copy, fs::copy_options::recursive);
    return copy;
  }

  static TempDir* model_;
  static TempDir* tmp_;
  static std::vector<Package>* packages_;
  // Each stage build reported, with its last count (-1: a stage without one).
  static std::vector<std::pair<std::string, int64_t>>* stages_;
};
TempDir* SearchIndexTest::model_ = nullptr;
TempDir* SearchIndexTest::tmp_ = nullptr;
std::vector<Package>* SearchIndexTest::packages_ = nullptr;
std::vector<std::pair<std::string, int64_t>>* SearchIndexTest::stages_ = nullptr;

TEST_F(SearchIndexTest, BuildsEveryStageWithProgress) {
  const int64_t n = static_cast<int64_t>(packages_->size());
  ASSERT_EQ(stages_->size(), 5u);
  EXPECT_EQ((*stages_)[0], (std::pair<std::string, int64_t>{"encoding documents", n}));
  EXPECT_EQ((*stages_)[1].first, "encoding queries");
  EXPECT_EQ((*stages_)[2].first, "training");
  EXPECT_GT((*stages_)[2].second, 0);  // steps
  EXPECT_EQ((*stages_)[3], (std::pair<std::string, int64_t>{"writing", -1}));
  EXPECT_EQ((*stages_)[4], (std::pair<std::string, int64_t>{"fitting the hybrid", -1}));
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(index_dir()))
    if (e.is_regular_file()) names.push_back(fs::relative(e.path(), index_dir()).string());
  for (const std::string& name : index_checked_files())
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  // A second build at the same place is refused, and the index is kept.
  expect_error([&] { SearchIndex::build(index_dir(), *packages_, small_options(model_->path())); },
               {"already exists"});
  SearchIndex::open(index_dir()).verify();
}

// The learned engine's weights are the softmax over every stored document
// of scale q . k, q the query's encoding rounded to bfloat16 (as the store
// takes it): held to float64 over the store's own keys.
TEST_F(SearchIndexTest, LearnedWeightsAreTheSoftmaxOverEveryDocument) {
  const SearchIndex index = SearchIndex::open(index_dir());
  const std::string query = "interactive plotting program";
  const Ranking r = index.learned(query, 5);
  ASSERT_EQ(r.hits.size(), 5u);
  const Tensor<float> q = index.encode_queries({query});
  const KeyValueStore store = KeyValueStore::open((fs::path(index_dir()) / "documents").string());
  const SourceChunk chunk = store.read_chunk(0);
  const ConstView<bfloat16> keys = chunk.keys<bfloat16>();
  ASSERT_EQ(keys.size(0), static_cast<int64_t>(packages_->size()));
  const nlohmann::json manifest = nlohmann::json::parse(index.manifest_text());
  const double scale = manifest["score_scale"];
  std::vector<double> logits;
  double top = -INFINITY;
  for (int64_t j = 0; j < keys.size(0); ++j) {
    double s = 0.0;
    for (int64_t c = 0; c < keys.size(1); ++c)
      s += double(float(bfloat16(q(0, c)))) * double(float(keys(j, c)));
    logits.push_back(scale * s);
    top = std::max(top, scale * s);
  }
  double z = 0.0;
  for (const double l : logits) z += std::exp(l - top);
  for (size_t i = 0; i < r.hits.size(); ++i) {
    const double want = std::exp(logits[static_cast<size_t>(r.hits[i].doc)] - top) / z;
    EXPECT_NEAR(r.hits[i].score, want, 1e-5 * want + 1e-7) << "hit " << i;
    if (i > 0) EXPECT_GE(r.hits[i - 1].score, r.hits[i].score);
  }
  // No document outside the top 5 has a larger weight.
  std::vector<double> sorted = logits;
  std::sort(sorted.rbegin(), sorted.rend());
  EXPECT_NEAR(std::exp(sorted[4] - top) / z, r.hits[4].score, 1e-5);
  // The pooled section one-hots: a distribution over the sections.
  double total = 0.0;
  for (const auto& [section, weight] : r.sections) total += weight;
  EXPECT_NEAR(total, 1.0, 1e-5);
}

TEST_F(SearchIndexTest, AQueryThatNamesAPackageFindsItFirst) {
  const SearchIndex index = SearchIndex::open(index_dir());
  const auto& packages = index.packages();
  for (const auto& [query, name] :
       {std::pair{"gnuplot-qt", "gnuplot-qt"}, std::pair{"  GNUPLOT-QT ", "gnuplot-qt"},
        std::pair{"coreutils", "coreutils"}}) {
    SCOPED_TRACE(query);
    for (const Ranking& r :
         {index.learned(query, 3), index.hybrid(query, 3)}) {  // BM25: FTS5's, as it is
      ASSERT_FALSE(r.hits.empty());
      EXPECT_EQ(packages[static_cast<size_t>(r.hits[0].doc)].name, name);
      EXPECT_LE(r.hits.size(), 3u);
      for (size_t i = 1; i < r.hits.size(); ++i) EXPECT_NE(r.hits[i].doc, r.hits[0].doc);
    }
  }
}

// A word no document has is replaced by the nearest package name (by
// character n-grams) before the learned and hybrid engines run, if it is
// near enough.
TEST_F(SearchIndexTest, AnUnknownWordFallsBackToTheNearestName) {
  const SearchIndex index = SearchIndex::open(index_dir());
  const auto& packages = index.packages();
  const std::vector<std::string> queries = {"gnuplt",  "  GNUPLT ", "plot with gnuplt",
                                            "gnuplot", "plot it",   "qqqzzzxxx"};
  for (const Engine engine : {Engine::kHybrid, Engine::kLearned}) {
    SCOPED_TRACE(engine_name(engine));
    const std::vector<Ranking> r = index.search(queries, engine, 3);
    EXPECT_EQ(r[0].corrected, "gnuplot");
    ASSERT_FALSE(r[0].hits.empty());
    EXPECT_EQ(packages[static_cast<size_t>(r[0].hits[0].doc)].name, "gnuplot");
    EXPECT_EQ(r[1].corrected, "  gnuplot ");
    EXPECT_EQ(r[2].corrected, "plot with gnuplot");
    EXPECT_EQ(r[3].corrected, "");  // a name: nothing to correct
    EXPECT_EQ(r[4].corrected, "");  // known words, and "it" is too short to correct
    EXPECT_EQ(r[5].corrected, "");  // unknown, but no name is near
  }
  // BM25 is FTS5's ranking as it is: nothing corrected, no name first.
  const std::vector<Ranking> r = index.search(queries, Engine::kBm25, 3);
  EXPECT_EQ(r[0].corrected, "");
  EXPECT_TRUE(r[0].hits.empty());
}

TEST_F(SearchIndexTest, EvaluatesTheHeldOutQueries) {
  const SearchIndex index = SearchIndex::open(index_dir());
  int64_t held = 0;
  for (const IndexedPackage& p : index.packages())
    held += p.held_out && !words(p.short_description).empty();
  const Evaluation e = index.evaluate();
  EXPECT_EQ(e.bm25.queries, held);
  EXPECT_EQ(e.learned.queries, held);
  EXPECT_EQ(e.hybrid.queries, held);
  EXPECT_EQ(e.fts5_compared, held);
  EXPECT_EQ(e.fts5_same, held);  // BM25 is FTS5's own ranking
  // BM25 on the fixture finds most of its held-out packages first.
  EXPECT_GT(e.bm25.recall_at_10, 0.8);
}

// open() reads the manifest, packages.json, the store's manifest and the
// model's configuration; verify() finds a changed byte in any file.
TEST_F(SearchIndexTest, VerifyFindsAChangedByteAnywhere) {
  std::vector<std::string> files = index_checked_files();
  files.push_back("documents/keys-000000.npy");
  files.push_back("documents/values-000000.npy");
  for (const std::string& name : files) {
    SCOPED_TRACE(name);
    const std::string copy = copy_of_index("damaged");
    flip_middle_byte((fs::path(copy) / name).string());
    std::string message;
    try {
      SearchIndex::open(copy).verify();
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_NE(message.find(fs::path(name).filename().string()), std::string::npos) << message;
  }
  // The weights alone: open() does not read them, verify() does.
  const std::string copy = copy_of_index("weights");
  flip_middle_byte((fs::path(copy) / "model/model.safetensors").string());
  const SearchIndex index = SearchIndex::open(copy);
  expect_error([&] { index.verify(); },
               {"SearchIndex::verify", "model.safetensors", "does not match the manifest"});
}

TEST_F(SearchIndexTest, MissingOrMismatchedFilesAreNamed) {
  expect_error([&] { SearchIndex::open(tmp_->file("missing")); }, {"no such index directory"});
  for (const char* name : {"packages.json", "query_head.npy", "model/vocab.txt", "bm25.sqlite"}) {
    SCOPED_TRACE(name);
    const std::string copy = copy_of_index("incomplete");
    fs::remove((fs::path(copy) / name));
    expect_error([&] { SearchIndex::open(copy); }, {name});
  }
  const std::string copy = copy_of_index("wrong-head");
  { std::ofstream out((fs::path(copy) / "query_head.npy").string(), std::ios::trunc); }
  expect_error([&] { SearchIndex::open(copy); }, {"query_head.npy"});
}

TEST_F(SearchIndexTest, BuildErrorsWriteNothing) {
  const std::string out = tmp_->file("never");
  expect_error([&] { SearchIndex::build(out, *packages_, small_options(tmp_->file("no-model"))); },
               {"no-model", "config.json"});
  IndexOptions o = small_options(model_->path());
  o.document_tokens = 65;
  expect_error([&] { SearchIndex::build(out, *packages_, o); },
               {"document_tokens is 65; expected [3, 64]"});
  expect_error([&] { SearchIndex::build(out, {}, small_options(model_->path())); },
               {"no packages"});
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace qkv::search

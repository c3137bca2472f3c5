"""qkv.search: qkv's search engine for Python.

So far it holds the pretrained sentence encoder the engine is being built on,
and its tokenizer, both in C++:

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

The search index is not here yet (the command `qkv search` has the BM25 and
learned engines).
"""

from ._qkv import search as _search

Encoder = _search.Encoder
Tokenizer = _search.Tokenizer

__all__ = ["Encoder", "Tokenizer"]

"""qkv.search: qkv's search engine for Python.

So far it holds the pretrained sentence encoder's tokenizer, in C++:

    Tokenizer(vocab_path): BERT's uncased WordPiece tokenizer with
        encode(text, max_length=256), encode_batch(texts, max_length=256),
        tokens(text) and words(text); the same ids as Hugging Face's tokenizer
        of all-MiniLM-L6-v2 (BertNormalizer, BertPreTokenizer, WordPiece,
        [CLS] ... [SEP], truncated to max_length).

The search index and the encoder itself are not here yet (the command
`qkv search` has the BM25 and learned engines).
"""

from ._qkv import search as _search

Tokenizer = _search.Tokenizer

__all__ = ["Tokenizer"]

"""qkv.search: the search engine's pretrained sentence encoder, run by qkv.

    Encoder(model_dir)   all-MiniLM-L6-v2 (a 6-layer BERT) read from the model's
                         own files; encode_ids(ids) gives the (n, 384)
                         embeddings, unit length, of token sequences

Its self-attention is qkv's fused scaled dot-product attention (the heads
as strided views of one Q|K|V projection), its matrix products the BLAS;
tests/search/test_encoder_peer.py holds it to sentence-transformers.
docs/search.md has the search engine built on it.
"""

from ._qkv import search as _search

Encoder = _search.Encoder

__all__ = ["Encoder"]

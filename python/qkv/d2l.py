"""qkv.d2l: the book's code, d2l 1.0.3's torch module, with qkv's attention.

    from qkv import d2l        # in place of: from d2l import torch as d2l

Everything of d2l.torch ("Dive into Deep Learning" 1.0.3, the book as
published: check_shape, show_heatmaps, tensor, ones, Trainer, Seq2Seq,
PositionalEncoding, TransformerEncoder, ...) is here, run from d2l's own
source, with four names replaced by qkv's fused kernels (qkv.torch):

    masked_softmax(X, valid_lens)
    DotProductAttention(dropout)
    AdditiveAttention(num_hiddens, dropout)                  the book's lazy layers
    MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)

The book's code looks these names up in the module when it runs
(`d2l.MultiHeadAttention(...)` in TransformerEncoderBlock, `masked_softmax`
in the attention classes), so every class built on them (d2l's
TransformerEncoderBlock, TransformerEncoder, BERTEncoder; the chapter's
TransformerDecoderBlock and Seq2SeqAttentionDecoder, written against `d2l.`)
runs on qkv too. The constructors, parameters (W_q, W_k, W_v, W_o, w_v:
lazy layers, given their values in the book's order, so one seed gives one
model) and attention_weights are the book's: a state_dict of the book's
model loads into qkv's, with the same outputs and gradients.

Two differences, both outside the book's cells: a row with valid length 0
gets weights 0 (the book's -1e6 sentinel gives 1/Nk each), and dropout on
the weights draws its mask from qkv's generator, seeded from torch's (so
torch.manual_seed repeats a run, but not the book's mask).

Needs d2l 1.0.3 (pip install --no-deps d2l==1.0.3; scripts/make-venv.sh --d2l
makes a venv of it on Debian 12's torch 1.13). docs/python.md, "The book's
code: qkv.d2l".
"""

import importlib.util
import sys
import warnings

import torch
from torch import nn

from . import torch as _qkv_torch

_D2L_VERSION = "1.0.3"  # the version this module is tested against


def _book_source():
    """d2l 1.0.3's torch.py: its path and text (read, not imported, so that its
    code runs with this module as its `d2l`)."""
    spec = importlib.util.find_spec("d2l.torch") if importlib.util.find_spec("d2l") else None
    if spec is None or spec.origin is None:
        raise ImportError(
            f"qkv.d2l: the book's code, d2l {_D2L_VERSION}, is not installed in {sys.executable}; "
            f"pip install --no-deps d2l=={_D2L_VERSION} (it also needs torchvision, matplotlib, "
            f"matplotlib-inline, IPython, pandas, scipy, PIL and requests: "
            f"scripts/make-venv.sh --d2l makes such a venv on Debian 12)")
    import d2l as _package
    if _package.__version__ != _D2L_VERSION:
        warnings.warn(f"qkv.d2l: d2l {_package.__version__} is installed; qkv.d2l is tested "
                      f"with d2l {_D2L_VERSION}", stacklevel=3)
    with open(spec.origin, encoding="utf-8") as f:
        return spec.origin, f.read()


# The book's module, run here: its first lines bind `d2l = sys.modules[__name__]`,
# which is this module, so its classes find qkv's attention below.
_origin, _source = _book_source()
exec(compile(_source, _origin, "exec"), globals())  # noqa: S102 (the book's code, pinned)
del _origin, _source

_BookMultiHeadAttention = MultiHeadAttention  # noqa: F821 (defined by the book's code)

masked_softmax = _qkv_torch.masked_softmax

DotProductAttention = _qkv_torch.DotProductAttention


def _lazy_linear(out_features, bias):
    with warnings.catch_warnings():  # torch 1.13 warns that lazy modules are new
        warnings.filterwarnings("ignore", message="Lazy modules are a new feature")
        return nn.LazyLinear(out_features, bias=bias)


def _materialize(linear, in_features):
    """Gives a lazy layer its input size, and its values, by calling it on no
    rows: the book's forward calls its layers, the fused kernel takes only
    their weights."""
    if nn.parameter.is_lazy(linear.weight):
        linear(torch.empty(0, in_features, dtype=linear.weight.dtype))


class AdditiveAttention(nn.Module):
    """d2l 1.0.3's AdditiveAttention on qkv's fused kernel: the same constructor
    (num_hiddens, dropout) and parameters (W_q, W_k, w_v, lazy nn.Linear
    without bias, their values drawn in the book's order), so one seed, or a
    state_dict of the book's module, gives the same outputs and gradients.
    No (B, Nq, Nk, num_hiddens) features tensor: the kernel forms the scores
    one query block at a time. attention_weights (detached) is set by each
    forward unless keep_attention_weights=False.

    >>> attention = qkv.d2l.AdditiveAttention(num_hiddens=8, dropout=0.1)
    >>> attention.eval()(torch.randn(2, 1, 20), k, v, torch.tensor([2, 6])).shape
    torch.Size([2, 1, 4])
    """

    def __init__(self, num_hiddens, dropout, keep_attention_weights=True, **kwargs):
        super().__init__(**kwargs)
        self.W_k = _lazy_linear(num_hiddens, bias=False)
        self.W_q = _lazy_linear(num_hiddens, bias=False)
        self.w_v = _lazy_linear(1, bias=False)
        self.dropout = nn.Dropout(dropout)  # the probability, where d2l keeps it
        self.keep_attention_weights = keep_attention_weights
        self.attention_weights = None

    __prepare_scriptable__ = _qkv_torch._not_scripted

    def forward(self, queries, keys, values, valid_lens):
        """queries (B, Nq, Dq), keys (B, Nk, Dk), values (B, Nk, Dv), valid_lens
        None, (B) or (B, Nq) -> (B, Nq, Dv); sets attention_weights (B, Nq, Nk)."""
        # In the book's order (W_q, W_k, w_v): the order their values are drawn.
        _materialize(self.W_q, queries.shape[-1])
        _materialize(self.W_k, keys.shape[-1])
        _materialize(self.w_v, self.W_q.out_features)
        p = self.dropout.p if self.training else 0.0
        output, weights = _qkv_torch._additive(
            "AdditiveAttention", queries, keys, values, self.W_q.weight, self.W_k.weight,
            self.w_v.weight, valid_lens, p, None, self.keep_attention_weights)
        self.attention_weights = weights
        return output


class MultiHeadAttention(_BookMultiHeadAttention):
    """d2l 1.0.3's MultiHeadAttention (a d2l.Module with the book's
    constructor, W_q, W_k, W_v, W_o and transpose_qkv) whose forward is
    qkv.torch.MultiHeadAttention's: the heads read in place by the fused
    kernel (no transpose_qkv, repeat_interleave or transpose_output copies).
    attention.attention_weights is (B * num_heads, Nq, Nk), the book's shape.

    >>> mha = qkv.d2l.MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5)
    >>> mha.eval()(torch.ones(2, 4, 100), torch.ones(2, 6, 100), torch.ones(2, 6, 100),
    ...            torch.tensor([3, 2])).shape
    torch.Size([2, 4, 100])
    """

    def __init__(self, num_hiddens, num_heads, dropout, bias=False, **kwargs):
        with warnings.catch_warnings():  # torch 1.13 warns that lazy modules are new
            warnings.filterwarnings("ignore", message="Lazy modules are a new feature")
            super().__init__(num_hiddens, num_heads, dropout, bias, **kwargs)
        self.num_kv_heads = num_heads  # read by qkv.torch's forward: every head its own keys

    def forward(self, queries, keys, values, valid_lens, is_causal=False):
        """queries (B, Nq, Dq), keys (B, Nk, Dk), values (B, Nk, Dv), valid_lens
        None, (B) or (B, Nq) -> (B, Nq, num_hiddens)."""
        return _qkv_torch.MultiHeadAttention.forward(self, queries, keys, values, valid_lens,
                                                     is_causal)

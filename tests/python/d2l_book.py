"""The book's own code beside qkv.d2l, for tests/python/test_d2l_*.py.

BOOK is d2l 1.0.3's torch module (`from d2l import torch as d2l`), QKV is
qkv.d2l; both are importable only in the venv of scripts/make-venv.sh --d2l
(Debian's torch 1.13 and torchvision 0.14.1, d2l pinned), where CTest runs
these tests. An import that fails fails the test, it never skips.

The tolerance, from float32's own error: the book's code in float64 with the
same parameters is the reference (its formulas, rounded at 1e-16), and qkv's
float32 result may be off it by at most FACTOR times the book's own float32
result is, plus a floor of FLOOR_ULPS units of float32 rounding of the
reference's largest entry (where the book's error happens to be 0, as on
0/1 weights). So qkv.d2l is held to be as accurate as the book's code, not
to an arbitrary number. FACTOR is 8: the book's error is one draw of its
roundings, which a run can draw small, and over 12 seeds of these tests
qkv's ratio to it reached 5.6 (4-5 several times, in forward results,
gradients and losses alike). In float64 qkv.d2l must agree with the book's float64
to F64_RTOL of the largest entry (1e-12: thousands of float64 roundings).

A gradient's floor is normwise, in units of the largest entry of all the
gradients of the run: backpropagation's roundings scale with what flows
through the graph, and a parameter whose gradient is small by cancellation
(11.4's W_q, entries up to 6e-5 where others reach 1) carries errors of that
flow: qkv's came out 11 times the book's there, its backward forming
sum(dO * O) for the softmax's gradient as FlashAttention does, where
autograd forms sum(P * dP).

Gradients get one term more, RECOMPUTE_ULPS u S of that largest entry, S
the largest |score| of the model's attention: qkv's backward recomputes the
weights as exp(score - lse) from float32 scores and lse (as FlashAttention
does) instead of keeping the forward's, so the dominant weights carry an
error of about u S where the book's softmax, shifted by the row's maximum,
has about u. Section 11.7's first blocks see the embeddings times
sqrt(256) = 16 unnormalised: S reaches 280-330 there, and the value
projections' gradients came out 3-11 times the book's float32 error.
"""

import contextlib
import copy
import os

os.environ.setdefault("MPLBACKEND", "Agg")  # the book's figures, drawn to no screen

import torch  # noqa: E402
from d2l import torch as BOOK  # noqa: E402

import qkv.d2l as QKV  # noqa: E402

U32 = 2.0**-24  # float32's unit roundoff
FACTOR = 8
FLOOR_ULPS = 16
RECOMPUTE_ULPS = 2
F64_RTOL = 1e-12


def errors(got, book32, book64, max_score=0.0, scale=None):
    """(qkv's float32 error, the book's float32 error, the bound), max-abs
    against book64; max_score: S for a gradient, 0 for a forward result;
    scale: the floor's magnitude, by default book64's largest entry."""
    ref = book64.double()
    qkv_err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
    book_err = (book32.double() - ref).abs().max().item() if ref.numel() else 0.0
    if scale is None:
        scale = ref.abs().max().item() if ref.numel() else 0.0
    ulps = FLOOR_ULPS + RECOMPUTE_ULPS * max_score
    return qkv_err, book_err, FACTOR * book_err + ulps * U32 * scale


def assert_as_accurate(name, got, book32, book64, max_score=0.0, scale=None):
    """got (qkv, float32) within FACTOR times the book's float32 error of book64."""
    assert got.shape == book64.shape, (name, got.shape, book64.shape)
    assert got.dtype == book32.dtype, (name, got.dtype, book32.dtype)
    qkv_err, book_err, bound = errors(got, book32, book64, max_score, scale)
    assert qkv_err <= bound, (f"{name}: qkv.d2l's float32 result is {qkv_err:.3g} off the book's "
                              f"float64 one; the book's float32 is {book_err:.3g} off; bound "
                              f"{bound:.3g}")


def assert_float64_agrees(name, got, book64):
    assert got.shape == book64.shape and got.dtype == torch.float64, (name, got.dtype)
    scale = book64.abs().max().item() if book64.numel() else 0.0
    err = (got - book64).abs().max().item() if book64.numel() else 0.0
    assert err <= F64_RTOL * max(scale, 1e-300), (f"{name}: qkv.d2l's float64 result is {err:.3g} "
                                                  f"off the book's (largest entry {scale:.3g})")


def compare(results):
    """results: {(module name, dtype): {name: tensor}} for ("book"|"qkv",
    float32|float64), and "max_score": S, if any; checks every name both ways
    (float32 by the book's own error, float64 by F64_RTOL). Names "d_..." are
    gradients."""
    max_score = results.get("max_score", 0.0)
    book32, book64 = results["book", torch.float32], results["book", torch.float64]
    qkv32, qkv64 = results["qkv", torch.float32], results["qkv", torch.float64]
    assert set(qkv32) == set(book32) == set(book64) == set(qkv64)
    gradient = max((t.abs().max().item() for n, t in book64.items()
                    if n.startswith("d_") and t.numel()), default=0.0)
    for name in book64:
        if name.startswith("d_"):
            assert_as_accurate(name, qkv32[name], book32[name], book64[name], max_score,
                               gradient)
        else:
            assert_as_accurate(name, qkv32[name], book32[name], book64[name])
        assert_float64_agrees(name, qkv64[name], book64[name])


@contextlib.contextmanager
def recording_scores():
    """The largest |score| of each call of the book's attention (its
    masked_softmax's argument, before its mask), in a list."""
    scores, book_softmax = [], BOOK.masked_softmax

    def recording(X, valid_lens):
        scores.append(X.detach().abs().max().item() if X.numel() else 0.0)
        return book_softmax(X, valid_lens)

    BOOK.masked_softmax = recording
    try:
        yield scores
    finally:
        BOOK.masked_softmax = book_softmax


def run_both(seed, build, cell, inputs):
    """Runs the book's and qkv's module in float32 and float64 -> {(name,
    dtype): {name: tensor}, "max_score": S}: the cell's results and the gradients of a random
    projection of its output (drawn from `seed`) in its float inputs and
    every parameter.

    build(d2l) makes the module, its lazy layers given their values by a
    first call; it runs under torch.manual_seed(seed) for both, and must give
    qkv's module the book's parameters to the bit. cell(d2l, module,
    **inputs) -> (output, {name: tensor}) runs on a copy of the module in the
    run's dtype, with the float inputs in that dtype, requiring gradients."""
    modules = {}
    for name, d2l in (("book", BOOK), ("qkv", QKV)):
        torch.manual_seed(seed)
        with torch.no_grad():
            modules[name] = build(d2l)
    book_state, qkv_state = modules["book"].state_dict(), modules["qkv"].state_dict()
    assert list(book_state) == list(qkv_state)
    for key in book_state:
        assert torch.equal(book_state[key], qkv_state[key]), f"parameter {key} differs"
    results = {}
    for name, d2l in (("book", BOOK), ("qkv", QKV)):
        for dtype in (torch.float32, torch.float64):
            module = copy.deepcopy(modules[name]).to(dtype)
            args = {k: x.detach().to(dtype).requires_grad_() if x.is_floating_point() else x
                    for k, x in inputs.items()}
            if (name, dtype) == ("book", torch.float64):
                with recording_scores() as scores:
                    output, named = cell(d2l, module, **args)
                results["max_score"] = max(scores, default=0.0)
            else:
                output, named = cell(d2l, module, **args)
            weight = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed),
                                 dtype=torch.float64)
            (output * weight.to(dtype)).sum().backward()
            named = dict(named, output=output.detach())
            named.update({f"d_{k}": x.grad for k, x in args.items() if x.grad is not None})
            named.update({f"d_{k}": p.grad for k, p in module.named_parameters()
                          if p.grad is not None})
            results[name, dtype] = named
    return results


def decoder_classes(d2l):
    """Section 11.7's TransformerDecoderBlock and TransformerDecoder, the
    book's notebook code (not in d2l's library), written against the module
    `d2l` given (the book's or qkv.d2l), as a reader's notebook runs them."""
    import math

    from torch import nn

    class TransformerDecoderBlock(nn.Module):
        # The i-th block in the Transformer decoder
        def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, i):
            super().__init__()
            self.i = i
            self.attention1 = d2l.MultiHeadAttention(num_hiddens, num_heads, dropout)
            self.addnorm1 = d2l.AddNorm(num_hiddens, dropout)
            self.attention2 = d2l.MultiHeadAttention(num_hiddens, num_heads, dropout)
            self.addnorm2 = d2l.AddNorm(num_hiddens, dropout)
            self.ffn = d2l.PositionWiseFFN(ffn_num_hiddens, num_hiddens)
            self.addnorm3 = d2l.AddNorm(num_hiddens, dropout)

        def forward(self, X, state):
            enc_outputs, enc_valid_lens = state[0], state[1]
            if state[2][self.i] is None:
                key_values = X
            else:
                key_values = torch.cat((state[2][self.i], X), dim=1)
            state[2][self.i] = key_values
            if self.training:
                batch_size, num_steps, _ = X.shape
                dec_valid_lens = torch.arange(1, num_steps + 1,
                                              device=X.device).repeat(batch_size, 1)
            else:
                dec_valid_lens = None
            X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
            Y = self.addnorm1(X, X2)
            Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
            Z = self.addnorm2(Y, Y2)
            return self.addnorm3(Z, self.ffn(Z)), state

    class TransformerDecoder(d2l.AttentionDecoder):
        def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks,
                     dropout):
            super().__init__()
            self.num_hiddens = num_hiddens
            self.num_blks = num_blks
            self.embedding = nn.Embedding(vocab_size, num_hiddens)
            self.pos_encoding = d2l.PositionalEncoding(num_hiddens, dropout)
            self.blks = nn.Sequential()
            for i in range(num_blks):
                self.blks.add_module("block" + str(i), TransformerDecoderBlock(
                    num_hiddens, ffn_num_hiddens, num_heads, dropout, i))
            self.dense = nn.LazyLinear(vocab_size)

        def init_state(self, enc_outputs, enc_valid_lens):
            return [enc_outputs, enc_valid_lens, [None] * self.num_blks]

        def forward(self, X, state):
            X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
            self._attention_weights = [[None] * len(self.blks) for _ in range(2)]
            for i, blk in enumerate(self.blks):
                X, state = blk(X, state)
                self._attention_weights[0][i] = blk.attention1.attention.attention_weights
                self._attention_weights[1][i] = blk.attention2.attention.attention_weights
            return self.dense(X), state

        @property
        def attention_weights(self):
            return self._attention_weights

    return TransformerDecoderBlock, TransformerDecoder


def translation_model(d2l, src_vocab, tgt_vocab, num_hiddens=256, num_blks=2, dropout=0.2,
                      ffn_num_hiddens=64, num_heads=4, lr=0.001):
    """Section 11.7's model (its sizes are the defaults): the book's
    TransformerEncoder, the notebook's TransformerDecoder, d2l.Seq2Seq."""
    _, TransformerDecoder = decoder_classes(d2l)
    encoder = d2l.TransformerEncoder(src_vocab, num_hiddens, ffn_num_hiddens, num_heads,
                                     num_blks, dropout)
    decoder = TransformerDecoder(tgt_vocab, num_hiddens, ffn_num_hiddens, num_heads, num_blks,
                                 dropout)
    return d2l.Seq2Seq(encoder, decoder, tgt_pad=0, lr=lr)


def translation_batch(generator, batch_size, num_steps, src_vocab, tgt_vocab):
    """A batch shaped as d2l.MTFraEng's (src, tgt input, src valid_len (int32),
    tgt labels), random token ids past the pad 0 and each source padded with
    0 past a random length in [2, num_steps] (no download: the data's values
    do not matter to attention's arithmetic, its shapes do)."""
    src = torch.randint(1, src_vocab, (batch_size, num_steps), generator=generator)
    src_valid_len = torch.randint(2, num_steps + 1, (batch_size,), generator=generator,
                                  dtype=torch.int32)
    src[torch.arange(num_steps)[None, :] >= src_valid_len[:, None]] = 0
    tgt = torch.randint(1, tgt_vocab, (batch_size, num_steps + 1), generator=generator)
    return src, tgt[:, :-1], src_valid_len, tgt[:, 1:]

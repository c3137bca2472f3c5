"""Sections 11.1-11.4 of the book as published (d2l 1.0.3), run with qkv.d2l
in place of `from d2l import torch as d2l`: the cells' own calls (eye
heatmaps; Nadaraya-Watson; masked_softmax, check_shape, DotProductAttention,
AdditiveAttention(num_hiddens, dropout) with their shapes and heatmaps;
11.4's Bahdanau decoder, AdditiveAttention one query a step), and
their outputs and gradients against the book's code with the same
parameters, by the tolerance in d2l_book.py (qkv's float32 within 8 times
the book's own float32 error of the book's float64, plus 16 roundings; float64
within 1e-12).

Run in the venv of scripts/make-venv.sh --d2l (CTest does); fresh random
inputs each run (conftest's seed).
"""

import pytest
import torch
from d2l_book import BOOK, QKV, U32, assert_float64_agrees, compare, run_both

import qkv.d2l  # noqa: F401 (the docstrings name it qkv.d2l)
import qkv.torch


def test_qkv_d2l_is_the_books_module_with_qkvs_attention():
    # Everything of the book's module is there (check_shape, show_heatmaps,
    # tensor, ones, ... the missing names), ...
    book_names = {n for n in vars(BOOK) if not n.startswith("__")}
    missing = sorted(book_names - set(vars(QKV)))
    assert not missing, missing
    for name in ("check_shape", "show_heatmaps", "tensor", "ones", "Trainer", "Seq2Seq",
                 "PositionalEncoding", "TransformerEncoder", "MTFraEng"):
        assert callable(getattr(QKV, name)), name
    assert QKV.tensor is torch.tensor and QKV.ones is torch.ones
    # ... running on qkv's kernels, and `d2l.` inside the book's code is qkv.d2l.
    assert QKV.masked_softmax is qkv.torch.masked_softmax
    assert QKV.DotProductAttention is qkv.torch.DotProductAttention
    assert QKV.d2l is QKV
    assert issubclass(QKV.MultiHeadAttention, QKV.Module)  # the book's d2l.Module, as its MHA


def test_11_1_eye_heatmap_runs_as_the_book():
    attention_weights = QKV.eye(10).reshape((1, 1, 10, 10))
    QKV.show_heatmaps(attention_weights, xlabel="Keys", ylabel="Queries")
    figure = QKV.plt.gcf()
    images = [image for ax in figure.axes for image in ax.get_images()]
    assert len(images) == 1 and (torch.tensor(images[0].get_array()) == torch.eye(10)).all()
    QKV.plt.close("all")


def book_nadaraya_watson(x_train, y_train, x_val, kernel):
    """The book's nadaraya_watson (11.2), as printed."""
    dists = x_train.reshape((-1, 1)) - x_val.reshape((1, -1))
    k = kernel(dists).type(x_train.dtype)
    attention_w = k / k.sum(0)
    return y_train @ attention_w, attention_w


@pytest.mark.parametrize("sigma", [0.1, 0.2, 0.5, 1.0])
def test_11_2_gaussian_nadaraya_watson_is_distance_attention(seed, sigma):
    # The book's data: y = 2 sin x + x + noise at 40 sorted points in [0, 5).
    torch.manual_seed(seed)
    n = 40
    x_train, _ = torch.sort(torch.rand(n, dtype=torch.float64) * 5)
    y_train = 2 * torch.sin(x_train) + x_train + torch.randn(n, dtype=torch.float64)
    x_val = torch.arange(0, 5, 0.1, dtype=torch.float64)
    def gaussian(x):  # the book's gaussian_with_width(sigma)
        return torch.exp(-x**2 / (2 * sigma**2))
    book = {torch.float64: book_nadaraya_watson(x_train, y_train, x_val, gaussian)}
    # The Gaussian kernel of width sigma is qkv's Nadaraya-Watson with
    # bandwidth sigma (float64), and attention with score -|q - k|^2 / (2
    # sigma^2), qkv's distance attention at scale 1 / sigma^2. In float64
    # only: the distance kernel expands the square (|q|^2 - 2 q k + |k|^2
    # after centring), so in float32 its error grows with scale |x|^2 (at
    # sigma = 0.1 on this data, 4e-5 against the book's 2e-6, which forms
    # q - k first).
    assert_float64_agrees("y_hat (nadaraya_watson)", torch.from_numpy(qkv.nadaraya_watson(
        x_train.numpy(), y_train.numpy(), x_val.numpy(), bandwidth=sigma)), book[torch.float64][0])
    y_hat, weights = qkv.torch.distance_attention(
        x_val.reshape(1, -1, 1), x_train.reshape(1, -1, 1), y_train.reshape(1, -1, 1),
        scale=1 / sigma**2, return_weights=True)
    assert_float64_agrees("y_hat (distance_attention)", y_hat.reshape(-1), book[torch.float64][0])
    assert_float64_agrees("attention_w", weights[0].T, book[torch.float64][1])
    # The cells' figures run on qkv.d2l (d2l.plt, d2l.abs, use_svg_display).
    QKV.use_svg_display()
    fig, axes = QKV.plt.subplots(1, 4, sharey=True, figsize=(12, 3))
    pcm = axes[0].imshow(QKV.numpy(weights[0].T), cmap="Reds")
    fig.colorbar(pcm, ax=axes, shrink=0.7)
    QKV.plt.close("all")


@pytest.mark.parametrize("lens", [[2, 3], [[1, 3], [2, 4]]], ids=["lens (B)", "lens (B, Nq)"])
def test_11_3_masked_softmax_is_the_books(seed, lens):
    torch.manual_seed(seed)
    X = torch.rand(2, 2, 4, dtype=torch.float64)
    valid_lens = torch.tensor(lens)
    results = {}
    for name, d2l in (("book", BOOK), ("qkv", QKV)):
        for dtype in (torch.float32, torch.float64):
            leaf = X.to(dtype).clone().requires_grad_()
            # clone(): the book's masked_softmax writes its -1e6 into its argument.
            weights = d2l.masked_softmax(leaf.clone(), valid_lens)
            weight = torch.randn(weights.shape, generator=torch.Generator().manual_seed(seed),
                                 dtype=torch.float64)
            (weights * weight.to(dtype)).sum().backward()
            results[name, dtype] = {"weights": weights.detach(), "d_X": leaf.grad}
    compare(results)
    # The printed result's pattern: zeros past each row's length, rows summing to 1.
    weights = QKV.masked_softmax(X.float(), valid_lens)
    lens2 = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(2, 2)
    for b in range(2):
        for i in range(2):
            assert (weights[b, i, lens2[b, i]:] == 0).all()
            assert abs(weights[b, i].sum().item() - 1) <= 4 * U32


def test_11_3_batch_matmul_check_shape():
    Q, K = QKV.ones((2, 3, 4)), QKV.ones((2, 4, 6))
    QKV.check_shape(torch.bmm(Q, K), (2, 3, 6))
    with pytest.raises(AssertionError, match=r"!= expected shape \(2, 3, 7\)"):
        QKV.check_shape(torch.bmm(Q, K), (2, 3, 7))


def toy_inputs(query_size):
    """The 11.3 cells' inputs: queries (2, 1, query_size), keys (2, 10, 2),
    values (2, 10, 4), all normal(0, 1); valid_lens [2, 6]."""
    return {"queries": torch.normal(0, 1, (2, 1, query_size)),
            "keys": torch.normal(0, 1, (2, 10, 2)), "values": torch.normal(0, 1, (2, 10, 4)),
            "valid_lens": QKV.tensor([2, 6])}


def attention_cell(d2l, attention, queries, keys, values, valid_lens):
    attention.eval()
    output = attention(queries, keys, values, valid_lens)
    d2l.check_shape(output, (2, 1, 4))
    d2l.show_heatmaps(attention.attention_weights.reshape((1, 1, 2, 10)), xlabel="Keys",
                      ylabel="Queries")
    d2l.plt.close("all")
    return output, {"attention_weights": attention.attention_weights.detach()}


def test_11_3_dot_product_attention_is_the_books(seed):
    torch.manual_seed(seed)
    inputs = toy_inputs(2)
    compare(run_both(seed, lambda d2l: d2l.DotProductAttention(dropout=0.5), attention_cell,
                     inputs))


def test_11_3_additive_attention_is_the_books(seed):
    torch.manual_seed(seed)
    inputs = toy_inputs(20)

    def build(d2l):  # the book's constructor; its lazy layers take their sizes from a call
        attention = d2l.AdditiveAttention(num_hiddens=8, dropout=0.1)
        attention.eval()(*inputs.values())
        return attention

    results = run_both(seed, build, attention_cell, inputs)
    assert {"d_W_q.weight", "d_W_k.weight", "d_w_v.weight"} <= set(results["qkv", torch.float32])
    compare(results)


def test_additive_attention_takes_the_books_constructor_only():
    # d2l 1.0.3's constructor is (num_hiddens, dropout); the old
    # (key_size, query_size, num_hiddens, dropout) fails in both alike.
    for d2l in (BOOK, QKV):
        with pytest.raises(TypeError):
            d2l.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1)
    assert torch.nn.parameter.is_lazy(QKV.AdditiveAttention(8, 0.1).W_q.weight)


def test_dropout_in_training_drops_weights_as_the_book(seed):
    # Values the identity: the output is the dropped weights themselves, each
    # 0 or weight / (1 - p) (the book's nn.Dropout on attention_weights).
    torch.manual_seed(seed)
    p = 0.5
    queries, keys = torch.randn(3, 5, 4), torch.randn(3, 16, 4)
    values = torch.eye(16).repeat(3, 1, 1)
    valid_lens = torch.tensor([16, 9, 4])
    for attention in (QKV.DotProductAttention(p), QKV.AdditiveAttention(8, p)):
        attention(queries, keys, values, valid_lens)  # the lazy layers' values drawn first
        attention.train()
        torch.manual_seed(seed)
        dropped = attention(queries, keys, values, valid_lens)
        weights = attention.attention_weights
        kept = dropped != 0
        assert torch.allclose(dropped[kept], weights[kept] / (1 - p), rtol=8 * U32, atol=0)
        fraction = kept.sum().item() / (weights > 0).sum().item()
        assert 0.3 < fraction < 0.7, fraction  # 1 - p, over 3 * 5 * 29 weights
        torch.manual_seed(seed)  # torch.manual_seed repeats a training run
        assert torch.equal(attention(queries, keys, values, valid_lens), dropped)


@pytest.mark.parametrize("name", ["AdditiveAttention", "MultiHeadAttention"])
def test_the_docstrings_examples_run(name):
    # qkv.d2l's own classes document themselves as qkv.torch's do; their
    # examples use the toy keys and values of qkv.torch's docstrings.
    import doctest

    globs = {"torch": torch, "qkv": qkv, "k": torch.ones(2, 10, 2),
             "v": torch.arange(40.0).reshape(1, 10, 4).repeat(2, 1, 1)}
    test = doctest.DocTestParser().get_doctest(getattr(QKV, name).__doc__, globs, name, None, 0)
    assert test.examples, f"qkv.d2l.{name} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0


def bahdanau_decoder_class(d2l):
    """Section 11.4's Seq2SeqAttentionDecoder, the book's notebook code
    written against the module `d2l` given: AdditiveAttention(num_hiddens,
    dropout) with one query a step over the encoder's outputs."""
    from torch import nn

    class Seq2SeqAttentionDecoder(d2l.AttentionDecoder):
        def __init__(self, vocab_size, embed_size, num_hiddens, num_layers, dropout=0):
            super().__init__()
            self.attention = d2l.AdditiveAttention(num_hiddens, dropout)
            self.embedding = nn.Embedding(vocab_size, embed_size)
            self.rnn = nn.GRU(embed_size + num_hiddens, num_hiddens, num_layers,
                              dropout=dropout)
            self.dense = nn.LazyLinear(vocab_size)
            self.apply(d2l.init_seq2seq)

        def init_state(self, enc_outputs, enc_valid_lens):
            outputs, hidden_state = enc_outputs
            return (outputs.permute(1, 0, 2), hidden_state, enc_valid_lens)

        def forward(self, X, state):
            enc_outputs, hidden_state, enc_valid_lens = state
            X = self.embedding(X).permute(1, 0, 2)
            outputs, self._attention_weights = [], []
            for x in X:
                query = torch.unsqueeze(hidden_state[-1], dim=1)
                context = self.attention(query, enc_outputs, enc_outputs, enc_valid_lens)
                x = torch.cat((context, torch.unsqueeze(x, dim=1)), dim=-1)
                out, hidden_state = self.rnn(x.permute(1, 0, 2), hidden_state)
                outputs.append(out)
                self._attention_weights.append(self.attention.attention_weights)
            outputs = self.dense(torch.cat(outputs, dim=0))
            return outputs.permute(1, 0, 2), [enc_outputs, hidden_state, enc_valid_lens]

        @property
        def attention_weights(self):
            return self._attention_weights

    return Seq2SeqAttentionDecoder


def test_11_4_bahdanau_decoder_is_the_books(seed):
    # The section's check: vocab 10, embed 8, 16 hiddens, 2 layers, batch 4,
    # 7 steps; random tokens and source lengths in place of zeros and None.
    generator = torch.Generator().manual_seed(seed)
    inputs = {"X": torch.randint(0, 10, (4, 7), generator=generator),
              "valid_lens": torch.randint(1, 8, (4,), generator=generator)}

    class Both(torch.nn.Module):
        def __init__(self, d2l):
            super().__init__()
            self.encoder = d2l.Seq2SeqEncoder(10, 8, 16, 2)
            self.decoder = bahdanau_decoder_class(d2l)(10, 8, 16, 2)

        def forward(self, X, valid_lens):
            state = self.decoder.init_state(self.encoder(X), valid_lens)
            return self.decoder(X, state)[0]

    def build(d2l):
        model = Both(d2l)
        model.eval()(*inputs.values())
        return model

    def cell(d2l, model, X, valid_lens):
        model.eval()
        output = model(X, valid_lens)
        d2l.check_shape(output, (4, 7, 10))
        weights = d2l.concat(model.decoder.attention_weights, 1)
        d2l.check_shape(weights, (4, 7, 7))
        return output, {"attention_weights": weights}

    compare(run_both(seed, build, cell, inputs))


def test_without_d2l_the_import_says_what_to_install():
    # Debian's /usr/bin/python3 alone (no venv) has torch but not d2l.
    import os
    import subprocess

    import qkv as package

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(package.__file__)))
    probe = subprocess.run(["/usr/bin/python3", "-c", "import d2l"], env=env, capture_output=True)
    assert probe.returncode != 0, "this test needs a Python without d2l: /usr/bin/python3"
    proc = subprocess.run(["/usr/bin/python3", "-c", "import qkv.d2l"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "qkv.d2l: the book's code, d2l 1.0.3, is not installed in /usr/bin/python3" in \
        proc.stderr, proc.stderr
    assert "scripts/make-venv.sh --d2l" in proc.stderr

"""Sections 11.5-11.7 of the book as published (d2l 1.0.3), run with qkv.d2l
in place of `from d2l import torch as d2l`: multi-head attention, self-
attention and positional encoding, the Transformer's encoder block, encoder,
the notebook's decoder block and decoder, and the machine translation
model's training steps and token-by-token decoding, each against the book's
code with the same parameters (one seed: qkv.d2l draws the lazy layers'
values in the book's order), outputs and gradients by the tolerance in
d2l_book.py (qkv's float32 within 8 times the book's own float32 error of
the book's float64, plus 16 roundings; float64 within 1e-12).

Dropout is off where numbers are compared (eval(), or dropout 0 for the
training steps): qkv draws the mask on the weights from its own generator.
Run in the venv of scripts/make-venv.sh --d2l (CTest does).
"""

import copy

import pytest
import torch
from d2l_book import (BOOK, QKV, compare, decoder_classes, recording_scores, run_both,
                      translation_batch, translation_model)


def mha_cell(d2l, attention, queries, keys_values, valid_lens):
    attention.eval()
    output = attention(queries, keys_values, keys_values, valid_lens)
    d2l.check_shape(output, (*queries.shape[:2], 100))
    weights = attention.attention.attention_weights
    d2l.check_shape(weights, (queries.shape[0] * 5, queries.shape[1], keys_values.shape[1]))
    return output, {"attention_weights": weights.detach()}


@pytest.mark.parametrize("lens", ["(B)", "(B, Nq)", "None"])
def test_11_5_multi_head_attention_is_the_books(seed, lens):
    # The section's cell: num_hiddens 100, 5 heads, batch 2, 4 queries, 6
    # key-value pairs, valid_lens [3, 2]; random inputs in place of ones.
    torch.manual_seed(seed)
    valid_lens = {"(B)": QKV.tensor([3, 2]), "(B, Nq)": torch.randint(1, 7, (2, 4)),
                  "None": None}[lens]
    inputs = {"queries": torch.randn(2, 4, 100), "keys_values": torch.randn(2, 6, 100),
              "valid_lens": valid_lens}

    def build(d2l):
        attention = d2l.MultiHeadAttention(100, 5, 0.5)
        attention.eval()(inputs["queries"], inputs["keys_values"], inputs["keys_values"],
                         valid_lens)
        return attention

    if valid_lens is None:
        inputs.pop("valid_lens")
        cell = lambda d2l, a, queries, keys_values: mha_cell(d2l, a, queries, keys_values, None)
    else:
        cell = mha_cell
    compare(run_both(seed, build, cell, inputs))


def test_11_5_cell_as_printed():
    # Not in eval mode, as printed: dropout 0.5 on the weights, shape only.
    attention = QKV.MultiHeadAttention(100, 5, 0.5)
    X, Y = QKV.ones((2, 4, 100)), QKV.ones((2, 6, 100))
    QKV.check_shape(attention(X, Y, Y, QKV.tensor([3, 2])), (2, 4, 100))


def test_11_6_self_attention_and_positional_encoding(seed):
    torch.manual_seed(seed)
    inputs = {"queries": torch.randn(2, 4, 100), "valid_lens": QKV.tensor([3, 2])}

    def build(d2l):
        attention = d2l.MultiHeadAttention(100, 5, 0.5)
        attention.eval()(inputs["queries"], inputs["queries"], inputs["queries"],
                         inputs["valid_lens"])
        return attention

    def cell(d2l, attention, queries, valid_lens):  # self-attention: X, X, X
        return mha_cell(d2l, attention, queries, queries, valid_lens)

    compare(run_both(seed, build, cell, inputs))
    # PositionalEncoding is the book's class, unchanged: the same P, and the cells run.
    encoding_dim, num_steps = 32, 60
    pos_encoding = QKV.PositionalEncoding(encoding_dim, 0)
    X = pos_encoding(QKV.zeros((1, num_steps, encoding_dim)))
    assert torch.equal(pos_encoding.P, BOOK.PositionalEncoding(encoding_dim, 0).P)
    P = pos_encoding.P[:, :X.shape[1], :]
    QKV.plot(QKV.arange(num_steps), P[0, :, 6:10].T, xlabel="Row (position)", figsize=(6, 2.5),
             legend=["Col %d" % d for d in QKV.arange(6, 10)])
    QKV.show_heatmaps(P[0, :, :].unsqueeze(0).unsqueeze(0), xlabel="Column (encoding dimension)",
                      ylabel="Row (position)", figsize=(3.5, 4), cmap="Blues")
    QKV.plt.close("all")


def test_11_7_encoder_block_is_the_books(seed):
    # The cell: X (2, 100, 24), valid_lens [3, 2], TransformerEncoderBlock(24, 48, 8, 0.5).
    torch.manual_seed(seed)
    inputs = {"X": torch.randn(2, 100, 24), "valid_lens": QKV.tensor([3, 2])}

    def build(d2l):
        block = d2l.TransformerEncoderBlock(24, 48, 8, 0.5)
        block.eval()(*inputs.values())
        assert isinstance(block.attention, d2l.MultiHeadAttention)  # qkv's in qkv.d2l
        return block

    def cell(d2l, block, X, valid_lens):
        block.eval()
        output = block(X, valid_lens)
        d2l.check_shape(output, X.shape)
        return output, {"attention_weights": block.attention.attention.attention_weights}

    compare(run_both(seed, build, cell, inputs))


def test_11_7_encoder_and_decoder_are_the_books(seed):
    # TransformerEncoder(200, 24, 48, 8, 2, 0.5) on tokens (2, 100), and the
    # notebook's TransformerDecoder on the encoder's state, teacher-forced.
    generator = torch.Generator().manual_seed(seed)
    inputs = {"enc_X": torch.randint(0, 200, (2, 100), generator=generator),
              "dec_X": torch.randint(0, 200, (2, 100), generator=generator),
              "valid_lens": QKV.tensor([3, 2])}

    class Both(torch.nn.Module):
        def __init__(self, d2l):
            super().__init__()
            self.encoder = d2l.TransformerEncoder(200, 24, 48, 8, 2, 0.5)
            self.decoder = decoder_classes(d2l)[1](200, 24, 48, 8, 2, 0.5)

        def forward(self, enc_X, dec_X, valid_lens):
            enc_outputs = self.encoder(enc_X, valid_lens)
            return self.decoder(dec_X, self.decoder.init_state(enc_outputs, valid_lens))[0]

    def build(d2l):
        model = Both(d2l)
        model.eval()(*inputs.values())
        return model

    def cell(d2l, model, enc_X, dec_X, valid_lens):
        model.eval()
        output = model(enc_X, dec_X, valid_lens)
        d2l.check_shape(output, (2, 100, 200))
        named = {f"encoder weights {i}": w for i, w in enumerate(model.encoder.attention_weights)}
        named.update({f"decoder weights {i} {j}": w for i, ws in
                      enumerate(model.decoder.attention_weights) for j, w in enumerate(ws)})
        return output, named

    compare(run_both(seed, build, cell, inputs))


def test_11_7_translation_training_steps_are_the_books(seed):
    # The section's model (num_hiddens 256, 2 blocks, 4 heads, FFN 64; lr
    # 0.001, Adam, gradient clipping at 1 as its Trainer does) on batches
    # shaped as MTFraEng's (num_steps 9, int32 valid lengths), in training
    # mode -- the decoder's (B, Nq) lengths -- with dropout 0: five steps;
    # the first step's gradients, every step's loss, the parameters after.
    generator = torch.Generator().manual_seed(seed)
    src_vocab, tgt_vocab, steps, lr = 194, 214, 5, 0.001
    batches = [translation_batch(generator, 16, 9, src_vocab, tgt_vocab) for _ in range(steps)]
    models = {}
    for name, d2l in (("book", BOOK), ("qkv", QKV)):
        torch.manual_seed(seed)
        model = translation_model(d2l, src_vocab, tgt_vocab, dropout=0.0, lr=lr)
        with torch.no_grad():
            model(*batches[0][:-1])  # the lazy layers' values, in the book's order
        models[name] = model
    book_state, qkv_state = models["book"].state_dict(), models["qkv"].state_dict()
    assert list(book_state) == list(qkv_state)
    assert all(torch.equal(book_state[k], qkv_state[k]) for k in book_state)
    trainer = BOOK.Trainer(max_epochs=1, gradient_clip_val=1)
    results, after = {}, {}
    for name in ("book", "qkv"):
        for dtype in (torch.float32, torch.float64):
            model = copy.deepcopy(models[name]).to(dtype)
            model.train()
            optimizer = model.configure_optimizers()
            losses = []
            with recording_scores() as scores:  # S, for the gradients' bound
                for batch in batches:
                    loss = model.loss(model(*batch[:-1]), batch[-1])  # training_step, no plot
                    optimizer.zero_grad()
                    loss.backward()
                    if not losses:
                        grads = {f"d_{k}": p.grad.clone() for k, p in model.named_parameters()}
                    trainer.clip_gradients(1, model)
                    optimizer.step()
                    losses.append(loss.detach())
            if (name, dtype) == ("book", torch.float64):
                results["max_score"] = max(scores)
            results[name, dtype] = dict(grads, losses=torch.stack(losses))
            after[name, dtype] = {k: p.detach() for k, p in model.named_parameters()}
    compare(results)
    # The parameters after the steps: float64 to 1e-9 of the largest entry,
    # float32 to 2 steps lr. Adam divides each gradient by its own running
    # size, so a coordinate whose gradient is mostly cancellation moves by up
    # to lr a step with its gradient's rounding: in float32 the book's own
    # parameters came out up to 2e-4 (0.3 % of the largest) off its float64
    # ones, and qkv's up to 5 times that; in float64 2.7e-12 was seen.
    for key in after["book", torch.float64]:
        book64 = after["book", torch.float64][key]
        scale = book64.abs().max().item()
        err64 = (after["qkv", torch.float64][key] - book64).abs().max().item()
        assert err64 <= 1e-9 * scale, (key, err64, scale)
        err32 = (after["qkv", torch.float32][key].double() - book64).abs().max().item()
        assert err32 <= 2 * steps * lr, (key, err32)


def test_11_7_decoding_token_by_token_is_the_books(seed):
    # predict_step's loop in eval mode: the decoder's keys and values grow by
    # one step a call (Nq 1, valid_lens None), the source's lengths for the
    # encoder-decoder attention; fed the same tokens, so the logits of every
    # step compare.
    generator = torch.Generator().manual_seed(seed)
    src_vocab, tgt_vocab, num_steps = 194, 214, 9
    src, tgt, src_valid_len, _ = translation_batch(generator, 4, num_steps, src_vocab, tgt_vocab)
    inputs = {"src": src, "tgt": tgt, "src_valid_len": src_valid_len}

    def build(d2l):
        model = translation_model(d2l, src_vocab, tgt_vocab)
        model.eval()(src, tgt, src_valid_len)
        return model

    def cell(d2l, model, src, tgt, src_valid_len):
        model.eval()
        state = model.decoder.init_state(model.encoder(src, src_valid_len), src_valid_len)
        logits, named = [], {}
        for t in range(num_steps):
            Y, state = model.decoder(tgt[:, t:t + 1], state)
            logits.append(Y)
            named[f"encoder-decoder weights, step {t}"] = model.decoder.attention_weights[1][1]
        return torch.cat(logits, 1), named

    compare(run_both(seed, build, cell, inputs))
    # And predict_step itself runs, with the book's shapes of its saved weights.
    model = translation_model(QKV, src_vocab, tgt_vocab)
    model.eval()
    preds, weights = model.predict_step((src, tgt, src_valid_len, tgt), "cpu", num_steps, True)
    QKV.check_shape(preds, (4, num_steps))
    enc_weights = QKV.concat(model.encoder.attention_weights, 0).reshape(2, 4, -1, num_steps)
    QKV.check_shape(enc_weights, (2, 4, 4 * num_steps, num_steps))
    assert len(weights) == num_steps and weights[0][1][0].shape == (4 * 4, 1, num_steps)

"""The chapter's PyTorch code runs on qkv.torch with the book's classes replaced.

examples/book_examples.py is the book's code with `qkv.torch` in place of
d2l's attention classes. Checked here:
  - its printed toy results are the book's: additive and dot-product
    attention on the §11.3 toy data give [[2, 3, 4, 5]] and [[10, 11, 12, 13]]
    (uniform weights over 2 and 6 equal keys), with weights 1/2 and 1/6;
  - the masked softmax examples equal the book's masked_softmax (written from
    its formula in tests/peer/d2l_reference.py) on the same random scores;
  - §11.2's parametric Nadaraya-Watson training loop gives the same loss
    curve with qkv.torch.masked_softmax as with nn.functional.softmax (pure
    PyTorch), within float32 rounding (1e-5 relative) and, in float64, 1e-12.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import qkv.torch

SOURCE = os.environ.get("QKV_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(SOURCE, "examples"))
sys.path.insert(0, os.path.join(SOURCE, "tests", "peer"))
import book_examples  # noqa: E402
from d2l_reference import d2l_masked_softmax  # noqa: E402


@pytest.fixture(scope="module")
def printed():
    proc = subprocess.run([sys.executable, os.path.join(SOURCE, "examples", "book_examples.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def section(text, title):
    """The lines printed after `title` up to the next title line (one ending in ':')."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].endswith(":")), len(lines))
    return "\n".join(lines[start:end])


def numbers(text):
    """The numbers of a printed tensor, in order (its grad_fn left out)."""
    text = text.split("grad_fn")[0]
    return np.array([float(x) for x in re.findall(r"-?\d+\.\d*(?:e[-+]\d+)?", text)])


def test_toy_outputs_are_the_books(printed):
    # Uniform weights over 2 and 6 equal keys: the means of those values.
    books = [2, 3, 4, 5, 10, 11, 12, 13]
    for title in ("additive attention:", "scaled dot-product attention:"):
        got = numbers(section(printed, title))
        assert got.shape == (8,) and np.allclose(got, books, rtol=0, atol=1e-4), (title, got)


def test_multi_head_attention_gives_the_books_shape(printed):
    # §11.5's check_shape: (batch_size, num_queries, num_hiddens).
    assert section(printed, "multi-head attention, output shape:").strip() == "(2, 4, 100)"


def test_toy_weights_are_uniform_over_the_valid_keys(printed):
    got = numbers(section(printed, "its attention weights:")).reshape(2, 10)
    assert np.allclose(got[0], [0.5] * 2 + [0.0] * 8, atol=1e-4)
    assert np.allclose(got[1], [1 / 6] * 6 + [0.0] * 4, atol=1e-4)


def test_the_modules_give_the_toy_results():
    queries, keys = torch.normal(0, 1, (2, 1, 20)), torch.ones((2, 10, 2))
    values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
    lens = torch.tensor([2, 6])
    expected = torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])
    additive = qkv.torch.AdditiveAttention(2, 20, 8, 0.1).eval()
    # float32 sums of six terms weighted 1/6: within a few ulps of the means
    assert torch.allclose(additive(queries, keys, values, lens), expected, rtol=1e-6, atol=0)
    dot = qkv.torch.DotProductAttention(0.5).eval()
    assert torch.allclose(dot(queries[:, :, :2], keys, values, lens), expected, rtol=1e-6, atol=0)
    assert torch.equal(dot.attention_weights > 0,
                       torch.arange(10).reshape(1, 1, 10) < lens.reshape(2, 1, 1))


def test_masked_softmax_examples_match_the_books(printed, seed):
    torch.manual_seed(0)  # the script's draws, in its order
    x1, x2 = torch.rand(2, 2, 4), torch.rand(2, 2, 4)
    for x, lens, title in ((x1, torch.tensor([2, 3]), "masked softmax, valid_lens [2, 3]:"),
                           (x2, torch.tensor([[1, 3], [2, 4]]),
                            "masked softmax, valid_lens [[1, 3], [2, 4]]:")):
        got = qkv.torch.masked_softmax(x, lens)
        book = d2l_masked_softmax(x, lens)
        assert torch.allclose(got, book, rtol=1e-6, atol=1e-7), (got, book)
        assert section(printed, title) == str(got)
    # and on fresh scores of the same kind
    torch.manual_seed(seed)
    x = torch.rand(2, 2, 4)
    assert torch.allclose(qkv.torch.masked_softmax(x, torch.tensor([2, 3])),
                          d2l_masked_softmax(x, torch.tensor([2, 3])), rtol=1e-6, atol=1e-7)


# float32: the training amplifies rounding. Where the loss falls in one step
# (48 -> 15 at epoch 5 for some seeds) a difference of one ulp in w grows ~10x
# per epoch; over 300 seeds the curves differed by up to 2.4e-5 (relative) at
# epoch 5 while every single epoch's loss, at the same w, agreed within 3.1e-7
# (test_nadaraya_watson_loss_at_each_step_is_the_books holds that to 1e-5).
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.float64, 1e-12)])
def test_nadaraya_watson_training_gives_the_books_loss_curve(seed, dtype, rtol):
    book = book_examples.train_nadaraya_watson(lambda s: nn.functional.softmax(s, dim=1),
                                               seed=seed, dtype=dtype)
    ours = book_examples.train_nadaraya_watson(qkv.torch.masked_softmax, seed=seed, dtype=dtype)
    assert len(ours) == 5
    for epoch, (a, b) in enumerate(zip(ours, book), 1):
        assert abs(a - b) <= rtol * abs(b), f"epoch {epoch}: qkv {a!r}, book {b!r}"


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_nadaraya_watson_loss_at_each_step_is_the_books(seed, dtype, rtol):
    """The book's training loop with both softmaxes in lockstep: before each epoch
    qkv's model takes the book's w, so each loss compares one step, not a trajectory."""
    torch.manual_seed(seed)
    n = 50
    x, _ = torch.sort(torch.rand(n) * 5)
    y = 2 * torch.sin(x) + x ** 0.8 + torch.normal(0.0, 0.5, (n,))
    x, y = x.to(dtype), y.to(dtype)
    others = (1 - torch.eye(n)).type(torch.bool)
    keys = x.repeat((n, 1))[others].reshape((n, -1))
    values = y.repeat((n, 1))[others].reshape((n, -1))
    book = book_examples.NWKernelRegression(lambda s: nn.functional.softmax(s, dim=1)).to(dtype)
    ours = book_examples.NWKernelRegression(qkv.torch.masked_softmax).to(dtype)
    loss = nn.MSELoss(reduction="none")
    trainer = torch.optim.SGD(book.parameters(), lr=0.5)
    for epoch in range(1, 6):
        with torch.no_grad():
            ours.w.copy_(book.w)
        trainer.zero_grad()
        want = loss(book(x, keys, values), y).sum()
        want.backward()
        with torch.no_grad():
            got = loss(ours(x, keys, values), y).sum()
        assert abs(got.item() - want.item()) <= rtol * abs(want.item()), (
            f"epoch {epoch}, w {book.w.item()!r}: qkv {got.item()!r}, book {want.item()!r}")
        trainer.step()


def test_printed_training_matches_pure_pytorch(printed):
    book = book_examples.train_nadaraya_watson(lambda s: nn.functional.softmax(s, dim=1))
    lines = section(printed, "parametric Nadaraya-Watson, 5 epochs of SGD (lr 0.5):").splitlines()
    assert len(lines) == 5
    for epoch, (line, loss) in enumerate(zip(lines, book), 1):
        assert line.startswith(f"epoch {epoch}, loss ")
        assert abs(float(line.split()[-1]) - loss) <= 1e-5 * abs(loss) + 1e-6, (line, loss)

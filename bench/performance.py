#!/usr/bin/python3
"""The performance suite's driver: runs everything once and writes docs/performance.md.

In one run, one after another (never two at once): an OMP_WAIT_POLICY check
on three qkv ops; the roofline (bench/roofline.cc: the machine's roofs, i.e.
its float32 and float64 FMA peaks, bf16 dot-product and AMX peaks where the
CPU has them, read and copy bandwidth, and OpenBLAS sgemm as a second
reference); qkv's ops (bench/bench_perf.cc); the roofline's 2-thread figures
again; the book's PyTorch code on Debian's torch 1.13 (bench/perf_torch.py,
under /usr/bin/python3); torch 2.13's scaled_dot_product_attention on every
row that has a counterpart (bench/perf_torch2.py, in the project's venv,
--torch2-python). Then it draws docs/perf-scaling.png with gnuplot and
writes docs/performance.md from the measurements of this run alone: every
figure against the roof that bounds it (FMA peak, the bf16 path's peak,
read or copy bandwidth; sgemm in a second, labelled column), qkv / torch
2.13 on every comparable row and issue 31's targets against it. This script
is the single source of that page (edit here, not there).

bench/performance.sh builds the binaries (Release, build/perf), makes the
venv (scripts/make-venv.sh) and runs

  /usr/bin/python3 bench/performance.py --build build/perf --torch2-python build/venv/bin/python

Each SIMD target gets its own page: the best target of an AVX-512 machine
writes docs/performance.md, any other docs/performance-TARGET.md (with
docs/perf-scaling-TARGET.png). `--simd-target avx2` caps qkv
(QKV_SIMD_TARGET), OpenBLAS (OPENBLAS_CORETYPE) and PyTorch
(ATEN_CPU_CAPABILITY) at that instruction set, so an AVX-512 machine measures
what an AVX2-only one gets; its page is docs/performance-TARGET-capped.md, so
that it never replaces the page of a native run (an uncapped run on an
AVX2-only machine, docs/performance-avx2.md), and the two can be compared.

The raw results go to docs/perf-runs/KEY.json (KEY as the page's suffix; kept
with the pages); after a change to this script, `--replay
docs/perf-runs/KEY.json` rewrites the page and the figure from them without
measuring again (runs stored before the roofs and torch 2 were measured show
"–" there). Every page shows the roofs of every stored run and ends its
introduction with issue 14's targets for every stored run, a column each;
`--refresh-summary PAGE` rewrites only that part of an existing page. The
best-target page also carries docs/perf-findings.md (hand-written: the
profiles behind the figures).
"""

import argparse
import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20
GIB = 2 ** 30

# The OpenMP wait policy for every measured process (qkv and PyTorch alike).
# libgomp's default lets idle threads spin for a while before sleeping; with
# another process busy on one of the 2 cores that spinning steals the core a
# working thread needs (issue 2's note: threads:2 5-17x slower than threads:1).
# "passive" sleeps at once instead. The run re-measures both on three qkv ops
# and the page shows the result, so the choice can be checked on every run.
OMP_WAIT_POLICY = "passive"

# Valid lengths: drawn here, passed to both sides, so qkv and PyTorch mask the
# same keys. Uniform in [1, K].
LENS_SEED = 5
SDPA_BATCH, SDPA_N, DIM = 2, 4096, 64
SOFTMAX_BATCH, SOFTMAX_N = 32, 512
SWEEP = [512, 1024, 2048, 4096, 8192, 16384, 32768]
TORCH_MAX_GIB = 12.0
# What a SIMD cap means for the other two libraries measured: OpenBLAS's
# kernels for that instruction set, and PyTorch 1.13's ATen CPU capability
# ("default" is its SSE-level code).
OPENBLAS_CORETYPE = {"avx2": "Haswell", "sse4": "Nehalem", "scalar": "Prescott"}
ATEN_CPU_CAPABILITY = {"avx2": "avx2", "sse4": "default", "scalar": "default"}
RUNS_DIR = os.path.join(ROOT, "docs", "perf-runs")
# Hand-written: what the profiles found, carried into docs/performance.md.
FINDINGS = os.path.join(ROOT, "docs", "perf-findings.md")
# Hand-written: what was measured about issue 15's unmet rows.
TRANSFORMER_FINDINGS = os.path.join(ROOT, "docs", "perf-findings-transformer.md")

# A phase during which other processes kept more than this many cores busy
# (on average) marks the run as noisy.
NOISY_CORES = 0.15

# The ops compared in the OMP_WAIT_POLICY check (fast, medium, memory-bound).
# The two ceilings the targets use, measured again after the ops.
SQUARE_SGEMM = "BM_Sgemm/m:2048/n:2048/k:2048/trans_b:0/threads:2/split:{}"
CEILING_FILTER = ("^BM_Sgemm/m:2048/n:2048/k:2048/trans_b:0/threads:2/|"
                  "^BM_Stream(Copy.*|Read)/threads:2/|^BM_Peak[A-Za-z0-9]*/threads:2/")

# The machine's roofs (bench/roofline.cc), each the highest 2-thread figure of
# the two roofline runs (before and after the ops), so no "% of roof" is
# flattered: key -> (benchmarks, label, what it bounds: "flops" or "bytes").
ROOFS = {
    "fma32": (("BM_PeakFma32",), "float32 FMA peak", "flops"),
    "fma64": (("BM_PeakFma64",), "float64 FMA peak", "flops"),
    "bf16_dot": (("BM_PeakBf16Dot",), "bf16 dot-product peak (`vdpbf16ps`)", "flops"),
    "amx": (("BM_PeakAmxBf16",), "AMX bf16 peak (`tdpbf16ps`)", "flops"),
    "read": (("BM_StreamRead",), "read bandwidth (a sum)", "bytes"),
    "copy": (("BM_StreamCopy", "BM_StreamCopyNonTemporal"), "copy bandwidth (read + write)",
             "bytes"),
}
# Short names for "% of ..." cells.
ROOF_SHORT = {"fma32": "FMA peak", "fma64": "float64 FMA peak", "bf16_dot": "vdpbf16ps peak",
              "amx": "AMX peak", "read": "read", "copy": "copy"}
# The roof of qkv's bf16 products, by the path qkv took (`qkv info`'s "bf16
# products"): AMX tiles, AVX512_BF16 dot products, or widening to float32.
BF16_ROOF = {"amx": "amx", "avx512_bf16": "bf16_dot", "widen": "fma32"}
# The project's venv with the pinned torch 2 (scripts/make-venv.sh).
VENV_PYTHON = os.path.join(ROOT, "build", "venv", "bin", "python")
# The ops whose time goes through OpenBLAS (the float32 backward's products,
# float64 Nadaraya-Watson, the additive backward's projections), measured once
# per OpenBLAS core type (QKV_BLAS_CORE): the oldest kernels (what Debian's
# OpenBLAS runs on a CPU it does not know), Haswell's (AVX2), and qkv's choice.
BLAS_FILTER = ("^(sdpa_fwdbwd/fused/B2_N4096_nomask|mha_fwdbwd/fused/B2_H8_N4096|"
               "additive_fwdbwd/fused/B4_N512|nw_exact/fused/N30000)/")
BLAS_CORES = ("Prescott", "Haswell", None)
POLICY_FILTER = ("^(sdpa_fwd/fused/B2_N4096_nomask|additive_fwd/fused/B4_N512|"
                 "softmax_fwd/fused/B32_N512_lens)/")


def log(message):
    print(f"[performance] {message}", file=sys.stderr, flush=True)


# ---- running the benchmarks ------------------------------------------------------------

# The SIMD cap of this run (--simd-target), applied to every measured process.
SIMD_CAP = None


def measuring_env(policy, blas_core=None):
    env = dict(os.environ)
    for name in ("OMP_WAIT_POLICY", "QKV_NUM_THREADS", "QKV_SIMD_TARGET", "OPENBLAS_CORETYPE",
                 "ATEN_CPU_CAPABILITY", "QKV_BLAS_CORE"):
        env.pop(name, None)
    if blas_core:
        env["QKV_BLAS_CORE"] = blas_core
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    if SIMD_CAP:
        env["QKV_SIMD_TARGET"] = SIMD_CAP
        if SIMD_CAP in OPENBLAS_CORETYPE:
            env["OPENBLAS_CORETYPE"] = OPENBLAS_CORETYPE[SIMD_CAP]
            env["ATEN_CPU_CAPABILITY"] = ATEN_CPU_CAPABILITY[SIMD_CAP]
    return env


def run_gbench(binary, extra_args, repetitions, min_time, policy, work, tag, blas_core=None):
    """Runs a Google Benchmark binary; returns {name: median run} and its context."""
    out = os.path.join(work, f"{tag}.json")
    args = [binary, f"--benchmark_out={out}", "--benchmark_out_format=json",
            f"--benchmark_repetitions={repetitions}", "--benchmark_report_aggregates_only=true",
            f"--benchmark_min_time={min_time}"] + extra_args
    log(" ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in args)
        + f"   (OMP_WAIT_POLICY={policy or 'unset'}"
        + (f", QKV_BLAS_CORE={blas_core})" if blas_core else ")"))
    subprocess.run(args, check=True, env=measuring_env(policy, blas_core), stdout=sys.stderr)
    with open(out) as f:
        data = json.load(f)
    medians, errors = {}, {}
    for b in data["benchmarks"]:
        name = b["run_name"].removesuffix("/real_time")
        if b.get("error_occurred"):
            errors[name] = b.get("error_message", "error")
        elif b.get("run_type") == "aggregate" and b.get("aggregate_name") == "median":
            medians[name] = b
    for name, message in errors.items():
        medians[name] = {"error": message}
    return medians, data["context"]


def run_memory(bench_perf, lens_args, name, policy):
    """One op's peak memory beyond inputs and outputs, in a fresh bench_perf process."""
    proc = subprocess.run([bench_perf, f"--perf_memory={name}"] + lens_args, check=True,
                          env=measuring_env(policy), capture_output=True, text=True)
    result = json.loads(proc.stdout)
    log(f"memory {name}: {result}")
    return {"extra_bytes": result["extra_bytes"]} if "extra_bytes" in result else {}


def seconds_of(run):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[run["time_unit"]]
    return run["real_time"] * scale


def run_torch2(python, sdpa_lens, repetitions, min_time, policy, work):
    """torch 2's SDPA on the same rows (bench/perf_torch2.py, in the venv's Python)."""
    out = os.path.join(work, "torch2.json")
    args = [python, os.path.join(ROOT, "bench", "perf_torch2.py"),
            "--sdpa-lens", ",".join(map(str, sdpa_lens)), "--sweep", ",".join(map(str, SWEEP)),
            "--repeats", str(repetitions), "--min-time", str(min_time), "--threads", "2",
            "--out", out]
    log(f"{os.path.relpath(python, ROOT)} bench/perf_torch2.py ...")
    subprocess.run(args, check=True, env=measuring_env(policy))
    with open(out) as f:
        return json.load(f)


def run_torch(sdpa_lens, softmax_lens, repetitions, policy, work):
    out = os.path.join(work, "torch.json")
    args = ["/usr/bin/python3", os.path.join(ROOT, "bench", "perf_torch.py"),
            "--sdpa-lens", ",".join(map(str, sdpa_lens)),
            "--softmax-lens", ",".join(map(str, softmax_lens)),
            "--sweep", ",".join(map(str, SWEEP)), "--repeats", str(repetitions),
            "--threads", "2", "--max-gib", str(TORCH_MAX_GIB), "--out", out]
    log("/usr/bin/python3 bench/perf_torch.py ...")
    subprocess.run(args, check=True, env=measuring_env(policy))
    with open(out) as f:
        return json.load(f)


# ---- how busy the machine was -----------------------------------------------------------

def system_cpu_seconds():
    """CPU time all processes used so far (busy and stolen by the hypervisor), in seconds."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(x) for x in f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


class Phase:
    """Measures one phase: wall time, and the CPU other processes used meanwhile.

    Other processes' use = the whole system's busy CPU time minus this
    driver's and its (finished) children's, divided by the wall time: the
    average number of the 2 cores that something else kept busy.
    """

    def __init__(self, name, phases):
        self.name, self.phases = name, phases

    def __enter__(self):
        self.wall = time.monotonic()
        self.busy, self.steal = system_cpu_seconds()
        t = os.times()
        self.own = t.user + t.system + t.children_user + t.children_system
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.wall
        busy, steal = system_cpu_seconds()
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system - self.own
        self.phases.append({"name": self.name, "wall": wall,
                            "other_cores": max(0.0, (busy - self.busy - own) / wall),
                            "steal_cores": (steal - self.steal) / wall})
        return False


# ---- the machine ---------------------------------------------------------------------------

def machine_info():
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {}
    for line in lscpu.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = fields.get("Flags", "").split()
    with open("/proc/meminfo") as f:
        mem_total = int(f.readline().split()[1]) * 1024
    def dpkg_version(package):
        proc = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                              capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else "?"
    return {
        "model": fields.get("Model name", platform.processor() or "?"),
        "cores": os.cpu_count(),
        "hypervisor": fields.get("Hypervisor vendor", ""),
        "flags": {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")},
        "mem_gib": mem_total / GIB,
        "kernel": platform.release(),
        "gxx": subprocess.run(["g++", "--version"], capture_output=True,
                              text=True).stdout.splitlines()[0],
        "openblas_pkg": dpkg_version("libopenblas0-pthread"),
        "torch_pkg": dpkg_version("python3-torch"),
        "benchmark_pkg": dpkg_version("libbenchmark-dev"),
    }


# ---- formatting -----------------------------------------------------------------------------

def fmt_s(seconds):
    if seconds is None:
        return "–"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def fmt_bytes(n):
    if n is None:
        return "–"
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def fmt_x(ratio):
    return "–" if ratio is None else f"{ratio:.3g}×"


def fmt_pct(fraction):
    return "–" if fraction is None else f"{100 * fraction:.0f} %"


def fmt_g(rate):
    return "–" if rate is None else f"{rate / 1e9:.1f}"


def verdict(ok):
    if ok is None:
        return "**not measured**"
    return "met" if ok else "**not met**"


def ratio(a, b):
    return a / b if a is not None and b else None


# ---- the measurements, in one table of cases ------------------------------------------------

class Case:
    """One op and shape: qkv's figures, the d2l PyTorch code's and torch 2's SDPA's, from
    this run."""

    def __init__(self, qkv_run, torch_run, torch2_run=None):
        self.error = None
        self.seconds = self.flops = self.bytes_rate = self.extra = self.paired = None
        if qkv_run is not None and "error" in qkv_run:
            self.error = qkv_run["error"]
        elif qkv_run is not None:
            self.seconds = seconds_of(qkv_run)
            self.flops = qkv_run.get("FLOP/s") or None
            self.bytes_rate = qkv_run.get("bytes_per_second")
            # A paired op's medians (bench_perf.cc, time_op): the op and a plain read of
            # its bytes, timed in the same calls.
            self.paired = ({key: qkv_run[key] for key in
                            ("read_fraction", "read_bytes_per_second", "op_bytes_per_second")}
                           if "read_fraction" in qkv_run else None)
            # Whole pages (4 KiB) released during the call can make it slightly negative.
            self.extra = max(0, qkv_run["extra_bytes"]) if "extra_bytes" in qkv_run else None
        self.torch_seconds = self.torch_extra = self.torch_skipped = None
        if torch_run is not None and "skipped" in torch_run:
            self.torch_skipped = torch_run["skipped"]
        elif torch_run is not None:
            self.torch_seconds = torch_run["seconds"]
            self.torch_extra = max(0, torch_run["extra_bytes"])
        self.torch2_seconds = self.torch2_error = None
        if torch2_run is not None and "error" in torch2_run:
            self.torch2_error = torch2_run["error"]
        elif torch2_run is not None:
            self.torch2_seconds = torch2_run["seconds"]

    def torch_flops(self):
        """PyTorch's rate, counting the same flops as qkv's (valid keys only)."""
        if self.flops is None or self.torch_seconds is None:
            return None
        return self.flops * self.seconds / self.torch_seconds

    def speedup(self):
        """PyTorch time / qkv time."""
        return ratio(self.torch_seconds, self.seconds)

    def vs_torch2(self):
        """qkv / torch 2.13 as a speed ratio: torch 2's time over qkv's (> 1: qkv faster)."""
        return ratio(self.torch2_seconds, self.seconds)

    def torch2_rate(self, key):
        """torch 2's rate on the same work as qkv's ("flops" or "bytes")."""
        rate = self.flops if key == "flops" else self.bytes_rate
        if rate is None or self.torch2_seconds is None:
            return None
        return rate * self.seconds / self.torch2_seconds


# torch 2's implementation names (bench/perf_torch2.py) -> qkv's row they pair with.
TORCH2_IMPL = {"torch2_sdpa": "fused", "torch2_sdpa_bf16": "bf16"}


def collect(qkv, torch, torch2=None):
    """Every (op, impl, shape) measured, as Cases. torch2 is absent from runs stored
    before bench/perf_torch2.py existed."""
    torch2_results = (torch2 or {}).get("results", {})
    cases = {}
    keys = set()
    for name in list(qkv) + list(torch["results"]) + list(torch2_results):
        op, impl, shape = name.split("/")
        impl = {"d2l_torch": "fused", **TORCH2_IMPL}.get(impl, impl)
        keys.add((op, impl, shape))
    torch2_of = {qkv_impl: name for name, qkv_impl in TORCH2_IMPL.items()}
    for op, impl, shape in keys:
        torch2_run = (torch2_results.get(f"{op}/{torch2_of[impl]}/{shape}")
                      if impl in torch2_of else None)
        cases[(op, impl, shape)] = Case(
            qkv.get(f"{op}/{impl}/{shape}"),
            torch["results"].get(f"{op}/d2l_torch/{shape}") if impl == "fused" else None,
            torch2_run)
    return cases


# ---- the roofs ------------------------------------------------------------------------------

def measured_roofs(run):
    """The run's roofs: {key: rate or None} for ROOFS plus "sgemm" (the second reference),
    {key: why not} for those absent or not measured, and the bf16 products' path."""
    roof, roof_end = run["roof"], run["roof_end"]
    values, missing = {}, {}
    for key, (benches, _, unit) in ROOFS.items():
        counter = "FLOP/s" if unit == "flops" else "bytes_per_second"
        best, note = 0, "not measured in this run"
        for r in (roof, roof_end):
            for bench in benches:
                m = r.get(f"{bench}/threads:2")
                if m is not None and "error" in m:
                    note = m["error"]
                elif m is not None and m.get(counter):
                    best = max(best, m[counter])
        values[key] = best or None
        if not best:
            missing[key] = note
    values["sgemm"] = ceilings(roof, roof_end)[0] or None
    return {"values": values, "missing": missing, "bf16_path": run.get("bf16_products")}


def roof_key(op, impl, bf16_path):
    """The roof a row is bound by: decoding reads K and V (read); the masked softmax reads
    scores and writes weights, the traffic of a copy; the rest is arithmetic: float64
    FMA for Nadaraya-Watson, the bf16 path's peak for bf16 rows, float32 FMA otherwise."""
    if op in ("sdpa_decode", "gqa_decode"):
        return "read"
    if op == "softmax_fwd":
        return "copy"
    if op == "nw_exact":
        return "fma64"
    if impl == "bf16":
        return BF16_ROOF.get(bf16_path)
    return "fma32"


def of_roof(rate_flops, rate_bytes, key, roofs):
    """A rate as a fraction of roof `key` (None where either is missing)."""
    if key is None:
        return None
    rate = rate_bytes if ROOFS[key][2] == "bytes" else rate_flops
    return ratio(rate, roofs["values"].get(key))


def case_roof(case, op, impl, roofs):
    """(fraction of its roof, the roof's key) for qkv's figure of one row."""
    key = roof_key(op, impl, roofs["bf16_path"])
    return of_roof(case.flops, case.bytes_rate, key, roofs), key


def fmt_roof(fraction, key):
    """"72 % of FMA peak"; "–" where either is missing."""
    if fraction is None or key is None:
        return "–"
    return f"{fmt_pct(fraction)} of {ROOF_SHORT[key]}"


# ---- the page -----------------------------------------------------------------------------------

def fmt_rate(value, unit):
    if value is None:
        return "–"
    return f"{value / 1e9:.0f} GFLOP/s" if unit == "flops" else f"{value / 1e9:.1f} GB/s"


def roof_cell(run_roof, benches, threads, unit):
    """One roofline figure (the highest of benches) at a thread count, "absent" where the
    CPU lacks the instruction, "–" where it was not measured."""
    counter = "FLOP/s" if unit == "flops" else "bytes_per_second"
    best, absent, label = 0, False, ""
    for bench in benches:
        m = run_roof.get(f"{bench}/threads:{threads}")
        if m is None:
            continue
        if "error" in m:
            absent = absent or m["error"].startswith("absent")
        elif m.get(counter, 0) > best:
            best, label = m[counter], m.get("label", "")
    if best:
        return fmt_rate(best, unit) + (f" ({label})" if label and unit == "flops" else "")
    return "absent" if absent else "–"


def roofs_section(run, this_key):
    """The machine's roofs at the top of the page, this run's at 1 and 2 threads and every
    other stored run's at 2 threads ("–": that run predates the measurement)."""
    others = [(key, r) for key, r in stored_runs(this_key) if key != this_key]
    roofs = measured_roofs(run)
    header = "| roof | 1 thread | 2 threads: the roof used below |"
    rule = "|---|---|---|"
    for key, other in others:
        started = datetime.datetime.fromisoformat(other["started"])
        header += f" {run_label(other)}, {other['info']['model']}, {started:%Y-%m-%d}: 2 threads |"
        rule += "---|"
    lines = ["## The machine's roofs", "",
             "What this machine can do at most, measured in this run by bench/roofline.cc: "
             "compute peaks from loops whose operands never leave the registers (enough "
             "independent accumulators to cover the instruction's latency; OpenMP threads, "
             "each running the loop), and memory bandwidth over arrays far larger than the "
             "last-level cache. Every figure below is stated against the roof that bounds it: "
             "float32 kernels against the FMA peak, bf16 kernels against the peak of the path "
             f"qkv took (this run: **{roofs['bf16_path'] or 'not recorded'}**; AMX → AMX peak, "
             "avx512_bf16 → `vdpbf16ps` peak, widen → FMA peak), Nadaraya–Watson (float64) "
             "against the float64 FMA peak, decoding (reads K and V) against read bandwidth, "
             "the masked softmax (reads scores, writes weights) against copy bandwidth. "
             "OpenBLAS's `sgemm` stays as a second, labelled reference: a library's rate, not "
             "the machine's ceiling (an OpenBLAS that misreads the CPU runs its old kernels). "
             "\"absent\": the CPU lacks the instruction.", "", header, rule]
    for key, (benches, label, unit) in ROOFS.items():
        cells = [roof_cell(run["roof"], benches, 1, unit)]
        used = roofs["values"][key]
        cells.append(f"**{fmt_rate(used, unit)}**" if used else
                     roof_cell(run["roof"], benches, 2, unit))
        for _, other in others:
            value = measured_roofs(other)["values"][key]
            cells.append(fmt_rate(value, unit) if value else
                         roof_cell(other["roof"], benches, 2, unit))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    one_thread = run["roof"].get("BM_Sgemm/m:2048/n:2048/k:2048/trans_b:0/threads:1/split:0", {})
    sgemm = [fmt_rate(one_thread.get("FLOP/s"), "flops"),
             fmt_rate(roofs["values"]["sgemm"], "flops")]
    sgemm += [fmt_rate(measured_roofs(other)["values"]["sgemm"], "flops") for _, other in others]
    lines.append("| reference: OpenBLAS `sgemm`, square 2048, float32 | " + " | ".join(sgemm)
                 + " |")
    lines += ["", "2 threads: the highest of the roofline run before the ops and its re-check "
              "after them (the machine drifts), so no percentage below is flattered. The "
              "section \"Roofline\" further down has every figure (sgemm at the attention "
              "shapes, triad, both copies).", ""]
    return lines

def roofline_section(roof, roof_end, sgemm_rate, copy_rate):
    lines = ["## Roofline: every figure of bench/roofline.cc in this run", "",
             "The compute peaks and read and copy bandwidth are the roofs (table at the top); "
             "OpenBLAS `sgemm` is the second reference.", "",
             "OpenBLAS `sgemm` (row-major, float32, C = A·op(B)), median of the repetitions. "
             "\"OpenBLAS threads\" is one call with `openblas_set_num_threads(t)`; "
             "\"OpenMP split\" is how qkv uses the BLAS (src/kernels/runtime/blas.h): OpenBLAS "
             "single-threaded, the rows of C cut into one block per OpenMP thread.", "",
             "| shape m × n × k | 1 thread | 2 threads, OpenBLAS threads | "
             "2 threads, OpenMP split |", "|---|---|---|---|"]
    shapes = [((2048, 2048, 2048, 0), "2048 × 2048 × 2048 (square)"),
              ((2048, 2048, 64, 1), "2048 × 2048 × 64 (scores Q·Kᵀ, d = 64)"),
              ((2048, 64, 2048, 0), "2048 × 64 × 2048 (weights · V)")]
    for (m, n, k, t), label in shapes:
        cells = []
        for threads, split in ((1, 0), (2, 0), (2, 1)):
            run = roof.get(f"BM_Sgemm/m:{m}/n:{n}/k:{k}/trans_b:{t}/threads:{threads}/split:{split}")
            cells.append(f"{run['FLOP/s'] / 1e9:.0f} GFLOP/s" if run and "FLOP/s" in run else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Memory bandwidth, arrays of 512 MiB or 4× the last-level cache, whichever is "
              "larger (beyond every cache), each thread one contiguous slice; bytes counted as "
              "read + written (STREAM's convention):", "",
              "| kernel | 1 thread | 2 threads |", "|---|---|---|"]
    for bench, label in (("BM_StreamCopy", "copy, `std::copy` (8 bytes per float)"),
                         ("BM_StreamCopyNonTemporal", "copy, non-temporal AVX-512 stores"),
                         ("BM_StreamTriad", "triad a = b + s·c (12 bytes per float)"),
                         ("BM_StreamRead", "read alone, a sum (4 bytes per float)")):
        cells = []
        for threads in (1, 2):
            run = roof.get(f"{bench}/threads:{threads}")
            cells.append(f"{run['bytes_per_second'] / 1e9:.1f} GB/s"
                         if run and "bytes_per_second" in run else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    def cell(run, key, scale, unit):
        if run and key in run:
            return f"{run[key] / scale:.{0 if unit == 'GFLOP/s' else 1}f} {unit}"
        return "absent" if run and run.get("error", "").startswith("absent") else "–"
    lines += ["", "The 2-thread ceilings again, right after the qkv ops (the machine drifts):", "",
              "| ceiling | before the ops | after the ops |", "|---|---|---|"]
    for name, label, key, scale, unit in (
            ("BM_PeakFma32/threads:2", "float32 FMA peak", "FLOP/s", 1e9, "GFLOP/s"),
            ("BM_PeakFma64/threads:2", "float64 FMA peak", "FLOP/s", 1e9, "GFLOP/s"),
            ("BM_PeakBf16Dot/threads:2", "bf16 dot-product peak", "FLOP/s", 1e9, "GFLOP/s"),
            ("BM_PeakAmxBf16/threads:2", "AMX bf16 peak", "FLOP/s", 1e9, "GFLOP/s"),
            (SQUARE_SGEMM.format(0), "square sgemm, OpenBLAS threads", "FLOP/s", 1e9, "GFLOP/s"),
            (SQUARE_SGEMM.format(1), "square sgemm, OpenMP split", "FLOP/s", 1e9, "GFLOP/s"),
            ("BM_StreamCopy/threads:2", "copy, `std::copy`", "bytes_per_second", 1e9, "GB/s"),
            ("BM_StreamCopyNonTemporal/threads:2", "copy, non-temporal stores",
             "bytes_per_second", 1e9, "GB/s"),
            ("BM_StreamRead/threads:2", "read alone", "bytes_per_second", 1e9, "GB/s")):
        lines.append(f"| {label} | {cell(roof.get(name), key, scale, unit)} | "
                     f"{cell(roof_end.get(name), key, scale, unit)} |")
    lines += ["", f"The references used below beside the roofs: **sgemm rate = "
              f"{sgemm_rate / 1e9:.0f} GFLOP/s** (the highest 2-thread square-2048 figure, "
              "either way of threading, before or after; the bf16 rows' \"% of sgemm\" is "
              f"against the same float32 rate) and **copy bandwidth = {copy_rate / 1e9:.1f} "
              "GB/s** (the highest 2-thread copy).", ""]
    return lines


# The cases the targets name, by role.
TARGET_CASES = {
    "fwd": ("sdpa_fwd", "fused", "B2_N4096_nomask"),
    "fwd_lens": ("sdpa_fwd", "fused", "B2_N4096_lens"),
    "big": ("sdpa_fwd", "fused", "B1_N16384"),
    "fb": ("sdpa_fwdbwd", "fused", "B2_N4096_nomask"),
    "fb_lens": ("sdpa_fwdbwd", "fused", "B2_N4096_lens"),
    "bf16": ("sdpa_fwd", "bf16", "B2_N4096_nomask"),
    "dec": ("sdpa_decode", "fused", "B8_Nk131072"),
    "dec_bf16": ("sdpa_decode", "bf16", "B8_Nk131072"),
    "add_f": ("additive_fwd", "fused", "B4_N512"),
    "add_fb": ("additive_fwdbwd", "fused", "B4_N512"),
    "smax": ("softmax_fwd", "fused", "B32_N512_lens"),
    "nw": ("nw_exact", "fused", "N30000"),
}


def target_cases(cases):
    """The cases of TARGET_CASES (an empty Case where one was not measured)."""
    return {role: cases.get(key, Case(None, None)) for role, key in TARGET_CASES.items()}


def targets_section(cases, roofs, sgemm_rate, copy_rate, sdpa_lens, softmax_lens, simd_target):
    """The targets table; returns its lines, the number of targets met and of targets."""
    softmax_valid = sum(softmax_lens) / (len(softmax_lens) * SOFTMAX_N)
    t = target_cases(cases)
    fwd, fwd_lens, big, fb, fb_lens = t["fwd"], t["fwd_lens"], t["big"], t["fb"], t["fb_lens"]
    bf16, add_f, add_fb, smax, nw = t["bf16"], t["add_f"], t["add_fb"], t["smax"], t["nw"]

    def pct_of_sgemm(case):
        return ratio(case.flops, sgemm_rate)

    def against_roof(role):
        """"72 % of FMA peak": the role's case against its roof."""
        op, impl, _ = TARGET_CASES[role]
        return fmt_roof(*case_roof(t[role], op, impl, roofs))

    def at_least(value, bound):
        return None if value is None else value >= bound

    def qkv_cell(case, show_rate=True):
        if case.error:
            return f"error: {case.error}"
        if case.seconds is None:
            return "not measured"
        parts = [fmt_s(case.seconds)]
        if show_rate and case.flops:
            parts.append(f"{fmt_g(case.flops)} GFLOP/s")
        return ", ".join(parts)

    def torch_cell(case):
        if case.torch_skipped:
            return f"not run: {case.torch_skipped}"
        if case.torch_seconds is None:
            return "not measured"
        return f"{fmt_s(case.torch_seconds)}, {fmt_bytes(case.torch_extra)}"

    rows = []
    # 1. SDPA forward, no mask: efficiency.
    p = pct_of_sgemm(fwd)
    rows.append(("SDPA forward, B=2, Q=K=4096, d=64, no mask",
                 "≥ 60 % of the 2-thread square sgemm rate (≈ 3× PyTorch)",
                 qkv_cell(fwd), torch_cell(fwd),
                 f"{against_roof('fwd')}; {fmt_pct(p)} of sgemm (the target's reference); "
                 f"{fmt_x(fwd.speedup())} PyTorch", at_least(p, 0.60)))
    # 2. SDPA forward, random lengths: vs PyTorch.
    s = fwd_lens.speedup()
    valid = sum(sdpa_lens) / (len(sdpa_lens) * SDPA_N)
    rows.append((f"SDPA forward, same, random 1-D valid lengths {list(sdpa_lens)} "
                 f"({100 * valid:.0f} % of the keys valid)",
                 "≥ 10× PyTorch", qkv_cell(fwd_lens), torch_cell(fwd_lens),
                 f"{fmt_x(s)} PyTorch ({against_roof('fwd_lens')}, "
                 f"{fmt_pct(pct_of_sgemm(fwd_lens))} of sgemm)",
                 at_least(s, 10)))
    # 3. Memory at 16384.
    ok = None if big.extra is None else big.extra < 64 * MIB
    rows.append(("SDPA forward, B=1, Q=K=16384, d=64",
                 "peak memory < 64 MiB beyond inputs and output",
                 qkv_cell(big) + f", extra {fmt_bytes(big.extra)}", torch_cell(big),
                 f"{fmt_bytes(big.extra)} beyond inputs and output", ok))
    # 4. Forward + backward: efficiency without mask and speed-up with lengths.
    p, s = pct_of_sgemm(fb), fb_lens.speedup()
    ok = None if p is None or s is None else (p >= 0.40 and s >= 8)
    rows.append(("SDPA forward + backward, B=2, Q=K=4096, d=64",
                 "≥ 40 % of sgemm (14·B·Q·K·d flops), no mask; ≥ 8× PyTorch autograd with "
                 "random valid lengths",
                 f"no mask: {qkv_cell(fb)}; lengths: {qkv_cell(fb_lens)}",
                 f"no mask: {torch_cell(fb)}; lengths: {torch_cell(fb_lens)}",
                 f"{against_roof('fb')}; {fmt_pct(p)} of sgemm ({verdict(at_least(p, 0.40))}); "
                 f"{fmt_x(s)} PyTorch with lengths ({verdict(at_least(s, 8))})", ok))
    # 5. bf16 vs float32.
    s = ratio(fwd.seconds, bf16.seconds)
    rows.append(("SDPA bf16 forward, same shape (no mask)",
                 "≥ 1.6× faster than qkv's own float32", qkv_cell(bf16),
                 "–", f"{fmt_x(s)} qkv float32 ({fmt_s(fwd.seconds)}); {against_roof('bf16')}",
                 at_least(s, 1.6)))
    # 6. Additive forward.
    s = add_f.speedup()
    feature_bytes = 4 * 512 * 512 * 64 * 4
    no_buffer = None if add_f.extra is None else add_f.extra < feature_bytes
    ok = None if s is None or no_buffer is None else (s >= 30 and no_buffer)
    rows.append(("Additive forward, B=4, Q=K=512, q=k=h=64",
                 "≥ 30× the d2l PyTorch formulation, no (B,Q,K,h) buffer",
                 qkv_cell(add_f) + f", extra {fmt_bytes(add_f.extra)}", torch_cell(add_f),
                 f"{fmt_x(s)} PyTorch ({against_roof('add_f')}); extra memory "
                 f"{fmt_bytes(add_f.extra)} vs "
                 f"{fmt_bytes(feature_bytes)} for one (B,Q,K,h) float32 tensor", ok))
    # 7. Additive forward + backward.
    s = add_fb.speedup()
    rows.append(("Additive forward + backward, same", "≥ 20× PyTorch autograd",
                 qkv_cell(add_fb) + f", extra {fmt_bytes(add_fb.extra)}", torch_cell(add_fb),
                 f"{fmt_x(s)} PyTorch ({against_roof('add_fb')})", at_least(s, 20)))
    # 8. Masked softmax bandwidth.
    frac = ratio(smax.bytes_rate, copy_rate)
    rows.append((f"Masked softmax forward, (32, 512, 512), 1-D lens ({100 * softmax_valid:.0f} % "
                 "of the scores valid)",
                 "≥ 60 % of the stream copy bandwidth (8 bytes per element)",
                 qkv_cell(smax, show_rate=False) +
                 (f", {smax.bytes_rate / 1e9:.1f} GB/s" if smax.bytes_rate else ""),
                 torch_cell(smax),
                 f"{fmt_pct(frac)} of copy ({copy_rate / 1e9:.1f} GB/s); "
                 f"{fmt_x(smax.speedup())} PyTorch", at_least(frac, 0.60)))
    # 9. Nadaraya–Watson.
    s = nw.speedup()
    small = None if nw.extra is None else nw.extra < 64 * MIB
    ok = None if s is None or small is None else (s >= 50 and small)
    rows.append(("Nadaraya–Watson exact, 1-D, n = t = 30000 (qkv float64, PyTorch float32)",
                 "≥ 50× the d2l PyTorch formulation, memory O(n + t)",
                 qkv_cell(nw, show_rate=False) + f", extra {fmt_bytes(nw.extra)}",
                 torch_cell(nw),
                 f"{fmt_x(s)} PyTorch ({against_roof('nw')}); extra memory "
                 f"{fmt_bytes(nw.extra)} (one (t, n) float32 "
                 f"matrix: {fmt_bytes(30000 * 30000 * 4)})", ok))

    lines = ["## Issue 5's targets", "",
             "Every row of the targets table, from this run. \"qkv\" is the median time (and "
             "rate); \"PyTorch d2l\" is the median time and the peak memory beyond inputs and "
             "outputs. A target with two parts is met only if both are. Issue 5 set its "
             "efficiency bounds against OpenBLAS's `sgemm`; each row also gives the figure "
             "against its roof, first.", "",
             "| op and shape | target | qkv | PyTorch d2l | measured | met? |",
             "|---|---|---|---|---|---|"]
    for label, target, q, t, measured, ok in rows:
        lines.append(f"| {label} | {target} | {q} | {t} | {measured} | {verdict(ok)} |")
    met = sum(1 for r in rows if r[5])
    lines += ["", f"**{met} of {len(rows)} targets met in this run.**", ""]
    if not simd_target.startswith("avx512"):
        lines += ["Without AVX-512 BF16 (and at any SIMD target below avx512) qkv widens bf16 "
                  "tiles to float32 and runs the float32 products on them (docs/semantics.md), "
                  "so in this compute-bound shape the bf16 row measures float32 attention plus "
                  "the widening and cannot reach the 1.6× that the BF16 instructions give; "
                  "where attention is memory-bound (the decoding row of \"Every SIMD target\") "
                  "reading half the bytes pays.", ""]
    lines += floors_section([
        ("SDPA forward with random lengths", fwd_lens, 10),
        ("SDPA forward + backward with random lengths", fb_lens, 8)], roofs["values"]["fma32"])
    return lines, met, len(rows)


# ---- torch 2.13's SDPA, the peer (issue 31) --------------------------------------------------

# Every row with a torch 2 counterpart (bench/perf_torch2.py), in page order.
TORCH2_ROWS = [
    ("sdpa_fwd", "fused", "B2_N4096_nomask", "one head, B=2, N=4096, d=64, forward"),
    ("sdpa_fwd", "fused", "B2_N4096_lens", "same, random valid lengths (torch: a key mask)"),
    ("sdpa_fwd", "bf16", "B2_N4096_nomask", "same, bf16, no mask"),
    ("sdpa_fwd", "bf16", "B2_N4096_lens", "same, bf16, random valid lengths"),
    ("sdpa_fwdbwd", "fused", "B2_N4096_nomask", "one head, forward + backward"),
    ("sdpa_fwdbwd", "fused", "B2_N4096_lens", "same, random valid lengths"),
    ("mha_fwd", "fused", "B2_H8_N4096", "heads, B=2, H=8, N=4096, d=64, forward"),
    ("mha_fwd", "fused", "B2_H8_N4096_bnhd", "same, (B, N, H, d) memory viewed as heads"),
    ("mha_fwd", "fused", "B2_H8_N4096_causal", "same, causal"),
    ("mha_fwd", "fused", "B2_H8_N4096_mask", "same, random boolean (N, N) mask"),
    ("mha_fwd", "fused", "B2_H8_N4096_window256", "same, causal window of 256 keys (torch: a mask)"),
    ("mha_fwd", "fused", "B2_H8_N4096_bias", "same, float (N, N) bias"),
    ("mha_fwd", "fused", "B2_H8_N4096_d128", "heads, d=128, forward"),
    ("mha_fwd", "bf16", "B2_H8_N4096", "heads, d=64, bf16, forward"),
    ("mha_fwd", "bf16", "B2_H8_N4096_causal", "same, causal"),
    ("mha_fwd", "bf16", "B2_H8_N4096_d128", "heads, d=128, bf16, forward"),
    ("mha_fwdbwd", "fused", "B2_H8_N4096", "heads, d=64, forward + backward"),
    ("mha_fwdbwd", "fused", "B2_H8_N4096_causal", "same, causal"),
    ("mha_fwdbwd", "fused", "B2_H8_N4096_d128", "heads, d=128, forward + backward"),
    ("mha_fwdbwd", "bf16", "B2_H8_N4096", "heads, d=64, bf16, forward + backward"),
    ("mha_fwdbwd", "bf16", "B2_H8_N4096_d128", "heads, d=128, bf16, forward + backward"),
    ("sdpa_decode", "fused", "B8_Nk131072", "decoding, B=8, Nq=1, Nk=131072, d=64"),
    ("sdpa_decode", "bf16", "B8_Nk131072", "same, bf16"),
    ("gqa_decode", "fused", "B1_H32_Hkv8_Nk65536",
     "grouped-query decoding, B=1, H=32, Hkv=8, Nq=1, Nk=65536, d=128"),
    ("gqa_decode", "bf16", "B1_H32_Hkv8_Nk65536", "same, bf16"),
]

# Issue 31's targets: qkv / torch 2.13 (a speed ratio) on the run's machine.
TORCH2_TARGETS = [
    ("prefill float32 forward, d=64", ("mha_fwd", "fused", "B2_H8_N4096"), 1.5),
    ("prefill float32 forward, d=128", ("mha_fwd", "fused", "B2_H8_N4096_d128"), 1.5),
    ("prefill float32 forward + backward, d=64", ("mha_fwdbwd", "fused", "B2_H8_N4096"), 1.5),
    ("prefill float32 forward + backward, d=128",
     ("mha_fwdbwd", "fused", "B2_H8_N4096_d128"), 1.5),
    ("prefill bf16 forward, d=64", ("mha_fwd", "bf16", "B2_H8_N4096"), 1.2),
    ("prefill bf16 forward, d=128", ("mha_fwd", "bf16", "B2_H8_N4096_d128"), 1.2),
    ("prefill bf16 forward + backward, d=64", ("mha_fwdbwd", "bf16", "B2_H8_N4096"), 1.2),
    ("prefill bf16 forward + backward, d=128", ("mha_fwdbwd", "bf16", "B2_H8_N4096_d128"), 1.2),
    ("grouped-query decoding, float32", ("gqa_decode", "fused", "B1_H32_Hkv8_Nk65536"), 1.0),
    ("grouped-query decoding, bf16", ("gqa_decode", "bf16", "B1_H32_Hkv8_Nk65536"), 1.0),
]


def qkv_time(case):
    if case.error:
        return f"error: {case.error}"
    return "not measured" if case.seconds is None else fmt_s(case.seconds)


def torch2_time(case):
    if case.torch2_error:
        return f"error: {case.torch2_error}"
    return "not measured" if case.torch2_seconds is None else fmt_s(case.torch2_seconds)


def torch2_targets_section(cases, roofs, torch2_info):
    """Issue 31's targets table: qkv / torch 2.13 SDPA, met or not, with the figures."""
    version = torch2_info.get("torch", "2.13") if torch2_info else "2.13"
    lines = ["## Against torch 2.13's SDPA: the targets", "",
             f"qkv / torch {version} `scaled_dot_product_attention` (torch's time over qkv's: "
             "above 1, qkv is faster), both at 2 threads, from this run. Prefill is heads, "
             "B=2, H=8, N=4096, no mask; decoding one query per head against 65536 cached keys "
             "with 8 key/value heads (torch: `enable_gqa=True`). The bound is issue 31's.", "",
             "| target | bound | qkv | torch 2.13 | qkv / torch 2.13 | qkv % of roof | met? |",
             "|---|---|---|---|---|---|---|"]
    met = measured = 0
    for label, (op, impl, shape), bound in TORCH2_TARGETS:
        case = cases.get((op, impl, shape), Case(None, None))
        r = case.vs_torch2()
        ok = None if r is None else r >= bound
        measured += ok is not None
        met += bool(ok)
        lines.append(f"| {label} | ≥ {bound:g}× | {qkv_time(case)} | {torch2_time(case)} | "
                     f"{fmt_x(r)} | {fmt_roof(*case_roof(case, op, impl, roofs))} | "
                     f"{verdict(ok)} |")
    lines += ["", f"**{met} of {len(TORCH2_TARGETS)} targets met in this run**"
              + (f" ({len(TORCH2_TARGETS) - measured} not measured)."
                 if measured < len(TORCH2_TARGETS) else "."), ""]
    return lines


# Issue 31's decoding target: one query per head against a long cache reads K
# and V at this fraction of the read bandwidth measured in the same run.
DECODE_READ_BOUND = 0.80
DECODE_ROWS = (("float32", "fused"), ("bf16", "bf16"))
DECODE_SHAPE = "B1_H32_Hkv8_Nk65536"


def decode_roof_section(cases, roofs):
    """Grouped-query decoding against the read roof (issue 31's bound): paired with a plain
    read of the same K and V in the same calls (gqa_decode_paired), and against the
    roofline's read for reference."""
    read = roofs["values"].get("read")
    lines = ["## Decoding at the read roof", "",
             "One query per head against a long cache (B=1, H=32, Hkv=8, Nk=65536, d=128) "
             "reads each key and value once: its bound is read bandwidth. "
             f"Bound: ≥ {DECODE_READ_BOUND * 100:.0f} % of it. This machine's bandwidth "
             "drifts by tens of percent within minutes (a virtual machine on shared memory), "
             "so the bound is measured paired: each call of `gqa_decode_paired` (bench_perf.cc) "
             "first reads the same K and V with the roofline's plain read loop, then decodes "
             "them; the figure is the median over calls of read time / decoding time. The "
             "roofline's read, measured minutes apart on other memory "
             f"({fmt_rate(read, 'bytes')}), is shown for reference.", "",
             "| row | decoding (`gqa_decode`) | paired: decoding reads K and V at | "
             "paired: plain read of the same bytes | % of read, paired | "
             "% of the roofline's read | met? |",
             "|---|---|---|---|---|---|---|"]
    for label, impl in DECODE_ROWS:
        case = cases.get(("gqa_decode", impl, DECODE_SHAPE), Case(None, None))
        paired = cases.get(("gqa_decode_paired", impl, DECODE_SHAPE), Case(None, None)).paired
        fraction = paired["read_fraction"] if paired else None
        ok = None if fraction is None else fraction >= DECODE_READ_BOUND
        lines.append(
            f"| {label} | {qkv_time(case)} | "
            f"{fmt_rate(paired and paired['op_bytes_per_second'], 'bytes')} | "
            f"{fmt_rate(paired and paired['read_bytes_per_second'], 'bytes')} | "
            f"{fmt_pct(fraction)} | "
            f"{fmt_pct(case.bytes_rate / read if case.bytes_rate and read else None)} | "
            f"{verdict(ok)} |")
    lines.append("")
    return lines


# Issue 31's AMX targets: the fused AMX forward of bf16 attention (B=2, one
# head, N=4096) against the 2-thread AMX bf16 peak measured in the same run.
AMX_TARGETS = (("bf16 forward, B=2, N=4096, d=128", ("amx_fwd", "bf16", "B2_N4096_d128"), 0.25),
               ("bf16 forward, B=2, N=4096, d=64", ("amx_fwd", "bf16", "B2_N4096_d64"), 0.18))


def amx_section(cases, roofs):
    """The fused AMX forward against the AMX peak; on a CPU without AMX, what ran instead."""
    peak = roofs["values"].get("amx")
    path = roofs.get("bf16_path") or "?"
    lines = ["## AMX", ""]
    if peak:
        lines += ["bf16 attention's forward with its key loop fused on AMX tiles "
                  "(src/kernels/simd/amx_attention.cc) against this run's AMX bf16 peak "
                  f"({fmt_rate(peak, 'flops')}, 2 threads):", "",
                  "| row | bound | qkv | % of the AMX peak | met? |", "|---|---|---|---|---|"]
        for label, key, bound in AMX_TARGETS:
            case = cases.get(key, Case(None, None))
            fraction = case.flops / peak if case.flops else None
            ok = None if fraction is None else fraction >= bound
            lines.append(f"| {label} | ≥ {bound:.0%} | {qkv_time(case)} | {fmt_pct(fraction)} | "
                         f"{verdict(ok)} |")
    else:
        absent = roofs["missing"].get("amx", "absent")
        lines += [("This run did not measure an AMX peak"
                   if absent.startswith("not measured")
                   else "This CPU has no AMX (AMX-TILE and AMX-BF16)") + ", "
                  "so the AMX targets (the fused forward at ≥ 25 % of the AMX peak at d = 128, "
                  "≥ 18 % at d = 64) wait for a run on a CPU that has it. The AMX kernels run "
                  "in every machine's tests on the tile emulator (src/kernels/simd/"
                  f"amx_emulator.h). The same rows here ran the **{path}** path:", "",
                  "| row | qkv | rate | % of its path's roof |", "|---|---|---|---|"]
        for label, key, _ in AMX_TARGETS:
            case = cases.get(key, Case(None, None))
            lines.append(f"| {label} | {qkv_time(case)} | {fmt_rate(case.flops, 'flops')} | "
                         f"{fmt_roof(*case_roof(case, key[0], key[1], roofs))} |")
    lines.append("")
    return lines


def torch2_section(cases, roofs):
    """Every row with a torch 2 counterpart: both times, both against the row's roof."""
    lines = ["## Against torch 2.13's SDPA: every comparable row", "",
             "Both sides on the same shapes, masks and types (bench/perf_torch2.py: masks and "
             "valid lengths as SDPA's boolean `attn_mask`, the bias as a float one, causal as "
             "`is_causal=True`); torch's rate counts the same flops or bytes as qkv's, so both "
             "percentages are of the same roof (FMA peak for float32, the bf16 path's peak for "
             "bf16, read bandwidth for decoding; torch may take another bf16 path than qkv).",
             "", "| row | qkv | qkv % of roof | torch 2.13 | torch 2.13 % of roof | "
             "qkv / torch 2.13 |", "|---|---|---|---|---|---|"]
    for op, impl, shape, label in TORCH2_ROWS:
        case = cases.get((op, impl, shape), Case(None, None))
        fraction, key = case_roof(case, op, impl, roofs)
        torch_fraction = (of_roof(case.torch2_rate("flops"), case.torch2_rate("bytes"), key,
                                  roofs) if key else None)
        lines.append(f"| {label} | {qkv_time(case)} | {fmt_roof(fraction, key)} | "
                     f"{torch2_time(case)} | {fmt_roof(torch_fraction, key)} | "
                     f"{fmt_x(case.vs_torch2())} |")
    lines.append("")
    return lines


# Issue 15's rows (bench_perf.cc's heads_attention and gqa_decode): B=2, H=8,
# N=4096, d=64 float32 unless named; the fused kernels' tiles are 256 x 256.
MHA_N, MHA_TILE, MHA_WINDOW = 4096, 256, 256


def window_tiles_kept(n=MHA_N, tile=MHA_TILE, window=MHA_WINDOW):
    """The fraction of (query block, key block) tiles a causal window of `window`
    keys leaves some key in (the tiles the kernel computes)."""
    blocks = n // tile
    kept = 0
    for qb in range(blocks):
        first = max(0, qb * tile - (window - 1)) // tile
        kept += qb - first + 1
    return kept / (blocks * blocks)


def transformer_section(cases, roofs, sgemm_rate, copy_rate, read_rate, info, simd_target,
                        findings):
    """Issue 15's targets: heads, masks, a window, a bias, bf16 causal, GQA decoding."""
    def get(op, impl, shape):
        return cases.get((op, impl, shape), Case(None, None))

    shape = "B2_H8_N4096"
    plain, strided = get("mha_fwd", "fused", shape), get("mha_fwd", "fused", shape + "_bnhd")
    causal, mask = get("mha_fwd", "fused", shape + "_causal"), get("mha_fwd", "fused", shape + "_mask")
    window, bias = get("mha_fwd", "fused", shape + "_window256"), get("mha_fwd", "fused", shape + "_bias")
    fb, fb_causal = get("mha_fwdbwd", "fused", shape), get("mha_fwdbwd", "fused", shape + "_causal")
    bf16_causal = get("mha_fwd", "bf16", shape + "_causal")
    dec, dec_bf16 = (get("gqa_decode", impl, "B1_H32_Hkv8_Nk65536") for impl in ("fused", "bf16"))
    native_bf16 = bool(info["flags"].get("avx512_bf16")) and "avx512" in simd_target

    def seconds(case):
        if case.error:
            return f"error: {case.error}"
        return "not measured" if case.seconds is None else fmt_s(case.seconds)

    def torch_cell(case):
        if case.torch_skipped:
            return f"not run: {case.torch_skipped}"
        return "–" if case.torch_seconds is None else fmt_s(case.torch_seconds)

    def at_most(value, bound):
        return None if value is None else value <= bound

    def at_least(value, bound):
        return None if value is None else value >= bound

    def against_roof(case, op, impl):
        return fmt_roof(*case_roof(case, op, impl, roofs))

    rows = []
    p, s = ratio(causal.flops, sgemm_rate), ratio(plain.seconds, causal.seconds)
    ok = None if p is None or s is None else (p >= 0.80 and s >= 1.8)
    rows.append(("Causal forward", "≥ 80 % of sgemm on the lower triangle's flops; ≥ 1.8× "
                 "faster than qkv unmasked", seconds(causal), torch_cell(causal),
                 f"{against_roof(causal, 'mha_fwd', 'fused')}; {fmt_pct(p)} of sgemm; "
                 f"{fmt_x(s)} faster than unmasked "
                 f"({fmt_s(plain.seconds)}); {fmt_x(causal.speedup())} PyTorch", ok))
    p = ratio(fb_causal.flops, sgemm_rate)
    rows.append(("Causal forward + backward", "≥ 70 % of sgemm (14·d flops per kept pair)",
                 seconds(fb_causal), torch_cell(fb_causal),
                 f"{against_roof(fb_causal, 'mha_fwdbwd', 'fused')}; {fmt_pct(p)} of sgemm "
                 f"(unmasked: {fmt_pct(ratio(fb.flops, sgemm_rate))}); "
                 f"{fmt_x(fb_causal.speedup())} PyTorch", at_least(p, 0.70)))
    r = ratio(strided.seconds, plain.seconds)
    rows.append(("(B, N, H, d) memory read as heads (no copy)", "within 5 % of contiguous "
                 "(B, H, N, d)", seconds(strided), "–",
                 f"{fmt_x(r)} the contiguous time", at_most(r, 1.05)))
    r = ratio(mask.seconds, plain.seconds)
    rows.append(("Random boolean (N, N) mask, half the keys", "within 15 % of unmasked",
                 seconds(mask), torch_cell(mask),
                 f"{fmt_x(r)} the unmasked time; {fmt_x(mask.speedup())} PyTorch",
                 at_most(r, 1.15)))
    kept = window_tiles_kept()
    r = ratio(window.seconds, plain.seconds)
    per_tile = None if r is None else r / kept
    rows.append((f"Causal sliding window of {MHA_WINDOW} keys",
                 "time proportional to the tiles kept (≤ 1.25× the unmasked time per tile)",
                 seconds(window), torch_cell(window),
                 f"{fmt_x(r)} the unmasked time for {fmt_pct(kept)} of the tiles "
                 f"({per_tile:.2f}× per tile); {fmt_x(window.speedup())} PyTorch"
                 if per_tile is not None else "not measured", at_most(per_tile, 1.25)))
    r = ratio(bias.seconds, plain.seconds)
    rows.append(("Float (N, N) bias, broadcast over B and H", "within 20 % of unmasked",
                 seconds(bias), torch_cell(bias),
                 f"{fmt_x(r)} the unmasked time; {fmt_x(bias.speedup())} PyTorch",
                 at_most(r, 1.20)))
    r = ratio(causal.seconds, bf16_causal.seconds)
    rows.append(("bf16 causal forward", "≥ 1.8× qkv's float32 causal where the CPU has "
                 "AVX512-BF16", seconds(bf16_causal), "–",
                 f"{fmt_x(r)} float32 causal; {against_roof(bf16_causal, 'mha_fwd', 'bf16')} "
                 + ("(this run has AVX512-BF16)" if native_bf16
                    else "(no AVX512-BF16 in this run: the target does not apply)"),
                 at_least(r, 1.8) if native_bf16 else None))
    for label, case in (("float32", dec), ("bf16", dec_bf16)):
        f = ratio(case.bytes_rate, copy_rate)
        of_read = (f"{fmt_pct(ratio(case.bytes_rate, read_rate))} of read, "
                   if read_rate else "")
        rows.append((f"Decoding, B=1, H=32, Hkv=8, Nq=1, Nk=65536, d=128, {label}",
                     "≥ 70 % of the copy bandwidth on the bytes of K and V",
                     seconds(case), torch_cell(case) if label == "float32" else "–",
                     (f"{of_read}{fmt_pct(f)} of copy ({case.bytes_rate / 1e9:.1f} GB/s)"
                      if case.bytes_rate else "not measured")
                     + (f"; {fmt_x(case.speedup())} PyTorch" if label == "float32" else ""),
                     at_least(f, 0.70)))
    lines = ["## Transformer attention: heads, masks, bias, windows, decoding (issue 15)", "",
             f"Heads B=2, H=8, N={MHA_N}, d=64, float32 unless named, 2 threads; PyTorch is "
             "torch 2.x's documented math for `scaled_dot_product_attention` (Debian's torch "
             "1.13 has none): scores, `+= bias` or `masked_fill(-inf)`, softmax, `@ V`, key heads "
             "`repeat_interleave`d for grouped-query attention; torch 2.13's own "
             "`scaled_dot_product_attention` on these rows is in \"Against torch 2.13's SDPA\" "
             "above. FLOP/s count the kept (query, key) pairs only (causal: the lower "
             "triangle). Issue 15 set its bounds against `sgemm` and copy; the figure against "
             "the roof (FMA peak; read bandwidth for decoding) comes first.", "",
             "| Case | Target | qkv | PyTorch math | Measured | Verdict |", "|---|---|---|---|---|---|"]
    for label, target, q, t, measured, ok in rows:
        mark = "does not apply" if ok is None and "does not apply" in measured else verdict(ok)
        lines.append(f"| {label} | {target} | {q} | {t} | {measured} | {mark} |")
    met = sum(1 for r in rows if r[5])
    applicable = sum(1 for r in rows if r[5] is not None)
    lines += ["", f"**{met} of {applicable} applicable targets met in this run.**", "",
              "Peak memory beyond inputs and outputs, one fresh process per op:", "",
              "| Case | qkv | PyTorch math |", "|---|---|---|"]
    for label, case in (("unmasked forward", plain), ("(B, N, H, d) forward", strided),
                        ("causal forward", causal), ("random mask forward", mask),
                        ("window forward", window), ("bias forward", bias),
                        ("forward + backward", fb), ("causal forward + backward", fb_causal),
                        ("bf16 causal forward", bf16_causal), ("decoding float32", dec),
                        ("decoding bf16", dec_bf16)):
        torch_mem = (fmt_bytes(case.torch_extra) if case.torch_extra is not None
                     else ("not run" if case.torch_skipped else "–"))
        lines.append(f"| {label} | {fmt_bytes(case.extra)} | {torch_mem} |")
    lines.append("")
    if findings and os.path.exists(TRANSFORMER_FINDINGS):
        with open(TRANSFORMER_FINDINGS) as f:
            lines += [f.read().rstrip("\n"), ""]
    return lines


def floors_section(ratio_targets, peak):
    """For the speed-up targets: the best speed-up the work allows at the FMA peak.

    The flops are fixed by the op (valid keys only), so no kernel can take
    less than flops / the float32 FMA peak; PyTorch's time over that floor
    bounds the speed-up any implementation could show against it in this run.
    """
    lines = ["### The floor under the speed-up targets", "",
             "A speed-up over PyTorch is bounded by the work itself: the op's flops over the "
             "valid keys cannot run faster than this machine's float32 FMA peak, so PyTorch's "
             "time divided by that floor is the most any implementation could show in this "
             "run.", "",
             "| op | target | flops (valid keys) | floor at the FMA peak | PyTorch | "
             "best possible speed-up | qkv's speed-up (% of the FMA peak) |",
             "|---|---|---|---|---|---|---|"]
    for label, case, target in ratio_targets:
        if (case.flops is None or case.seconds is None or case.torch_seconds is None
                or not peak):
            lines.append(f"| {label} | ≥ {target}× | – | – | – | – | not measured |")
            continue
        flops = case.flops * case.seconds
        floor = flops / peak
        best = case.torch_seconds / floor
        lines.append(f"| {label} | ≥ {target}× | {flops / 1e9:.2f} GFLOP | {fmt_s(floor)} | "
                     f"{fmt_s(case.torch_seconds)} | {fmt_x(best)} | {fmt_x(case.speedup())} "
                     f"({fmt_pct(ratio(case.flops, peak))}) |")
    lines += ["", "Where the best possible speed-up is below the target, the target cannot be "
              "met on this machine with these lengths (drawn by this script, seed "
              f"{LENS_SEED}); qkv's percentage of the FMA peak is the figure that says how "
              "close it comes.", ""]
    return lines


def details_section(cases, roofs, sgemm_rate):
    order = [
        ("sdpa_fwd", "B2_N4096_nomask", "SDPA forward, B=2, N=4096, no mask"),
        ("sdpa_fwd", "B2_N4096_lens", "SDPA forward, B=2, N=4096, random lengths"),
        ("sdpa_fwdbwd", "B2_N4096_nomask", "SDPA fwd + bwd, B=2, N=4096, no mask"),
        ("sdpa_fwdbwd", "B2_N4096_lens", "SDPA fwd + bwd, B=2, N=4096, random lengths"),
        ("sdpa_fwd", "B1_N16384", "SDPA forward, B=1, N=16384, no mask"),
        ("sdpa_decode", "B8_Nk131072", "SDPA decoding, B=8, Nq=1, Nk=131072, d=64"),
        ("additive_fwd", "B4_N512", "additive forward, B=4, N=512, h=64"),
        ("additive_fwdbwd", "B4_N512", "additive fwd + bwd, B=4, N=512, h=64"),
        ("softmax_fwd", "B32_N512_lens", "masked softmax, (32, 512, 512), random lengths"),
        ("softmax_fwd", "B32_N512_nomask", "masked softmax, (32, 512, 512), no mask"),
        ("nw_exact", "N30000", "Nadaraya–Watson exact, n = t = 30000"),
    ]
    impl_label = {"fused": "qkv", "unfused_blas": "qkv reference-BLAS path",
                  "bf16": "qkv bf16", "fused_1thread": "qkv, 1 thread"}
    lines = ["## All measurements", "",
             "Medians. GFLOP/s count the flops of the valid keys only (formulas under "
             "Method); PyTorch's rate counts the same flops. \"% of roof\" is against the roof "
             "that bounds the row (table at the top); \"% of sgemm\" is the second reference, "
             "OpenBLAS's square `sgemm` (float32, also for bf16 rows). \"extra\" is the peak "
             "memory beyond inputs and outputs. Ratio to PyTorch d2l = its time / this row's "
             "time; qkv / torch 2.13 = torch 2.13 SDPA's time / this row's time.", "",
             "| op and shape | implementation | time | GFLOP/s | GB/s | % of roof | "
             "% of sgemm (reference) | extra memory | ratio to PyTorch d2l | "
             "qkv / torch 2.13 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for op, shape, label in order:
        base = cases.get((op, "fused", shape))
        for impl in ("fused", "fused_1thread", "unfused_blas", "bf16"):
            case = cases.get((op, impl, shape))
            if case is None:
                continue
            if case.error:
                lines.append(f"| {label} | {impl_label[impl]} | error: {case.error} "
                             "| | | | | | | |")
                continue
            speed = ratio(base.torch_seconds, case.seconds) if base else None
            lines.append(
                f"| {label} | {impl_label[impl]} | {fmt_s(case.seconds)} | {fmt_g(case.flops)} | "
                f"{'–' if not case.bytes_rate else f'{case.bytes_rate / 1e9:.1f}'} | "
                f"{fmt_roof(*case_roof(case, op, impl, roofs))} | "
                f"{fmt_pct(ratio(case.flops, sgemm_rate))} | {fmt_bytes(case.extra)} | "
                f"{fmt_x(speed)} | {fmt_x(case.vs_torch2())} |")
        if base is not None and (base.torch_seconds is not None or base.torch_skipped):
            if base.torch_skipped:
                lines.append(f"| {label} | PyTorch d2l | not run: {base.torch_skipped} "
                             "| | | | | | | |")
            else:
                rate = base.torch_flops()
                bytes_rate = (base.bytes_rate * base.seconds / base.torch_seconds
                              if base.bytes_rate else None)
                key = roof_key(op, "fused", roofs["bf16_path"])
                lines.append(
                    f"| {label} | PyTorch d2l | {fmt_s(base.torch_seconds)} | {fmt_g(rate)} | "
                    f"{'–' if bytes_rate is None else f'{bytes_rate / 1e9:.1f}'} | "
                    f"{fmt_roof(of_roof(rate, bytes_rate, key, roofs), key)} | "
                    f"{fmt_pct(ratio(rate, sgemm_rate))} | {fmt_bytes(base.torch_extra)} "
                    "| 1× | |")
    lines.append("")
    return lines


def sweep_rows(cases):
    rows = []
    for n in SWEEP:
        case = cases.get(("sdpa_fwd", "fused", f"B1_N{n}"), Case(None, None))
        io = 4 * n * DIM * 4  # Q, K, V and the output, float32
        rows.append((n, case, io))
    return rows


def sweep_section(cases, roofs, sgemm_rate, figure):
    lines = ["## Scaling: SDPA forward, B = 1, d = 64, no mask", "",
             "Time should grow as N² at constant efficiency and memory as N. \"peak\" is the "
             "whole footprint of the call: inputs + output (4·N·d floats) + the extra memory.", "",
             f"![time and peak memory against N, log-log]({figure})", "",
             "| N | qkv time | qkv GFLOP/s | % of FMA peak | % of sgemm | qkv extra | qkv peak | "
             "PyTorch d2l time | PyTorch d2l GFLOP/s | PyTorch d2l extra | PyTorch d2l peak | "
             "ratio to d2l | torch 2.13 SDPA time | qkv / torch 2.13 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    stopped = None
    for n, case, io in sweep_rows(cases):
        if case.torch_skipped:
            torch_cells = f"not run: {case.torch_skipped} | | | |"
            stopped = stopped or (n, case.torch_skipped)
        elif case.torch_seconds is None:
            torch_cells = "– | – | – | –"
        else:
            torch_cells = (f"{fmt_s(case.torch_seconds)} | {fmt_g(case.torch_flops())} | "
                           f"{fmt_bytes(case.torch_extra)} | {fmt_bytes(case.torch_extra + io)}")
        torch2_cells = f"{fmt_s(case.torch2_seconds)} | {fmt_x(case.vs_torch2())}"
        if case.error:
            lines.append(f"| {n} | error: {case.error} | | | | | | {torch_cells} | | "
                         f"{torch2_cells} |")
            continue
        lines.append(
            f"| {n} | {fmt_s(case.seconds)} | {fmt_g(case.flops)} | "
            f"{fmt_pct(ratio(case.flops, roofs['values']['fma32']))} | "
            f"{fmt_pct(ratio(case.flops, sgemm_rate))} | {fmt_bytes(case.extra)} | "
            f"{fmt_bytes(None if case.extra is None else case.extra + io)} | {torch_cells} | "
            f"{fmt_x(case.speedup())} | {torch2_cells} |")
    lines.append("")
    if stopped:
        lines += [f"PyTorch stops at N = {stopped[0]}: {stopped[1]}. perf_torch.py estimates "
                  "each N's need as 4× the previous N's measured peak (the d2l formulation "
                  f"holds several N × N float32 matrices) and skips sizes above {TORCH_MAX_GIB:g} "
                  "GiB, so the run cannot push the machine (shared with other work) into swap "
                  "or the OOM killer.", ""]
    else:
        biggest = max((c.torch_extra + io for _, c, io in sweep_rows(cases)
                       if c.torch_extra is not None), default=None)
        if biggest is not None:
            lines += [f"PyTorch ran at every N: its largest footprint was {fmt_bytes(biggest)}, "
                      f"within the {TORCH_MAX_GIB:g} GiB perf_torch.py allows (it estimates each "
                      "N's need as 4× the previous N's measured peak and would skip sizes above "
                      "that, so the run cannot push the shared machine into the OOM killer).", ""]
    return lines


def draw_figure(cases, path, work):
    """docs/perf-scaling.png: time and peak memory against N, log-log, with N² and N guides."""
    data = os.path.join(work, "sweep.dat")
    with open(data, "w") as f:
        f.write("# N qkv_s torch_s qkv_peak_MiB torch_peak_MiB torch2_s\n")
        for n, case, io in sweep_rows(cases):
            def num(x):
                return "NaN" if x is None else repr(x)
            f.write(f"{n} {num(case.seconds)} {num(case.torch_seconds)} "
                    f"{num(None if case.extra is None else (case.extra + io) / MIB)} "
                    f"{num(None if case.torch_extra is None else (case.torch_extra + io) / MIB)} "
                    f"{num(case.torch2_seconds)}\n")
    measured = [(n, c, io) for n, c, io in sweep_rows(cases) if c.seconds is not None]
    if not measured:
        return False
    n_ref, c_ref, io_ref = measured[-1]
    time_ref = f"{c_ref.seconds!r} * (x / {n_ref}.0)**2"
    mem_ref = f"{(c_ref.extra + io_ref) / MIB!r} * (x / {n_ref}.0)"
    # torch 2's line only where it was measured (runs stored before perf_torch2.py lack it).
    torch2_plot = (f'     "{data}" using 1:6 with linespoints lw 2 pt 9 title "torch 2.13 SDPA", \\\n'
                   if any(c.torch2_seconds is not None for _, c, _ in sweep_rows(cases)) else "")
    script = f"""
set terminal pngcairo size 1300,520 font "DejaVu Sans,11"
set output "{path}"
set datafile missing "NaN"
set multiplot layout 1,2 title "SDPA forward, B = 1, d = 64, float32, 2 threads (one run of bench/performance.sh)"
set logscale xy
set xtics (512, 1024, 2048, 4096, 8192, 16384, 32768)
set xrange [400:40000]
set grid
set key top left
set xlabel "N = Q = K"
set ylabel "time (s)"
set format y "10^{{%L}}"
plot "{data}" using 1:2 with linespoints lw 2 pt 7 title "qkv fused", \\
     "{data}" using 1:3 with linespoints lw 2 pt 5 title "PyTorch d2l", \\
{torch2_plot}     {time_ref} with lines dt 2 lc rgb "gray40" title "∝ N² (through qkv's largest N)"
set ylabel "peak memory: inputs + output + extra (MiB)"
set format y "%g"
plot "{data}" using 1:4 with linespoints lw 2 pt 7 title "qkv fused", \\
     "{data}" using 1:5 with linespoints lw 2 pt 5 title "PyTorch d2l", \\
     {mem_ref} with lines dt 2 lc rgb "gray40" title "∝ N (through qkv's largest N)"
unset multiplot
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    return True


def blas_section(blas_runs, info):
    """The ops that go through OpenBLAS, at each of its core types (QKV_BLAS_CORE)."""
    if not blas_runs:
        return []
    cores = list(blas_runs)
    chosen = info.get("blas_core", "?")
    lines = ["## OpenBLAS's kernels", "",
             "OpenBLAS picks its kernels (a core type) once, as it loads; Debian 12's 0.3.21 "
             "does not know CPUs newer than itself and runs its SSE3 kernels (Prescott) on "
             "them. qkv switches OpenBLAS to the best core type the CPU runs when OpenBLAS "
             "chose an older one (`qkv info`, docs/cli.md). The ops whose time goes through "
             "OpenBLAS, in this run, with OpenBLAS held at each core type by `QKV_BLAS_CORE` "
             f"(qkv's choice on this machine: **{chosen}**; "
             f"OpenBLAS itself chose {info.get('blas_core_found', '?')}, from "
             f"{info.get('blas_core_from', '?')}):", "",
             "| op | " + " | ".join(cores) + " | " + " | ".join(
                 f"{c} / qkv's choice" for c in cores[:-1]) + " |",
             "|---|" + "---|" * (2 * len(cores) - 1)]
    names = sorted(set().union(*(set(r) for r in blas_runs.values())))
    for name in names:
        runs = [blas_runs[c].get(name) for c in cores]
        if any(r is None or "error" in r for r in runs):
            continue
        times = [seconds_of(r) for r in runs]
        lines.append(f"| {name} | " + " | ".join(fmt_s(t) for t in times) + " | "
                     + " | ".join(f"{t / times[-1]:.2f}×" for t in times[:-1]) + " |")
    lines.append("")
    return lines


def policy_section(policy_runs):
    lines = ["## OMP_WAIT_POLICY", "",
             f"Every measured process ran with `OMP_WAIT_POLICY={OMP_WAIT_POLICY}` (qkv and "
             "PyTorch alike). libgomp's default lets idle threads spin before sleeping; with "
             "anything else running on one of the 2 cores that spinning takes the core a "
             "working thread needs (issue 2 saw 2 threads run 5–17× slower than 1). The run "
             "re-checks the choice on three qkv ops (medians, this run):", "",
             "| op | default (unset) | passive | passive / default |", "|---|---|---|---|"]
    default, passive = policy_runs
    ratios = []
    for name in sorted(set(default) | set(passive)):
        a, b = default.get(name), passive.get(name)
        if not a or not b or "error" in a or "error" in b:
            continue
        ta, tb = seconds_of(a), seconds_of(b)
        lines.append(f"| {name} | {fmt_s(ta)} | {fmt_s(tb)} | {tb / ta:.3f} |")
        ratios.append(tb / ta)
    lines.append("")
    if ratios:
        lines += [f"In this run passive took {min(ratios):.2f}–{max(ratios):.2f}× the default's "
                  "time. On an idle machine the two should be close (waking a sleeping thread "
                  "costs microseconds per parallel region); if passive is consistently slower "
                  "there, change OMP_WAIT_POLICY in bench/performance.py.", ""]
    return lines


def method_section(sdpa_lens, softmax_lens, repetitions):
    return [
        "## Method", "",
        f"- **Timing.** Google Benchmark, real time, `--benchmark_repetitions={repetitions}`, "
        "medians; each repetition runs the op for at least 0.5 s (or once if one call takes "
        "longer). PyTorch: one warm-up, then the median of "
        f"{repetitions} runs (`time.perf_counter`). qkv runs with `qkv::set_num_threads(2)` "
        "unless the row says 1 thread; PyTorch with `torch.set_num_threads(2)`. The qkv side and "
        "the PyTorch side run one after the other, never at once.",
        "- **FLOP counts** (over valid keys only; L_b = the valid length, N for no mask): SDPA "
        "forward 4·d·Σ_b Q·L_b (Q·Kᵀ and W·V, d = dv); forward + backward 14·d·Σ_b Q·L_b "
        "(backward: recompute Q·Kᵀ, then dV, dW, dQ, dK); additive forward "
        "B·Q·K·(4h + 2dv) + 2·B·(Q+K)·d·h (feature add, tanh counted as 1, w_v product, W·V; "
        "the two projections), forward + backward adds B·Q·K·(11h + 4dv) + 4·B·(Q+K)·d·h; "
        "masked softmax is rated in bytes: 8 per element of (B, Q, K) (one read, one write), "
        "counted over every element as the target does, although masked scores are not read. "
        "Nadaraya–Watson: 6 per (query, key) pair, float64 (difference, square, exp counted "
        "as 1, the sum of weights, the weighted sum).",
        "- **Masked softmax** uses qkv's write-into form (`masked_softmax(scores, lens, "
        "weights)` into a buffer allocated once): the op is memory-bound and a fresh result per "
        "call would add page faults to a figure of a few milliseconds. PyTorch's formulation allocates its "
        "result (and, with lengths, its masks) on every call, as d2l's code does.",
        "- **Peak memory beyond inputs and outputs.** Inputs are allocated and touched first; "
        "then `malloc_trim(0)` (free heap pages back to the kernel, so reused memory is counted "
        "again), `5` written to `/proc/self/clear_refs` (resets VmHWM to the current RSS), one "
        "call of the op, and extra = VmHWM − VmRSS at the reset − bytes of every tensor the op "
        "returned (output; for backward rows also lse and the gradients). qkv: in a fresh "
        "process per op (`bench_perf --perf_memory=NAME`), because qkv keeps per-thread "
        "scratch between calls and a warm-up call of the op would make it resident before the "
        "reset; a generic warm-up first starts the OpenMP threads and gives each an OpenBLAS "
        "buffer, so what the figure adds beyond the op's own memory is its code pages (a few "
        "hundred KiB). PyTorch: on every run after a warm-up, median. Transient buffers "
        "freed before the output is allocated only count where they exceed it; PyTorch's "
        "module-held `attention_weights` (d2l keeps them) count as extra.",
        f"- **Valid lengths.** Drawn by bench/performance.py (NumPy `default_rng({LENS_SEED})`, "
        f"uniform in [1, K]) and passed to both sides: SDPA {list(sdpa_lens)}; masked softmax "
        f"{list(softmax_lens)}.",
        "- **qkv reference-BLAS path.** The unfused composition built in bench_perf.cc: the "
        "(B, Q, K) scores by `cblas_sgemm` (scale as alpha; with lengths only the first L_b "
        "columns), `qkv::masked_softmax` in place, `cblas_sgemm` with V; OpenBLAS "
        "single-threaded, rows split over 2 OpenMP threads; the scores buffer allocated per call.",
        "- **bf16.** Q, K, V converted to bfloat16 once, outside the timing; "
        "`qkv::scaled_dot_product_attention(ConstView<bfloat16>…)` returns float32.",
        "- **Decoding.** One query per sequence against a cache of 131072 keys and values "
        "(B = 8, d = Dv = 64, no mask), float32 and bf16 inputs; GB/s count the bytes of K "
        "and V read per call (4 or 2 per element), rated against read bandwidth.",
        "- **The roofs** (bench/roofline.cc). Compute peaks: each OpenMP thread runs a loop of "
        "one instruction on independent accumulators that never leave the registers (16 "
        "AVX-512 or 12 AVX2 vectors for `vfmadd` and `vdpbf16ps`, enough to cover a 4-cycle "
        "latency on 2 ports; 4 AMX accumulator tiles fed by 2 + 2 operand tiles for "
        "`tdpbf16ps`, palette 1, 16 rows × 64 bytes); FLOPs 2 per lane of an FMA, 64 per "
        "`vdpbf16ps` (16 lanes × 2 products × 2), 16·16·32·2 per `tdpbf16ps`. The float32 "
        "peak uses AVX-512 where the CPU has it, else AVX2 + FMA, chosen at run time "
        "(`__builtin_cpu_supports`), so one binary runs everywhere. Bandwidth: arrays of "
        "512 MiB or 4× the last-level cache, whichever is larger; read = a sum (bytes read), "
        "copy = `std::copy` or non-temporal stores (bytes read + written, as STREAM counts). "
        "Nadaraya–Watson counts 6 flops per (query, key) pair (difference, square, exp as 1, "
        "the two sums) against the float64 FMA peak (before this was measured, stored runs "
        "rate it by time only).",
        "- **torch 2.13's SDPA** (bench/perf_torch2.py, in the venv's Python, never in the "
        "process of Debian's torch 1.13): `torch.nn.functional.scaled_dot_product_attention` "
        "with `torch.set_num_threads(2)` on fresh N(0, 1) inputs of each row's shape and type "
        "(bf16 inputs give torch a bf16 output, qkv a float32 one); valid lengths and masks as "
        "a boolean `attn_mask` (True: the key takes part), the bias as a float `attn_mask`, "
        "causal as `is_causal=True`, grouped-query decoding with `enable_gqa=True`, the "
        "strided row as a transposed view of (B, N, H, d) memory. Forward under "
        "`torch.no_grad()`; forward + backward as the forward and `torch.autograd.grad` of "
        "q, k, v. Timing as Google Benchmark's for qkv: one warm-up call, then "
        f"{repetitions} repetitions, each the mean of as many calls as fill 0.5 s (at least "
        "one), median.",
        "- **The d2l formulations** (bench/perf_torch.py) are the book's code as written: "
        "`masked_softmax` via `sequence_mask` with the −1e6 sentinel (which writes into its "
        "argument), `DotProductAttention` with `torch.bmm`, `AdditiveAttention` with "
        "`nn.Linear(bias=False)` and `features = queries.unsqueeze(2) + keys.unsqueeze(1)`, "
        "Nadaraya–Watson as `softmax(-(X_repeat - x_train)**2 / 2) @ y_train` (h = 1), dropout 0, "
        "float32; eval mode under `torch.no_grad()` for forwards, `out.backward(d_out)` for "
        "forward + backward (gradients of queries, keys, values and, for additive, the three "
        "weight matrices — the same set qkv returns). qkv's Nadaraya–Watson is float64 "
        "(`KernelRegression::predict(queries, /*exact=*/true)`, Gaussian, h = 1, the chapter's "
        "data).", ""]


def ceilings(roof, roof_end):
    """The sgemm rate and copy bandwidth the targets use: the highest 2-thread figure of
    the two roofline runs (before and after the ops), so no % of them is flattered."""
    runs = (roof, roof_end)
    sgemm = max(r.get(SQUARE_SGEMM.format(split), {}).get("FLOP/s", 0)
                for r in runs for split in (0, 1))
    copy = max(r.get(f"{b}/threads:2", {}).get("bytes_per_second", 0)
               for r in runs for b in ("BM_StreamCopy", "BM_StreamCopyNonTemporal"))
    return sgemm, copy


def read_bandwidth(roof, roof_end):
    """The highest 2-thread read-alone bandwidth of the two roofline runs; 0 for a run
    recorded before bench/roofline measured it."""
    return max(r.get("BM_StreamRead/threads:2", {}).get("bytes_per_second", 0)
               for r in (roof, roof_end))


# ---- the other SIMD targets' runs ------------------------------------------------------------

SUMMARY_START = "<!-- other SIMD targets: generated by bench/performance.py -->"
SUMMARY_END = "<!-- end of other SIMD targets -->"


def run_key(simd_target, simd_cap):
    """The name of a run's page and raw results: its SIMD target, "-capped" when an
    AVX-512 machine was capped there (so a capped run never replaces a native one)."""
    return simd_target + ("-capped" if simd_cap else "")


def page_paths(key):
    """The page and the figure of a run (run_key)."""
    if key.startswith("avx512") and not key.endswith("-capped"):
        return (os.path.join(ROOT, "docs", "performance.md"),
                os.path.join(ROOT, "docs", "perf-scaling.png"))
    return (os.path.join(ROOT, "docs", f"performance-{key}.md"),
            os.path.join(ROOT, "docs", f"perf-scaling-{key}.png"))


# Issue 14's targets, the same on every SIMD target, as ratios to the run's own
# ceilings: (label, the figure's description, bound).
CROSS_TARGETS = [
    ("SDPA fwd, B=2, N=4096, no mask", "% of sgemm", 0.75),
    ("SDPA fwd + bwd, same", "% of sgemm", 0.65),
    ("masked softmax (32, 512, 512), lens", "% of copy", 0.75),
    ("additive fwd, B=4, N=512", "× PyTorch", 50),
    ("NW exact, n = t = 30000", "× PyTorch", 50),
    ("bf16 SDPA fwd vs float32", "× float32", 1.0),
    ("bf16 SDPA decoding, B=8, Nq=1, Nk=131072, vs float32", "× float32", 1.3),
]


def cross_target_figures(run):
    """The figures of CROSS_TARGETS for one stored run, in that order (None: not measured)."""
    cases = collect(run["qkv"], run["torch"], run.get("torch2"))
    sgemm_rate, copy_rate = ceilings(run["roof"], run["roof_end"])
    t = target_cases(cases)
    return [ratio(t["fwd"].flops, sgemm_rate), ratio(t["fb"].flops, sgemm_rate),
            ratio(t["smax"].bytes_rate, copy_rate), t["add_f"].speedup(), t["nw"].speedup(),
            ratio(t["fwd"].seconds, t["bf16"].seconds),
            ratio(t["dec"].seconds, t["dec_bf16"].seconds)]


def roof_figure(op, impl, shape):
    """A summary cell: qkv's row as a percentage of its roof."""
    def figure(cases, roofs):
        case = cases.get((op, impl, shape))
        if case is None:
            return "–"
        return fmt_pct(case_roof(case, op, impl, roofs)[0])
    return figure


def torch2_figure(op, impl, shape):
    """A summary cell: qkv / torch 2.13 on one row."""
    def figure(cases, roofs):
        case = cases.get((op, impl, shape))
        return "–" if case is None else fmt_x(case.vs_torch2())
    return figure


# Rows of the every-target summary stated against the roofs and torch 2 (no bound).
ROOF_FIGURES = [
    ("SDPA fwd, B=2, N=4096, no mask: % of the FMA peak",
     roof_figure("sdpa_fwd", "fused", "B2_N4096_nomask")),
    ("SDPA fwd + bwd, same: % of the FMA peak",
     roof_figure("sdpa_fwdbwd", "fused", "B2_N4096_nomask")),
    ("bf16 SDPA fwd, same: % of its path's peak",
     roof_figure("sdpa_fwd", "bf16", "B2_N4096_nomask")),
    ("GQA decoding, float32: % of read bandwidth",
     roof_figure("gqa_decode", "fused", "B1_H32_Hkv8_Nk65536")),
    ("heads fwd, B=2, H=8, N=4096, d=64: qkv / torch 2.13 SDPA",
     torch2_figure("mha_fwd", "fused", "B2_H8_N4096")),
]


def run_label(run):
    if run.get("simd_cap"):
        return f"{run['simd_target']}, capped on an AVX-512 CPU"
    return f"{run['simd_target']}, native (the CPU's best)"


def stored_runs(this_key):
    """Every run stored in docs/perf-runs/ as (key, run): this page's first, then the
    others by name."""
    runs = []
    for raw in sorted(glob.glob(os.path.join(RUNS_DIR, "*.json"))):
        with open(raw) as f:
            run = json.load(f)
        # Other benchmarks keep their results here too (index.json, scale.json, ...):
        # a performance run is one with the roofline's figures.
        if run.get("simd_target") and "roof" in run:
            runs.append((run_key(run["simd_target"], run.get("simd_cap")), run))
    runs.sort(key=lambda kr: (kr[0] != this_key, kr[0]))
    return runs


def summary_section(this_key):
    """Issue 14's targets for every stored run (this page's and the other SIMD targets'),
    a column each, between markers."""
    runs = stored_runs(this_key)
    lines = [SUMMARY_START, "", "## Every SIMD target", ""]
    if not any(key != this_key for key, _ in runs):
        lines += ["No run at another SIMD target is stored in docs/perf-runs/.", ""]
        return lines + findings_lines(this_key) + [SUMMARY_END, ""]
    header, rule = "| target (issue 14) |", "|---|"
    for key, run in runs:
        page = os.path.basename(page_paths(key)[0])
        started = datetime.datetime.fromisoformat(run["started"])
        name = "this page" if key == this_key else f"[{page}]({page})"
        header += f" {run_label(run)}: {name}, {run['info']['model']}, {started:%Y-%m-%d} |"
        rule += "---|"
    lines += ["The same command at each SIMD target, one column per stored run "
              "(docs/perf-runs/), each figure against that run's own ceilings (its sgemm rate "
              "and copy bandwidth, last row), so columns from different machines compare; the "
              "linked page has every figure. Issue 14 asks every target to reach the bounds "
              "below."]
    if not any(key == this_key for key, _ in runs):
        lines[-1] += (" This page's own run is not stored (it predates docs/perf-runs/), so "
                      "its column is missing here; the next run of the command adds it.")
    lines += ["", header, rule]
    figures = [cross_target_figures(run) for _, run in runs]
    for row, (label, unit, bound) in enumerate(CROSS_TARGETS):
        is_pct = unit.startswith("%")
        cells = []
        for col in figures:
            value = col[row]
            text = fmt_pct(value) if is_pct else fmt_x(value)
            met = value is not None and value >= bound
            cells.append(text if met or value is None else f"**{text}**")
        want = f"≥ {bound * 100:.0f} {unit}" if is_pct else f"≥ {bound:g}{unit}"
        lines.append(f"| {label}: {want} | " + " | ".join(cells) + " |")
    met_row = []
    for col in figures:
        met = sum(1 for (_, _, bound), v in zip(CROSS_TARGETS, col)
                  if v is not None and v >= bound)
        met_row.append(f"{met} of {len(CROSS_TARGETS)}")
    lines.append("| targets met | " + " | ".join(met_row) + " |")
    # The same runs against the machine's roofs (issue 31): "–" for a run stored before
    # bench/roofline.cc measured the peaks (or torch 2).
    for label, figure in ROOF_FIGURES:
        cells = []
        for _, run in runs:
            cases, roofs = collect(run["qkv"], run["torch"], run.get("torch2")), measured_roofs(run)
            cells.append(figure(cases, roofs))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ceiling_row = []
    for _, run in runs:
        sgemm_rate, copy_rate = ceilings(run["roof"], run["roof_end"])
        ceiling_row.append(f"{sgemm_rate / 1e9:.0f} GFLOP/s, {copy_rate / 1e9:.1f} GB/s")
    lines.append("| ceilings: sgemm, copy | " + " | ".join(ceiling_row) + " |")
    roof_row = []
    for _, run in runs:
        values = measured_roofs(run)["values"]
        roof_row.append(f"{fmt_rate(values['fma32'], 'flops')}, {fmt_rate(values['read'], 'bytes')}")
    lines.append("| roofs: float32 FMA peak, read | " + " | ".join(roof_row) + " |")
    lines += ["", "Bold: below the bound. \"bf16 vs float32\" is qkv's float32 time over its "
              "bf16 time on the same shape (decoding: one query per sequence against 131072 "
              "cached keys and values, d = 64, memory-bound). [performance.md](performance.md)'s section "
              "\"Without AVX-512: where the time goes\" says how close a capped run comes to a "
              "native one and what the AVX2 profiles found.", ""]
    return lines + findings_lines(this_key) + [SUMMARY_END, ""]


def findings_lines(this_key):
    """docs/perf-findings.md, on the best target's page only."""
    if page_paths(this_key)[0] != page_paths("avx512")[0] or not os.path.exists(FINDINGS):
        return []
    with open(FINDINGS) as f:
        return [f.read().rstrip("\n"), ""]


def refresh_summary(page):
    """Rewrites only the other-targets summary of an existing page (before "## How to read
    this" if the page has none yet); its target is read from the page's own line."""
    with open(page) as f:
        text = f.read()
    match = re.search(r"^- SIMD target: `?([a-z0-9_]+)`? \((capped)?", text, re.M)
    this_key = run_key(match.group(1), match.group(2)) if match else "avx512"
    block = "\n".join(summary_section(this_key))
    if SUMMARY_START in text:
        head, rest = text.split(SUMMARY_START, 1)
        tail = rest.split(SUMMARY_END, 1)[1].lstrip("\n")
        text = head + block + "\n" + tail
    else:
        head, tail = text.split("## How to read this", 1)
        text = head + block + "\n## How to read this" + tail
    with open(page, "w") as f:
        f.write(text)


def run_section(phases):
    lines = ["How busy the machine was: for each phase, the average number of the 2 cores that "
             "other processes kept busy (the system's CPU time from /proc/stat minus this run's "
             "own), and the CPU time the hypervisor stole.", "",
             "| phase | wall time | other processes (cores) | stolen (cores) |",
             "|---|---|---|---|"]
    for ph in phases:
        lines.append(f"| {ph['name']} | {fmt_s(ph['wall'])} | {ph['other_cores']:.2f} | "
                     f"{ph['steal_cores']:.2f} |")
    lines.append("")
    return lines


def write_page(path, run, cases, have_figure, figure):
    info, roof_context, torch_info = run["info"], run["roof_context"], run["torch"]["info"]
    torch2_info = run.get("torch2", {}).get("info", {})
    roof, roof_end, policy_runs = run["roof"], run["roof_end"], run["policy_runs"]
    sdpa_lens, softmax_lens, repetitions = run["sdpa_lens"], run["softmax_lens"], run["repetitions"]
    started = datetime.datetime.fromisoformat(run["started"])
    finished = datetime.datetime.fromisoformat(run["finished"])
    duration, build_seconds, loads, phases = (run["duration"], run["build_seconds"], run["loads"],
                                              run["phases"])
    simd_target, simd_cap = run["simd_target"], run.get("simd_cap")
    this_key = run_key(simd_target, simd_cap)
    roofs = measured_roofs(run)
    sgemm_rate, copy_rate = ceilings(roof, roof_end)
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["flags"].items())
    total = duration + (build_seconds or 0)
    busiest = max(phases, key=lambda ph: ph["other_cores"] + ph["steal_cores"])
    noisy = busiest["other_cores"] + busiest["steal_cores"] > NOISY_CORES
    lines = [
        "# Performance", "",
        "<!-- Generated by bench/performance.py from one run of bench/performance.sh; "
        "do not edit by hand: change the generator and re-run. -->", "",
        "How fast qkv's kernels run on this machine, all measured in one run of one command "
        f"(`bench/performance.sh`), with qkv's kernels on the **{simd_target}** SIMD target: "
        "each figure against the machine's own roof (its float32 FMA, bf16 and AMX peaks and "
        "its read and copy bandwidth, measured by loops that do nothing else; OpenBLAS's "
        "`sgemm` stays as a second, labelled reference), against torch 2.13's "
        "`scaled_dot_product_attention` (what a PyTorch user would call instead) wherever it "
        "has a counterpart, and against the PyTorch code of the book *Dive into Deep "
        "Learning* (d2l) on Debian's torch 1.13, the formulations qkv's API follows.", "",
    ]
    if noisy:
        lines += [f"> **Noisy run.** Other processes kept on average "
                  f"{busiest['other_cores'] + busiest['steal_cores']:.2f} of the 2 cores busy "
                  f"during \"{busiest['name']}\" (table under Machine and run). Ceilings and ops "
                  "were measured at different moments of that contention, so the percentages and "
                  "ratios below are not reliable; re-run `bench/performance.sh` on an idle "
                  "machine.", ""]
    lines += roofs_section(run, this_key)
    lines += torch2_targets_section(cases, roofs, torch2_info)
    lines += summary_section(this_key)
    lines += [
        "## How to read this", "",
        "Each figure is a median from this run alone; nothing is carried over from another run. "
        "Rates are relative to the same run's roofs, because this virtual machine drifts "
        "(±30 % between runs is normal), so a percentage of a roof (or a ratio to torch 2.13 "
        "from the same run) is the figure to compare across runs, not a time. FLOP/s count only the "
        "keys a query may attend to (a kernel that skips masked keys gets no credit for work it "
        "did not need), and PyTorch's rates count the same flops, so its rate with lengths is "
        "the useful work per second of the dense formulation. \"Extra memory\" is what the op "
        "needed at its peak beyond its inputs and outputs. \"Not met\" means not met in this "
        "run, with the numbers beside it. Check the busy-machine table under Machine and run "
        "first: the targets are meant for an otherwise idle machine.", "",
        "## Machine and run", "",
        f"- CPU: {info['model']}, {info['cores']} cores"
        f"{' (' + info['hypervisor'] + ' virtual machine)' if info['hypervisor'] else ''}; "
        f"{flags}; {info['mem_gib']:.0f} GiB RAM; Linux {info['kernel']}.",
        f"- OpenBLAS: {roof_context.get('openblas_config', '?')} (Debian package "
        f"{info['openblas_pkg']}); Google Benchmark {info['benchmark_pkg']}; {info['gxx']}.",
        f"- PyTorch {torch_info.get('torch', '?')} (Debian python3-torch {info['torch_pkg']}), "
        f"NumPy {torch_info.get('numpy', '?')}, Python {torch_info.get('python', '?')}, "
        f"{torch_info.get('threads', '?')} threads (the d2l rows).",
        f"- torch {torch2_info.get('torch', '(not run)')} from the registry, in the project's "
        f"venv (scripts/make-venv.sh), ATen CPU capability "
        f"{torch2_info.get('cpu_capability', '?')}, {torch2_info.get('threads', '?')} threads "
        "(the torch 2.13 SDPA rows).",
        f"- qkv's bf16 products: `{roofs['bf16_path'] or 'not recorded'}` (`qkv info`).",
        f"- Date: {started:%Y-%m-%d %H:%M} to {finished:%H:%M} (local time). The measurements "
        f"took {duration / 60:.1f} min"
        + (f"; with the build, the command took {total / 60:.1f} min" if build_seconds else "")
        + f". 1-minute load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end.",
        f"- SIMD target: `{simd_target}` "
        + (f"(capped with `--simd-target {simd_cap}`: `QKV_SIMD_TARGET={simd_cap}`"
           + (f", `OPENBLAS_CORETYPE={OPENBLAS_CORETYPE[simd_cap]}`, "
              f"`ATEN_CPU_CAPABILITY={ATEN_CPU_CAPABILITY[simd_cap]}`"
              if simd_cap in OPENBLAS_CORETYPE else "") + ")"
           if simd_cap else "(the best this CPU supports; no cap)") + ".",
        f"- `OMP_WAIT_POLICY={OMP_WAIT_POLICY}` (see below); 2 threads on both sides.", "",
    ]
    lines += run_section(phases)
    command = "bench/performance.sh" + (f" --simd-target {simd_cap}" if simd_cap else "")
    lines += ["Command (configures and builds a Release tree in build/perf, then runs the "
              "driver):", "",
              "<!-- not run: runs every benchmark above and regenerates this page; "
              "tests/docs/test_doc_examples.py does not time things -->",
              "```", command, "```", ""]
    lines += torch2_section(cases, roofs)
    lines += decode_roof_section(cases, roofs)
    lines += amx_section(cases, roofs)
    lines += targets_section(cases, roofs, sgemm_rate, copy_rate, sdpa_lens, softmax_lens,
                             simd_target)[0]
    # The hand-written findings were measured at avx512: on that page only.
    best_page = page_paths(this_key)[0] == page_paths("avx512")[0]
    lines += transformer_section(cases, roofs, sgemm_rate, copy_rate,
                                 read_bandwidth(roof, roof_end), info, simd_target, best_page)
    lines += roofline_section(roof, roof_end, sgemm_rate, copy_rate)
    lines += details_section(cases, roofs, sgemm_rate)
    lines += sweep_section(cases, roofs, sgemm_rate, os.path.basename(figure))
    if not have_figure:
        lines += ["(No figure: no sweep point was measured.)", ""]
    lines += blas_section(run.get("blas_runs"), run.get("blas_core") or {})
    lines += policy_section(policy_runs)
    lines += method_section(sdpa_lens, softmax_lens, repetitions)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build", "perf"),
                        help="build tree with bench/roofline and bench/bench_perf")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.5,
                        help="seconds per Google Benchmark repetition")
    parser.add_argument("--simd-target", default=None, metavar="TARGET",
                        help="cap qkv, OpenBLAS and PyTorch at this SIMD target (avx2, sse4, ...)")
    parser.add_argument("--out", default=None,
                        help="the page (default: by SIMD target, see above)")
    parser.add_argument("--figure", default=None,
                        help="the figure (default: by SIMD target, see above)")
    parser.add_argument("--torch2-python", default=VENV_PYTHON,
                        help="the Python with torch 2.13 for bench/perf_torch2.py "
                             "(default: the project's venv, build/venv/bin/python)")
    parser.add_argument("--build-seconds", type=float, default=None,
                        help="how long the build took (performance.sh passes it)")
    parser.add_argument("--raw", default=None,
                        help="where to keep the raw results (default BUILD/performance-raw.json)")
    parser.add_argument("--replay", default=None, metavar="RAW_JSON",
                        help="do not measure: rewrite the page and figure from a saved run")
    parser.add_argument("--refresh-summary", default=None, metavar="PAGE",
                        help="do not measure: rewrite the other-targets summary of PAGE")
    args = parser.parse_args()
    global SIMD_CAP
    SIMD_CAP = args.simd_target

    if args.refresh_summary:
        refresh_summary(args.refresh_summary)
        log(f"rewrote the other-targets summary of {args.refresh_summary}")
        return 0
    if args.replay:
        with open(args.replay) as f:
            run = json.load(f)
    else:
        run = measure(args)
        os.makedirs(RUNS_DIR, exist_ok=True)
        key = run_key(run["simd_target"], run.get("simd_cap"))
        args.raw = args.raw or os.path.join(RUNS_DIR, f"{key}.json")
        with open(args.raw, "w") as f:
            json.dump(run, f, indent=1)
    page, figure = page_paths(run_key(run["simd_target"], run.get("simd_cap")))
    args.out = args.out or page
    args.figure = args.figure or figure
    render(run, args)
    log(f"wrote {os.path.relpath(args.out, ROOT)} and {os.path.relpath(args.figure, ROOT)}; "
        f"the measurements took {run['duration'] / 60:.1f} min (raw results: "
        f"{os.path.relpath(args.replay or args.raw, ROOT)})")
    return 0


def measure(args):
    """Runs every benchmark once, in sequence; returns everything the page needs."""
    start_time = time.monotonic()
    started = datetime.datetime.now()
    load_start = os.getloadavg()[0]
    info = machine_info()
    rng = np.random.default_rng(LENS_SEED)
    sdpa_lens = [int(x) for x in rng.integers(1, SDPA_N, size=SDPA_BATCH, endpoint=True)]
    softmax_lens = [int(x) for x in rng.integers(1, SOFTMAX_N, size=SOFTMAX_BATCH, endpoint=True)]
    roofline = os.path.join(args.build, "bench", "roofline")
    bench_perf = os.path.join(args.build, "bench", "bench_perf")
    lens_args = ["--perf_sdpa_lens=" + ",".join(map(str, sdpa_lens)),
                 "--perf_softmax_lens=" + ",".join(map(str, softmax_lens))]
    if not os.access(args.torch2_python, os.X_OK):
        sys.exit(f"performance.py: no Python at {args.torch2_python} for torch 2.13's SDPA: "
                 "make the venv with scripts/make-venv.sh (bench/performance.sh does) or pass "
                 "--torch2-python")

    phases = []
    with tempfile.TemporaryDirectory(prefix="qkv_perf_") as work:
        with Phase("idle check (driver asleep 5 s)", phases):
            time.sleep(5)
        with Phase("OMP_WAIT_POLICY check", phases):
            policy_runs = [
                run_gbench(bench_perf, lens_args + [f"--benchmark_filter={POLICY_FILTER}"],
                           args.repetitions, args.min_time, policy, work, f"policy_{policy}")[0]
                for policy in (None, "passive")]
        with Phase("OpenBLAS core types (QKV_BLAS_CORE)", phases):
            blas_runs = {
                core or "qkv's choice": run_gbench(
                    bench_perf, lens_args + [f"--benchmark_filter={BLAS_FILTER}"],
                    args.repetitions, args.min_time, OMP_WAIT_POLICY, work,
                    f"blas_{core or 'auto'}", blas_core=core)[0]
                for core in BLAS_CORES}
        with Phase("roofline", phases):
            roof, roof_context = run_gbench(roofline, [], args.repetitions, args.min_time,
                                            OMP_WAIT_POLICY, work, "roofline")
        with Phase("qkv ops (bench_perf)", phases):
            qkv, qkv_context = run_gbench(bench_perf, lens_args, args.repetitions,
                                          args.min_time, OMP_WAIT_POLICY, work, "bench_perf")
        with Phase("qkv peak memory (one process per op)", phases):
            for name, result in qkv.items():
                # A paired op times a read beside the op: its memory is gqa_decode's.
                if "error" not in result and not name.startswith("gqa_decode_paired/"):
                    result.update(run_memory(bench_perf, lens_args, name, OMP_WAIT_POLICY))
        # The ceilings again right after the ops: the machine drifts.
        with Phase("roofline re-check", phases):
            roof_end, _ = run_gbench(roofline, [f"--benchmark_filter={CEILING_FILTER}"],
                                     args.repetitions, args.min_time, OMP_WAIT_POLICY, work,
                                     "roofline_end")
        with Phase("PyTorch d2l (perf_torch.py, Debian's torch 1.13)", phases):
            torch = run_torch(sdpa_lens, softmax_lens, args.repetitions, OMP_WAIT_POLICY, work)
        with Phase("torch 2.13 SDPA (perf_torch2.py, the venv)", phases):
            torch2 = run_torch2(args.torch2_python, sdpa_lens, args.repetitions, args.min_time,
                                OMP_WAIT_POLICY, work)

    return {"info": info, "roof_context": roof_context, "roof": roof, "roof_end": roof_end,
            "qkv": qkv, "torch": torch, "torch2": torch2, "policy_runs": policy_runs,
            "blas_runs": blas_runs,
            "blas_core": {key: qkv_context.get(key)
                          for key in ("blas_core", "blas_core_found", "blas_core_from")},
            "sdpa_lens": sdpa_lens, "bf16_products": qkv_context.get("bf16_products"),
            "softmax_lens": softmax_lens, "repetitions": args.repetitions,
            "started": started.isoformat(), "finished": datetime.datetime.now().isoformat(),
            "duration": time.monotonic() - start_time, "build_seconds": args.build_seconds,
            "loads": [load_start, os.getloadavg()[0]], "phases": phases,
            "simd_target": qkv_context["simd_target"], "simd_cap": SIMD_CAP}


def render(run, args):
    """docs/perf-scaling.png and docs/performance.md from one run's results."""
    cases = collect(run["qkv"], run["torch"], run.get("torch2"))
    with tempfile.TemporaryDirectory(prefix="qkv_perf_plot_") as work:
        have_figure = draw_figure(cases, args.figure, work)
    write_page(args.out, run, cases, have_figure, args.figure)


if __name__ == "__main__":
    sys.exit(main())

"""A/B of two builds of the kernels in one process: the fp32 step and the streaming limit of
build A against build B on the same kind of data, paired (median over passes of the ratio of
A's time to B's within a pass), so that a kernel or thread-pool change is judged without the
VM's bandwidth drift between two runs.

    python bench/ab_builds.py A_DIR B_DIR [--isa avx2] [--passes 60]

A_DIR/B_DIR: JIT build folders (~/.cache/torch_extensions/offload_adam_C_<key>, or $TORCH_EXTENSIONS_DIR/..., made
by importing offload_adam from each checkout); their modules have different names, so both
load side by side.
"""

import argparse
import importlib.util
import random
import statistics
import time
from pathlib import Path

import torch

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def load(folder: str):
    d = Path(folder)
    so = next(d.glob(d.name + ".*.so"), None) or d / (d.name + ".so")
    spec = importlib.util.spec_from_file_location(d.name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--isa", default="avx2")
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    builds = {"A": load(a.a), "B": load(a.b)}
    n = a.numel // a.tensors

    def data():
        return ([torch.randn(n) for _ in range(a.tensors)], [torch.randn(n) * 1e-3 for _ in range(a.tensors)],
                [torch.zeros(n) for _ in range(a.tensors)], [torch.zeros(n) for _ in range(a.tensors)],
                [torch.tensor(0.0) for _ in range(a.tensors)])

    def step(K, d):
        p, g, m, v, steps = d
        K.set_isa(a.isa)
        K.adam_step(p, g, m, v, [], [], steps, LR, *BETAS, EPS, WD, True, False, 1.0, a.threads)

    def limit(K, d):
        p, g, m, v, _ = d
        K.set_isa(a.isa)
        K.stream_limit(p, g, m, v, [], a.threads)

    runs = {f"{b} {what}": (builds[b], fn, data()) for b in builds for what, fn in (("step", step), ("limit", limit))}
    for K, fn, d in runs.values():
        fn(K, d)
    times = {k: [] for k in runs}
    for _ in range(a.passes):
        for k in random.sample(list(runs), len(runs)):
            K, fn, d = runs[k]
            t = time.perf_counter()
            fn(K, d)
            times[k].append(time.perf_counter() - t)
    print(f"A = {a.a}\nB = {a.b}\n{a.numel:,} fp32 params in {a.tensors} tensors, {a.isa}, "
          f"{a.threads} threads, {a.passes} passes")
    for k, v in times.items():
        print(f"  {k:8s} median {statistics.median(v) * 1e3:7.2f} ms   min {min(v) * 1e3:7.2f} ms")
    for what in ("step", "limit"):
        r = statistics.median(x / y for x, y in zip(times[f"A {what}"], times[f"B {what}"]))
        print(f"  A / B {what}: {r:.3f} (paired)")


if __name__ == "__main__":
    main()

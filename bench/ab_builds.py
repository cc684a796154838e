"""A/B of two builds of the kernels in one process: the step and the streaming limit of build A
against build B on the same kind of data (fp32, or bf16 grads and param copy with fp32, bf16 or
8-bit moments), paired (median over passes of the ratio of
A's time to B's within a pass), so that a kernel or thread-pool change is judged without the
VM's bandwidth drift between two runs.

    python bench/ab_builds.py A_DIR B_DIR [--case q8_moments] [--isa avx2] [--passes 60]

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
    ap.add_argument("--case", default="fp32", choices=("fp32", "mixed", "bf16_moments", "q8_moments"))
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    builds = {"A": load(a.a), "B": load(a.b)}
    n = a.numel // a.tensors

    def data(K):
        """p, g, m, v, steps, lp, the scale kwargs: the step benchmark's case of that name."""
        out = {"p": [], "g": [], "m": [], "v": [], "lp": [], "ms": [], "vs": []}
        for _ in range(a.tensors):
            p, g = torch.randn(n) * 0.1, torch.randn(n) * 1e-2
            m, v = torch.randn(n) * 1e-3, torch.rand(n) * 1e-4 + 1e-8
            out["p"].append(p)
            out["g"].append(g if a.case == "fp32" else g.bfloat16())
            if a.case != "fp32":
                out["lp"].append(p.bfloat16())
            if a.case == "bf16_moments":
                m, v = m.bfloat16(), v.bfloat16()
            elif a.case == "q8_moments":
                blocks = (n + K.quant_block_size() - 1) // K.quant_block_size()
                codes = []
                for x, second, key in ((m, False, "ms"), (v, True, "vs")):
                    c, scales = torch.empty(n, dtype=torch.uint8), torch.empty(blocks)
                    K.q8_encode(x, c, scales, second, a.threads)
                    codes.append(c)
                    out[key].append(scales)
                m, v = codes
            out["m"].append(m)
            out["v"].append(v)
        scales = dict(exp_avg_scales=out["ms"], exp_avg_sq_scales=out["vs"]) if out["ms"] else {}
        return (out["p"], out["g"], out["m"], out["v"], [torch.tensor(0.0) for _ in range(a.tensors)],
                out["lp"], scales)

    def step(K, d):
        p, g, m, v, steps, lp, scales = d
        K.set_isa(a.isa)
        K.adam_step(p, g, m, v, [], lp, steps, LR, *BETAS, EPS, WD, True, False, 1.0, a.threads, **scales)

    def limit(K, d):
        p, g, m, v, _, lp, scales = d
        K.set_isa(a.isa)
        K.stream_limit(p, g, m, v, lp, a.threads, **scales)

    runs = {f"{b} {what}": (builds[b], fn, data(builds[b])) for b in builds for what, fn in (("step", step), ("limit", limit))}
    for K, fn, d in runs.values():
        fn(K, d)
    times = {k: [] for k in runs}
    for _ in range(a.passes):
        for k in random.sample(list(runs), len(runs)):
            K, fn, d = runs[k]
            t = time.perf_counter()
            fn(K, d)
            times[k].append(time.perf_counter() - t)
    print(f"A = {a.a}\nB = {a.b}\n{a.case}: {a.numel:,} params in {a.tensors} tensors, {a.isa}, "
          f"{a.threads} threads, {a.passes} passes")
    for k, v in times.items():
        print(f"  {k:8s} median {statistics.median(v) * 1e3:7.2f} ms   min {min(v) * 1e3:7.2f} ms")
    for what in ("step", "limit"):
        r = statistics.median(x / y for x, y in zip(times[f"A {what}"], times[f"B {what}"]))
        print(f"  A / B {what}: {r:.3f} (paired)")


if __name__ == "__main__":
    main()

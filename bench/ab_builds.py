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
import statistics
from pathlib import Path

import torch

from step_cases import BETAS, EPS, LR, WD, make_source, paired, scale_kwargs, timed_passes


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
    sizes = [a.numel // a.tensors] * a.tensors

    def data(K):
        """p, g, m, v, steps, lp, the scale kwargs: the step benchmark's case of that name."""
        src = make_source(a.case, sizes, K, a.threads)
        return (src["p"], src["g"], src["m"], src["v"], [torch.tensor(0.0) for _ in sizes], src["lp"],
                scale_kwargs(src["ms"], src["vs"]))

    def step(K, d):
        p, g, m, v, steps, lp, scales = d
        K.set_isa(a.isa)
        K.adam_step(p, g, m, v, [], lp, steps, LR, *BETAS, EPS, WD, True, False, 1.0, a.threads, **scales)

    def limit(K, d):
        p, g, m, v, _, lp, scales = d
        K.set_isa(a.isa)
        K.stream_limit(p, g, m, v, lp, a.threads, **scales)

    # One set of tensors for both builds (the codes are the same in both): separate copies sit on
    # different physical pages, and on the VM that alone moved the same code's time by 3-10 %
    # (the A / B limit ratio, the same code in both builds, showed it).
    d = data(builds["A"])
    runs = {}
    for b, K in builds.items():
        for what, fn in (("step", step), ("limit", limit)):
            runs[f"{b} {what}"] = (lambda fn=fn, K=K, d=d: fn(K, d))
    for run in runs.values():
        run()
    times = timed_passes(runs, a.passes)
    print(f"A = {a.a}\nB = {a.b}\n{a.case}: {a.numel:,} params in {a.tensors} tensors, {a.isa}, "
          f"{a.threads} threads, {a.passes} passes")
    for k, v in times.items():
        print(f"  {k:8s} median {statistics.median(v) * 1e3:7.2f} ms   min {min(v) * 1e3:7.2f} ms")
    for what in ("step", "limit"):
        print(f"  A / B {what}: {paired(times[f'A {what}'], times[f'B {what}']):.3f} (paired)")


if __name__ == "__main__":
    main()

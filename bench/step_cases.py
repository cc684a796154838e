"""What the step benchmarks share: the hyperparameters, each case's data (the same recipe for
step_bench.py, ab_builds.py and class_vs_kernel.py), and the shuffled, paired timing passes.
No argument parsing here: the scripts import it."""

import random
import statistics
import time

import torch

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
# The state format of each case's moments (the mixed shape otherwise).
MOMENT_FORMAT = {"fp32": None, "mixed": None, "bf16_moments": "bf16", "q8_moments": "q8"}


def make_source(case, sizes, K, threads):
    """p, g, m, v, lp as each contender takes them, one tensor per entry of `sizes`; for the
    moment-format cases m, v in that format (with their block scales ms, vs for q8) and their fp32
    originals as m32, v32."""
    gen = torch.Generator().manual_seed(1234)
    src = {"p": [], "g": [], "m": [], "v": [], "lp": [], "m32": [], "v32": [], "ms": [], "vs": []}
    fmt = MOMENT_FORMAT[case]
    for n in sizes:
        p = torch.randn(n, generator=gen) * 0.1
        g = torch.randn(n, generator=gen) * 1e-2
        m = torch.randn(n, generator=gen) * 1e-3
        v = torch.rand(n, generator=gen) * 1e-4 + 1e-8
        src["p"].append(p)
        if case == "fp32":
            src["g"].append(g)
        else:
            src["g"].append(g.to(torch.bfloat16))
            src["lp"].append(p.to(torch.bfloat16))
        if fmt is None:
            src["m"].append(m)
            src["v"].append(v)
            continue
        src["m32"].append(m)
        src["v32"].append(v)
        if fmt == "bf16":
            src["m"].append(m.to(torch.bfloat16))
            src["v"].append(v.to(torch.bfloat16))
        else:
            blocks = (n + K.quant_block_size() - 1) // K.quant_block_size()
            for key, x, second in (("m", m, False), ("v", v, True)):
                codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(blocks)
                K.q8_encode(x, codes, scales, second, threads)
                src[key].append(codes)
                src[key[0] + "s"].append(scales)
    return src


def scale_kwargs(ms, vs):
    """The 8-bit moments' block scales, when there are any."""
    return dict(exp_avg_scales=ms, exp_avg_sq_scales=vs) if ms else {}


def timed_passes(runs, passes):
    """{name: [seconds per pass]}: each pass times one call of every run, in a fresh shuffled order
    (so that no run always follows the same one)."""
    times = {k: [] for k in runs}
    for _ in range(passes):
        for k in random.sample(list(runs), len(runs)):
            t = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t)
    return times


def paired(slow, fast):
    """Median over passes of slow's time / fast's time in the same pass."""
    return statistics.median(a / b for a, b in zip(slow, fast))

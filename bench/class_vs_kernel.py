"""Where the AdamW class's time goes against the bare kernel, on bf16 CPU params (the step
benchmark's mixed case): the class's own step, the kernel on the class's own state tensors
(the same memory: the difference is the class's Python and checks), and the kernel on fresh
copies of those tensors (other memory: the difference is where the buffers landed).

    python bench/class_vs_kernel.py [--isa avx2] [--tensors 8] [--passes 40]

Each pass times the three in a shuffled order; ratios are paired (median over passes of the
ratio within a pass). Prints medians and minima in ms.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

from step_cases import BETAS, EPS, LR, WD, paired, timed_passes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import offload_adam  # noqa: E402
from offload_adam._build import load_kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default=None, help="kernel variant (default: the best supported)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    K = load_kernels()
    isa = a.isa or offload_adam.supported_isas()[0]
    torch.set_num_threads(a.threads)
    n = a.numel // a.tensors
    params = [torch.randn(n).bfloat16().requires_grad_() for _ in range(a.tensors)]
    for p in params:
        p.grad = (torch.randn(n) * 1e-3).bfloat16()
    opt = offload_adam.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    K.set_isa(isa)
    opt.step()  # builds the state
    state = [opt.state[p] for p in params]
    steps = [torch.tensor(1.0) for _ in params]

    def kernel(master, grads, m, v, lp):
        def run():
            K.set_isa(isa)
            K.adam_step(master, grads, m, v, [], lp, steps, LR, *BETAS, EPS, WD, True, False, 1.0, a.threads)
        return run

    own = kernel([s["master_param"] for s in state], [p.grad for p in params], [s["exp_avg"] for s in state],
                 [s["exp_avg_sq"] for s in state], [p.detach() for p in params])
    fresh = kernel([s["master_param"].clone() for s in state], [p.grad.clone() for p in params],
                   [s["exp_avg"].clone() for s in state], [s["exp_avg_sq"].clone() for s in state],
                   [p.detach().clone() for p in params])

    def cls():
        K.set_isa(isa)
        opt.step()

    runs = {"class": cls, "kernel, class's tensors": own, "kernel, fresh copies": fresh}
    times = timed_passes(runs, a.passes)
    print(f"{a.numel:,} bf16 params in {a.tensors} tensors, {isa}, {a.threads} threads, {a.passes} passes")
    for k, v in times.items():
        print(f"  {k:24s} median {statistics.median(v) * 1e3:7.2f} ms   min {min(v) * 1e3:7.2f} ms")
    for other in ("kernel, class's tensors", "kernel, fresh copies"):
        print(f"  class / {other}: {paired(times['class'], times[other]):.3f} (paired)")


if __name__ == "__main__":
    main()

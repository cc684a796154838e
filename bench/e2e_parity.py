#!/usr/bin/env python3
"""Loss parity of the 8-bit moments over a long end-to-end run (issue 16): the loss curve of
`offload_adam_8bit_state` against `offload_adam` (fp32 moments) from the end-to-end benchmark's results.json,
and optionally against the 8-bit curve of another build (before a change).

A long run is what shows a drift of the moments: a per-step difference of two curves grows with the steps
as the two trajectories part (the batches are the same, the params are not), so beside the largest per-step
difference it prints the mean loss over the last 500 steps.

    python -m bench.e2e --size tiny --vocab 8192 --steps 3000 --threads 1 --no-plots \\
        --optimizers offload_adam,offload_adam_8bit_state --out bench/results/e2e_cpu_parity_3000
    python bench/e2e_parity.py bench/results/e2e_cpu_parity_3000/results.json [OTHER_BUILD_8BIT_RESULTS.json]
"""
import argparse
import json

import numpy as np


def losses(path):
    return {run["optimizer"]: np.array(run["losses"]) for run in json.load(open(path))["runs"]}


def main():
    ap = argparse.ArgumentParser(description="Loss parity of the 8-bit moments over a long "
                                 "end-to-end run (see the module's docstring for the run)")
    ap.add_argument("results", help="the end-to-end benchmark's results.json")
    ap.add_argument("other", nargs="?", help="another build's results.json, for its 8-bit curve")
    args = ap.parse_args()
    runs = losses(args.results)
    ref = runs["offload_adam"]
    curves = [("8-bit", runs["offload_adam_8bit_state"])]
    if args.other:
        curves.append(("8-bit, other build", losses(args.other)["offload_adam_8bit_state"]))
    print(f"{len(ref)} steps; against offload_adam (fp32 moments)")
    for name, curve in curves:
        rel = np.abs(curve - ref) / ref
        tail, ref_tail = curve[-500:].mean(), ref[-500:].mean()
        print(f"{name:20s} largest per-step |diff| / loss {rel.max():.2e} (steps < 500: {rel[:500].max():.2e}); "
              f"mean loss over the last 500 steps {tail:.4f} vs {ref_tail:.4f} ({tail / ref_tail - 1:+.2%}); "
              f"final {curve[-1]:.4f} vs {ref[-1]:.4f}")


if __name__ == "__main__":
    main()

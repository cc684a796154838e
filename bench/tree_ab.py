#!/usr/bin/env python3
"""A/B of the optimizer's step between two checkouts of offload_adam (a refactor of the Python
layer that must not cost): the same step, timed in a fresh process per tree, the trees
alternating A B B A per round, so that the VM's bandwidth drift falls on both alike. The
ratio is paired: per round, B's median step over A's; the table gives the median and the
range of those ratios over the rounds.

    python bench/tree_ab.py OLD_TREE NEW_TREE [--rounds 4] [--cases ram-fp32,ram-mixed,...]

Cases (each a process that builds AdamW and times `--steps` steps after two warm-up steps):

  ram-fp32, ram-mixed, ram-8bit   CPU params stepped in place, state in RAM: `--numel`
                                  elements in 8 tensors; fp32 params, bf16 params with fp32
                                  moments, bf16 params with 8-bit moments (memory bound)
  engine-mixed                    bf16 CPU params through the offload engine
                                  (free_grads_after_copy=True routes them there)
  small-inplace, small-engine,    2000 params of 64 elements: the Python around the kernel
  small-files                     (small-files: state_dirs= under a temp dir)

Each child prints one line of JSON; nothing but the tree differs (both run with this
script's interpreter and their own package, PYTHONPATH=tree).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, shutil, statistics, sys, tempfile, time
import torch
import offload_adam
case, numel, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
gen = torch.Generator().manual_seed(0)
kw, folder = {}, None
if case.startswith("small"):
    ps = [(torch.randn(64, generator=gen) * 0.1).to(torch.bfloat16 if i % 2 else torch.float32)
          .requires_grad_() for i in range(2000)]
    if case == "small-engine":
        kw = dict(free_grads_after_copy=True)
    if case == "small-files":
        folder = tempfile.mkdtemp()
        kw = dict(state_dirs=folder)
else:
    dtype = torch.float32 if case == "ram-fp32" else torch.bfloat16
    ps = [(torch.randn(numel // 8, generator=gen) * 0.1).to(dtype).requires_grad_()
          for _ in range(8)]
    if case == "ram-8bit":
        kw = dict(state_dtype="8bit")
    if case == "engine-mixed":
        kw = dict(free_grads_after_copy=True)
grads = [torch.randn(p.shape, generator=gen).to(p.dtype) * 1e-3 for p in ps]
opt = offload_adam.AdamW(ps, lr=1e-3, **kw)
times = []
for k in range(steps + 2):
    for p, g in zip(ps, grads):
        p.grad = g.clone() if kw.get("free_grads_after_copy") else g
    t = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t)
opt.close()
if folder:
    shutil.rmtree(folder)
n = sum(p.numel() for p in ps)
print(json.dumps({"case": case, "median_s": statistics.median(times[2:]), "params": n,
                  "count": len(ps)}))
'''

CASES = ("ram-fp32", "ram-mixed", "ram-8bit", "engine-mixed", "small-inplace", "small-engine",
         "small-files")


def run(tree: str, case: str, a) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", CHILD, case, str(a.numel), str(a.steps),
                          str(a.threads)], env=env, capture_output=True, text=True, cwd=tree,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["median_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="tree A (before)")
    ap.add_argument("b", help="tree B (after)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--numel", type=int, default=32 << 20, help="elements of the ram-* cases")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None, help="JSON of every time and ratio")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine import machine_info, one_line   # noqa: E402
    info = machine_info(query_kernels=False)
    print(one_line(info))
    print(f"A = {a.a}\nB = {a.b}\nthreads {a.threads}, {a.rounds} rounds A B B A, "
          f"median of {a.steps} steps each")
    result = {"machine": info, "a": a.a, "b": a.b, "threads": a.threads, "cases": {}}
    print(f"{'case':14} {'A ms':>9} {'B ms':>9} {'B/A median':>11} {'B/A range':>15}")
    for case in a.cases.split(","):
        times = {"A": [], "B": []}
        ratios = []
        for _ in range(a.rounds):
            got = {}
            for which in ("A", "B", "B", "A"):
                got.setdefault(which, []).append(run(a.a if which == "A" else a.b, case, a))
            ta, tb = statistics.mean(got["A"]), statistics.mean(got["B"])
            times["A"].append(ta)
            times["B"].append(tb)
            ratios.append(tb / ta)
        result["cases"][case] = {"a_s": times["A"], "b_s": times["B"], "ratios": ratios}
        print(f"{case:14} {statistics.median(times['A']) * 1e3:9.2f} "
              f"{statistics.median(times['B']) * 1e3:9.2f} {statistics.median(ratios):11.3f} "
              f"{min(ratios):7.3f}-{max(ratios):.3f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What loading an optimizer's own state_dict() costs with the state in files.

Accelerate's AcceleratedOptimizer does `opt.load_state_dict(opt.state_dict())` when it wraps
an optimizer, so every start of a Trainer or an accelerate script pays it. A state_dict() of
state in files maps the files (no copy); loading it back untouched is now recognized and
writes nothing (nvme_tier.FileStore._own_unchanged). Before, it was a full pass that
rewrote every bucket: bounded by the disk, ~2 x the state's bytes moved.

In one run, on one directory: the disk's direct-I/O write and read speeds (the tier's own
pool, bench/nvme_bench.py's probe), then rounds alternating the load as it is now
("recognized") and with the recognition turned off ("rewritten": the path before),
each a fresh state stepped twice. Reports the medians, the rewrite against the disk's limit
for its bytes (one generation written: the dict's own reads come from the page cache that
state_dict()'s checksum verification just filled), and the ratio between the two.

    python bench/state_dict_reload.py                      # 400 M bf16 params, 8-bit, compact
    python bench/state_dict_reload.py --params 20e6 --rounds 1 --out /tmp/x   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402
from offload_adam import nvme_tier  # noqa: E402
from offload_adam.testing import state_files  # noqa: E402
from bench.machine import load_average, machine_info, one_line  # noqa: E402
from bench.nvme_bench import disk_limit  # noqa: E402

_OWN = nvme_tier.FileStore._own_unchanged


def one(folder, args, recognized: bool) -> dict:
    """A fresh state of `args.params` params (8 bf16 params) stepped twice, then its own
    state_dict() loaded back: the seconds each took, and the state's bytes."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    n = int(args.params) // 8
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for _ in range(8)]
    opt = offload_adam.AdamW(params, state_dirs=[folder], state_dtype=args.state_dtype,
                             state_footprint=args.footprint)
    try:
        for _ in range(2):
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            opt.step()
        nvme_tier.FileStore._own_unchanged = (_OWN if recognized
                                              else (lambda self, saved_of: False))
        t0 = time.perf_counter()
        sd = opt.state_dict()
        t1 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # (the rewrite warns that the dict is held)
            opt.load_state_dict(sd)
        t2 = time.perf_counter()
        del sd
        state_bytes = state_files(opt).spec.nbytes
    finally:
        nvme_tier.FileStore._own_unchanged = _OWN
        opt.close()
    return {"state_dict_s": t1 - t0, "load_s": t2 - t1, "state_bytes": state_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=400e6)
    ap.add_argument("--state-dtype", default="8bit")
    ap.add_argument("--footprint", default="compact")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/offload_state_dict_reload")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tag", default="dev", help="names the result files (the machine)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    info = machine_info()
    print(one_line(info), flush=True)
    folder = os.path.join(args.dir, "state")
    os.makedirs(args.dir, exist_ok=True)
    load_start = load_average()
    rows = {"recognized": [], "rewritten": []}
    size = None
    for r in range(args.rounds):
        order = ("recognized", "rewritten") if r % 2 == 0 else ("rewritten", "recognized")
        for how in order:
            row = one(folder, args, how == "recognized")
            size = row["state_bytes"]
            rows[how].append(row)
            print(f"round {r} {how:10s}: state_dict() {row['state_dict_s']:.3f} s, "
                  f"load_state_dict(it) {row['load_s']:.3f} s", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    disk = disk_limit(args.dir, min(size, 2 << 30), 4, 16 << 20)
    limit = size / disk["write_Bps"]
    med = {how: statistics.median(r["load_s"] for r in rs) for how, rs in rows.items()}
    lines = [
        f"state: {args.params / 1e6:.0f} M bf16 params, state_dtype={args.state_dtype}, "
        f"{args.footprint}: {size / 1e9:.2f} GB a generation; {torch.get_num_threads()} threads",
        f"disk (direct I/O, the tier's pool): write {disk['write_Bps'] / 1e9:.2f} GB/s, "
        f"read {disk['read_Bps'] / 1e9:.2f} GB/s; a rewrite's limit (one generation "
        f"written) {limit:.2f} s",
        f"load_state_dict(state_dict()), median of {args.rounds}: recognized "
        f"{med['recognized']:.3f} s, rewritten {med['rewritten']:.3f} s "
        f"({med['rewritten'] / limit:.2f} x the disk's limit); "
        f"{med['rewritten'] / max(med['recognized'], 1e-9):.0f} x",
    ]
    for line in lines:
        print(line)
    os.makedirs(args.out, exist_ok=True)
    tag = f"state_dict_reload_{args.tag}"
    with open(os.path.join(args.out, tag + ".json"), "w") as f:
        json.dump({"machine": info, "args": vars(args), "disk": disk, "rows": rows,
                   "medians_s": med, "limit_s": limit, "load_average": [load_start,
                                                                          load_average()],
                   "summary": lines}, f, indent=1)
    with open(os.path.join(args.out, tag + ".log"), "w") as f:
        f.write(one_line(info) + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

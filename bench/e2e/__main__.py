"""python -m bench.e2e: the end-to-end training benchmark (see benchmark.py for what it runs).

Without CUDA: a small model on the CPU, bf16 params for offload_adam against fp32 and pure-bf16 torch
AdamW, in about two minutes on 2 cores. With CUDA: a model sized to the GPU, the offloading peers when
installed, and the size sweep, in about ten minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

from . import contenders as C
from .benchmark import BenchSettings, run
from .model import SIZES, config_for
from .plots import write_plots
from .report import table, validate, write_json

# The defaults per device: (size, vocab, seq_len, batches, micro_batch, steps, warmup, lr).
# lr: the loss check needs a smooth curve. At 3e-3 the CPU default's loss first rises, then falls in
# jumps whose timing a 2^-24 perturbation shifts; at 1e-3 it falls steadily (and faster).
_CPU = dict(size="small", vocab=256, seq_len=64, batch=[8], micro_batch=8, steps=24, warmup=6, lr=1e-3)
_CPU_QUICK = dict(size="tiny", vocab=64, seq_len=32, batch=[2], micro_batch=2, steps=6, warmup=2, lr=1e-3)
_CUDA = dict(size=None, vocab=8192, seq_len=1024, batch=[8, 32], micro_batch=8, steps=20, warmup=5, lr=3e-4)
_CUDA_QUICK = dict(size="124m", vocab=8192, seq_len=512, batch=[8], micro_batch=8, steps=8, warmup=3, lr=3e-4)


def _cuda_size() -> str:
    """The largest of the GPU sizes whose fp32-AdamW baseline (16 bytes/param + activations, budgeted at
    20 bytes/param) fits in 30% of the GPU: the comparison wants a model that fits both."""
    total = torch.cuda.get_device_properties(0).total_memory
    pick = "124m"
    for name in ("124m", "350m", "760m", "1.3b"):
        layers, width = SIZES[name]
        if 20 * config_for(layers, width, _CUDA["vocab"], _CUDA["seq_len"]).num_params() <= 0.3 * total:
            pick = name
    return pick


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.e2e",
        description="End-to-end training benchmark: a GPT-style decoder trained on synthetic tokens with "
                    "each optimizer in turn; iteration time split, memory, loss curves.",
        epilog="optimizers: " + ", ".join(C.CONTENDERS) + ". sizes: " +
               ", ".join(f"{k} ({l}x{w})" for k, (l, w) in SIZES.items()))
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--size", choices=list(SIZES), help="named model size (layers x width)")
    p.add_argument("--layers", type=int, help="override the size's layer count")
    p.add_argument("--width", type=int, help="override the size's width (heads = width / 64)")
    p.add_argument("--vocab", type=int, help="vocabulary of the synthetic tokens")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--steps", type=int, help="training steps per optimizer (warm-up included)")
    p.add_argument("--warmup", type=int, help="untimed steps at the start")
    p.add_argument("--batch", type=_ints, help="sequences per step; comma-separated for a sweep, e.g. 8,32")
    p.add_argument("--micro-batch", type=int, help="sequences per forward; more accumulate")
    p.add_argument("--optimizers", help="comma-separated names (default: all for the device)")
    p.add_argument("--lr", type=float)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--compute-dtype", choices=["auto", "param", "float32"], default="auto",
                   help="auto: float32 on CPU (bf16 GEMMs are slow without AMX), the param dtype on CUDA")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="size sweep (default: on with CUDA, off on CPU)")
    p.add_argument("--sweep-budget", type=float, default=240.0, help="seconds for the size sweep")
    p.add_argument("--out", help="output folder (default bench/results/e2e_<device>)")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds): a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 when a loss curve disagrees or a run fails")
    return p


def _device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    m = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)  # "NVIDIA H100 80GB HBM3" -> "h100"
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def settings_from(args: argparse.Namespace) -> tuple[BenchSettings, str]:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
    cuda = device.type == "cuda"
    d = (_CUDA_QUICK if args.quick else _CUDA) if cuda else (_CPU_QUICK if args.quick else _CPU)
    size = args.size or d["size"] or _cuda_size()
    layers, width = SIZES[size]
    if args.layers or args.width:
        layers, width = args.layers or layers, args.width or width
        size = f"{layers}x{width}"
    vocab, seq_len = args.vocab or d["vocab"], args.seq_len or d["seq_len"]
    steps = args.steps or d["steps"]
    warmup = args.warmup if args.warmup is not None else min(d["warmup"], steps - 1)
    if not 0 <= warmup < steps:
        raise SystemExit(f"--warmup must be in [0, steps) = [0, {steps}), got {warmup}")
    names = [n.strip() for n in args.optimizers.split(",")] if args.optimizers else C.DEFAULTS[device.type]
    try:
        C.resolve(names)
    except ValueError as e:
        raise SystemExit(str(e))
    compute = {"auto": torch.float32 if not cuda else None, "param": None, "float32": torch.float32}
    s = BenchSettings(
        device=device, size=size, model=config_for(layers, width, vocab, seq_len),
        batches=args.batch or d["batch"], micro_batch=args.micro_batch or d["micro_batch"],
        steps=steps, warmup=warmup, optimizers=names,
        hparams=C.HParams(lr=args.lr or d["lr"]), compute_dtype=compute[args.compute_dtype],
        sweep=cuda and not args.quick if args.sweep is None else args.sweep,
        sweep_budget_s=args.sweep_budget, seed=args.seed)
    out = args.out or os.path.join("bench", "results", f"e2e_{_device_tag(device)}")
    return s, out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings, out = settings_from(args)
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    report = run(settings, progress_enabled=not args.no_progress)
    print(table(report))
    m = report["machine"]
    print(f"\nmachine: {m['cpu_model']}, {m['cpu_cores']} cores, "
          f"{'GPU ' + m['gpu'] if m['gpu'] else 'no GPU'}, torch {m['torch']}, "
          f"offload_adam ISA {m['offload_adam_isa']}; load average {m['load_average']}")
    loads = [x for x in (m.get("load_average") or [])[:1] + (m.get("load_average_end") or [])[:1]]
    if loads and max(loads) > 0.5 * (m["cpu_cores"] or 1):
        print(f"WARNING: the machine was busy (load average up to {max(loads):.1f} on {m['cpu_cores']} "
              f"cores): other processes competed for the cores, timings are not reliable")
    problems = validate(report)
    if problems:  # a bug in the benchmark itself: say so, keep the file for inspection
        print("report problems:", *problems, sep="\n  ", file=sys.stderr)
    path = os.path.join(out, "results.json")
    if not args.no_plots:
        report["plots"] = write_plots(report, out)
    write_json(report, path)
    print(f"wrote {path}" + "".join(f"\nwrote {p}" for p in report.get("plots", {}).get("files", [])))
    if report.get("plots", {}).get("skipped"):
        print(f"plots skipped: {report['plots']['skipped']}")
    bad = [r for r in report["runs"] if r.get("loss_check") and not r["loss_check"]["agrees"]
           and not r["loss_check"].get("expected_drift")]
    failed = [r for r in report["runs"] if r["status"] in ("failed",)]
    for r in report["runs"]:
        lc = r.get("loss_check")
        if lc and not lc["agrees"] and lc.get("expected_drift"):
            print(f"note: {r['optimizer']} (batch {r['batch']}) moves {lc['max_rel_diff']:.2e} from "
                  f"{lc['reference']}, more than rounding explains; expected: {lc['expected_drift']}")
    for r in bad:
        lc = r["loss_check"]
        print(f"WARNING: {r['optimizer']} (batch {r['batch']}) loss curve differs from {lc['reference']} by "
              f"{lc['max_rel_diff']:.2e} > {lc['tolerance']:.2e} ({lc['basis']})")
    print(f"total wall time {time.perf_counter() - t0:.1f} s")
    return 1 if args.strict and (bad or failed or problems) else 0


if __name__ == "__main__":
    sys.exit(main())

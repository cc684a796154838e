#!/usr/bin/env python3
"""The bytes a streamed training step moves, per link, counted on the simulated device
(offload_adam.testing.AsyncSimDevice: the GPU's path on the CPU, no GPU needed).

One GPT (bench/e2e/model.py) in bf16, trained with every param resident through the engine
and with its blocks' params streamed (stream_params, each --prefetch), on the same data.
Per optimizer step (--micro micro-batches), measured after the order is learned:

  H2D params     bytes host->device during forward + backward (streamed fetches)
  H2D at step    bytes host->device from step() (the resident params' new values)
  D2H grads      bytes device->host (grads, each sent once per step)
  device peak    the most device bytes the streamer held materialized at once
  host           opt.host_bytes() (state + grad/staging arenas) + the streamer's host copies

next to what the design says: 2 x the streamed bytes per micro-batch for H2D params, the
resident bytes at step, peak <= (k + 2) x the largest block. The simulated device copies
in threads of its own, so its times say nothing of a GPU: only bytes are reported.

    python bench/stream_sim.py                  # 8 blocks of width 256, 4 micro-batches
    python bench/stream_sim.py --layers 2 --width 64 --micro 1 --out /tmp/s   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(cfg, args, prefetch):
    import offload_adam
    from bench.e2e.model import _Block, build_model
    from offload_adam.testing import AsyncSimDevice, simulated
    sim = AsyncSimDevice(seed=0)
    try:
        with simulated(sim), sim.watch():
            model = build_model(cfg, "cpu", torch.bfloat16)
            streamer = None
            if prefetch is not None:
                streamer = offload_adam.stream_params(model, _Block, prefetch=prefetch)
            opt = offload_adam.AdamW(model.parameters(), lr=1e-3, bucket_mb=args.bucket_mb)
            gen = torch.Generator().manual_seed(0)

            def micro_batch():
                tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1),
                                       generator=gen)
                model(tokens[:, :-1], tokens[:, 1:]).backward()

            for _ in range(args.micro):   # the first step learns the order
                micro_batch()
            opt.step()
            opt.zero_grad()
            c0 = sim.counters()
            sim.reset_peak()
            for _ in range(args.micro):
                micro_batch()
            c1 = sim.counters()
            opt.step()
            c2 = sim.counters()
            opt.zero_grad()
            row = dict(
                mode="resident" if prefetch is None else f"streamed k={prefetch}",
                prefetch=prefetch,
                h2d_params_bytes=c1["h2d_bytes"] - c0["h2d_bytes"],
                h2d_step_bytes=c2["h2d_bytes"] - c1["h2d_bytes"],
                d2h_bytes=c2["d2h_bytes"] - c0["d2h_bytes"],
                device_peak_bytes=c1["peak_materialized_bytes"],
                host_bytes=opt.host_bytes() + (streamer.streamed_bytes if streamer else 0),
                streamed_bytes=streamer.streamed_bytes if streamer else 0,
                largest_block_bytes=streamer.largest_block_bytes if streamer else 0,
                param_bytes=sum(p.numel() * p.element_size() for p in model.state_dict().values()),
            )
            del opt, model, streamer
        sim.check()
    finally:
        sim.close()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=0.5)
    ap.add_argument("--prefetch", default="1,2")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    from bench.e2e.model import config_for
    from bench.machine import machine_info, one_line
    cfg = config_for(args.layers, args.width, args.vocab, args.seq)
    print(one_line(machine_info()))
    print(f"model: {cfg.num_params() / 1e6:.2f} M params ({cfg}), {args.micro} micro-batches "
          f"of {args.batch} x {args.seq} per step, on the simulated device")
    rows = [run(cfg, args, None)] + [run(cfg, args, int(k)) for k in args.prefetch.split(",")]
    mb = 1e6
    print(f"{'mode':<14}{'H2D params MB':>15}{'= x streamed':>14}{'H2D step MB':>13}"
          f"{'D2H MB':>9}{'dev peak MB':>13}{'<= (k+2) blk':>14}{'host MB':>10}")
    for r in rows:
        ratio = r["h2d_params_bytes"] / r["streamed_bytes"] if r["streamed_bytes"] else 0.0
        bound = ((r["prefetch"] + 2) * r["largest_block_bytes"]) if r["prefetch"] is not None else 0
        r["h2d_params_per_streamed_per_micro"] = ratio / args.micro if r["streamed_bytes"] else None
        r["peak_bound_bytes"] = bound
        print(f"{r['mode']:<14}{r['h2d_params_bytes'] / mb:>15.2f}{ratio:>14.2f}"
              f"{r['h2d_step_bytes'] / mb:>13.2f}{r['d2h_bytes'] / mb:>9.2f}"
              f"{r['device_peak_bytes'] / mb:>13.2f}{bound / mb:>14.2f}{r['host_bytes'] / mb:>10.2f}")
    print(f"(params {rows[0]['param_bytes'] / mb:.2f} MB in bf16; streamed "
          f"{rows[-1]['streamed_bytes'] / mb:.2f} MB; H2D params should be 2 x streamed x "
          f"{args.micro} micro-batches = {2 * args.micro:.0f} x)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"stream_sim_{args.tag}.json"
    path.write_text(json.dumps(dict(machine=machine_info(), args=vars(args),
                                    num_params=cfg.num_params(), rows=rows), indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

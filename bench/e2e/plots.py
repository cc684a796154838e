"""PNG plots of a report (matplotlib is optional: without it the report says the plots were skipped).

  losses.png      loss per step for each optimizer, the chain's entropy floor, and below it each curve's
                  relative difference to the fp32 reference
  split.png       the median iteration split per optimizer: forward+backward, optimizer step, other
  timeline.png    one offloaded step of offload_adam: per bucket when its D2H, CPU step and H2D ran,
                  against the iteration's forward+backward and optimizer spans
  sweep.png       (with a size sweep) iteration time against model size, and the largest size per optimizer
"""

from __future__ import annotations

import os

_COLORS = {"fwd_bwd_s": "#4c72b0", "optimizer_s": "#dd8452", "other_s": "#bbbbbb",
           "d2h": "#55a868", "cpu_step": "#c44e52", "h2d": "#8172b3"}


def write_plots(report: dict, out_dir: str) -> dict:
    """Writes the PNGs; returns {"files": [...]} or {"files": [], "skipped": reason}."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return {"files": [], "skipped": "matplotlib not installed (pip install matplotlib)"}
    files = []
    for name, fn in (("losses.png", _losses), ("split.png", _split), ("timeline.png", _timeline),
                     ("sweep.png", _sweep)):
        fig = fn(plt, report)
        if fig is None:
            continue
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files.append(path)
    return {"files": files}


def _trained(report: dict, batch: int) -> list[dict]:
    return [r for r in report["runs"] if r["batch"] == batch and r["status"] == "ok" and not r["baseline"]]


def _title(report: dict, what: str) -> str:
    m, cfg = report["machine"], report["config"]
    where = m["gpu"] or f"{m['cpu_model']} ({m['cpu_cores']} cores)"
    return f"{what}: {cfg['size']} ({cfg['num_params'] / 1e6:.1f} M params) on {where}"


def _losses(plt, report: dict):
    batch = report["config"]["batches"][-1]
    rows = _trained(report, batch)
    if not rows:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 2])
    ref = next((r for r in rows if r["optimizer"] == report["config"]["reference"]), None)
    for r in rows:
        steps = range(1, len(r["losses"]) + 1)
        top.plot(steps, r["losses"], label=r["optimizer"], lw=1.2)
        if ref is not None and r is not ref:
            n = min(len(r["losses"]), len(ref["losses"]))
            rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], ref["losses"][:n])]
            bottom.semilogy(range(1, n + 1), [max(x, 1e-9) for x in rel], label=r["optimizer"], lw=1)
    floor = report.get("optimal_loss", {}).get(batch) or report.get("optimal_loss", {}).get(str(batch))
    if floor:
        top.plot(range(1, len(floor) + 1), floor, "k--", lw=0.8, label="entropy floor of the data")
    top.set_ylabel("training loss (nats)")
    top.legend(fontsize=7, loc="upper right")
    top.set_title(_title(report, f"loss, batch {batch}"), fontsize=9)
    bottom.set_ylabel("|loss - ref| / ref")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    if ref is not None and len(rows) > 1:
        bottom.legend(fontsize=7)
    return fig


def _split(plt, report: dict):
    batches = report["config"]["batches"]
    groups = [(b, [r for r in report["runs"] if r["batch"] == b and r["status"] == "ok" and "timing" in r])
              for b in batches]
    groups = [(b, rows) for b, rows in groups if rows]
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 1.2 + 0.35 * sum(len(r) for _, r in groups)),
                             squeeze=False)
    for ax, (batch, rows) in zip(axes[:, 0], groups):
        names = [r["optimizer"] for r in rows]
        left = [0.0] * len(rows)
        for part in ("fwd_bwd_s", "optimizer_s", "other_s"):
            widths = [max(0.0, r["timing"][part]) * 1e3 for r in rows]
            ax.barh(names, widths, left=left, color=_COLORS[part], label=part[:-2].replace("_", "+"))
            left = [a + w for a, w in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel(f"median iteration time (ms), batch {batch}")
        ax.tick_params(axis="y", labelsize=7)
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[0, 0].set_title(_title(report, "iteration split"), fontsize=9)
    return fig


def _timeline(plt, report: dict):
    row = next((r for r in report["runs"] if r.get("timeline") and r["optimizer"] == "offload_adam"),
               None) or next((r for r in report["runs"] if r.get("timeline")), None)
    if row is None:
        return None
    tl = row["timeline"]
    t0 = tl["iteration_start_s"]
    buckets = sorted({e["bucket"] for e in tl["buckets"]})
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.3 * len(buckets)))
    y_iter = -1  # the iteration's own row, drawn on top
    start = 0.0
    for part in ("fwd_bwd", "optimizer"):
        end = tl["marks"].get(part)
        if end is not None:
            ax.barh(y_iter, (end - start) * 1e3, left=start * 1e3, color=_COLORS[part + "_s"],
                    label=part.replace("_", "+"))
            start = end
    seen = set()
    for e in tl["buckets"]:
        y = buckets.index(e["bucket"])
        phase = e["phase"]
        ax.barh(y, (e["end_s"] - e["start_s"]) * 1e3, left=(e["start_s"] - t0) * 1e3,
                color=_COLORS.get(phase, "k"), label=None if phase in seen else phase, height=0.6)
        seen.add(phase)
    ax.set_yticks([y_iter] + list(range(len(buckets))))
    ax.set_yticklabels(["iteration"] + [f"bucket {b}" for b in buckets], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the iteration started (host clock)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(_title(report, f"one step of {row['optimizer']}, batch {row['batch']}"), fontsize=9)
    return fig


def _sweep(plt, report: dict):
    sweep = report.get("sweep")
    if not sweep or not any(s["points"] for s in sweep["results"].values()):
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names, largest = [], []
    for name, s in sweep["results"].items():
        ok = [p for p in s["points"] if p.get("iteration_s") is not None]
        if ok:
            left.loglog([p["params"] / 1e9 for p in ok], [p["iteration_s"] * 1e3 for p in ok], "o-",
                        label=name, ms=3)
        names.append(f"{name}\n({s['bound']})")
        largest.append(s["largest_params"] / 1e9)
    left.set_xlabel("params (B)")
    left.set_ylabel(f"iteration ms (batch {sweep['batch']} x {sweep['seq_len']})")
    left.legend(fontsize=7)
    left.grid(alpha=0.3, which="both")
    right.barh(names, largest, color="#4c72b0")
    right.invert_yaxis()
    right.set_xlabel("largest trainable model (B params)")
    right.tick_params(axis="y", labelsize=7)
    fig.suptitle(_title(report, "size sweep"), fontsize=9)
    return fig

"""What the benchmark reports: the loss-curve check, the terminal table, the JSON file (the machine
it ran on comes from machine.py).

The JSON holds every number the table shows and more (per-step losses, the per-bucket timeline of one
offloaded step, the size sweep); `validate` checks its shape, so a consumer (the README, the plots, a CI
job) can rely on it.
"""

from __future__ import annotations

import json
from typing import Optional


SCHEMA = "offload_adam.bench.e2e/1"

# The loss check. A contender's curve is compared with the fp32 reference, step by step, as the largest
# relative difference |loss - ref| / ref. What rounding explains:
#   fp32 contenders: only the order of floating-point operations differs (fused vs per-tensor kernels).
#     Measured on the CPU default (4 x 256, lr 1e-3, 30 steps): perturbing the reference's initial weights
#     by 2^-24 relative moves its curve by ~1e-6; FP32_RTOL allows 100x that.
#   bf16 contenders (bf16 params or bf16 compute): rounding the weights to bf16 alone moves the curve by
#     as much as the twin (torch AdamW on fp32 masters, params = masters rounded to bf16) moves from the
#     reference, measured in the same run (~3e-4 on the CPU default). A bf16 contender agrees when it
#     moves no more than BF16_FACTOR x the twin's difference + BF16_SLACK. The twin itself, or any bf16
#     contender in a run without the twin, is held to the coarse BF16_FALLBACK_RTOL.
# A contender with a known reason to drift (pure bf16 AdamW loses updates below half a bf16 ulp) still
# gets its number and its verdict, labelled with that reason, and does not fail --strict.
FP32_RTOL = 1e-4
BF16_FACTOR = 2.0
BF16_SLACK = 1e-3
BF16_FALLBACK_RTOL = 3e-2


# ---- the loss check ---------------------------------------------------------------------------------


def max_rel_diff(losses: list[float], ref: list[float]) -> Optional[float]:
    n = min(len(losses), len(ref))
    if n == 0:
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(losses[:n], ref[:n]))


def check_losses(rows: list[dict], reference: str, twin: str, drifts: dict[str, str] | None = None,
                 relatives: dict[str, str] | None = None) -> None:
    """Adds row["loss_check"] to every trained, non-baseline row of one batch size; `relatives`
    (contender -> another) adds the largest per-step difference to that one's curve too."""
    by_name = {r["optimizer"]: r for r in rows if r.get("status") == "ok"}
    ref = by_name.get(reference)
    if ref is None:
        return
    twin_diff = max_rel_diff(by_name[twin]["losses"], ref["losses"]) if twin in by_name else None
    for r in by_name.values():
        if r["baseline"] or r is ref:
            continue
        diff = max_rel_diff(r["losses"], ref["losses"])
        if r["precision"] == "fp32":
            tol, basis = FP32_RTOL, "fp32: operation order only"
        elif twin_diff is not None and r["optimizer"] != twin:
            tol = BF16_FACTOR * twin_diff + BF16_SLACK
            basis = f"bf16: {BF16_FACTOR:g} x the bf16-rounding twin's difference + {BF16_SLACK:g}"
        else:
            tol, basis = BF16_FALLBACK_RTOL, "bf16: fixed bound (no twin in this run)"
        check = {"reference": reference, "max_rel_diff": diff, "tolerance": tol, "basis": basis,
                 "agrees": diff is not None and diff <= tol}
        if drifts and r["optimizer"] in drifts:
            check["expected_drift"] = drifts[r["optimizer"]]
        if twin in by_name and r["optimizer"] != twin and r["precision"] == "bf16":
            check["max_rel_diff_to_twin"] = max_rel_diff(r["losses"], by_name[twin]["losses"])
        other = (relatives or {}).get(r["optimizer"])
        if other in by_name:
            check["relative_to"] = other
            check["max_rel_diff_to_relative"] = max_rel_diff(r["losses"], by_name[other]["losses"])
        r["loss_check"] = check


def add_exposed(rows: list[dict]) -> None:
    """exposed_s = median iteration - median iteration of the no-optimizer run with the same param dtype
    and autocast: everything the optimizer adds, including work it does inside backward."""
    base = {(r["param_dtype"], r["autocast"]): r for r in rows
            if r["baseline"] and r.get("status") == "ok" and "timing" in r}
    for r in rows:
        b = base.get((r["param_dtype"], r["autocast"]))
        if b is not None and not r["baseline"] and "timing" in r:
            r["timing"]["exposed_s"] = r["timing"]["iteration_s"] - b["timing"]["iteration_s"]


# ---- the table --------------------------------------------------------------------------------------


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _mib(x: Optional[int]) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


def table(report: dict) -> str:
    cuda = report["config"]["device"] == "cuda"
    head = ["optimizer", "params", "iter ms", "fwd+bwd", "step", "exposed", "d2h", "cpu step", "h2d"]
    head += ["peak GPU MiB"] if cuda else []
    head += ["host MiB", "final loss", "max rel diff", "loss"]
    out = []
    for batch in report["config"]["batches"]:
        rows = [r for r in report["runs"] if r["batch"] == batch]
        body = []
        for r in rows:
            t = r.get("timing", {})
            p = r.get("offload_profile", {})
            lc = r.get("loss_check")
            if r["status"] != "ok":
                body.append([r["optimizer"], r["param_dtype"], f"{r['status']}: {r.get('reason', '')}"])
                continue
            host = r.get("host_offload_bytes")
            host = host if host is not None else r.get("optimizer_state_bytes")
            line = [r["optimizer"], r["param_dtype"] + ("+amp" if r["autocast"] else ""),
                    _ms(t.get("iteration_s")), _ms(t.get("fwd_bwd_s")), _ms(t.get("optimizer_s")),
                    _ms(t.get("exposed_s")), _ms(p.get("d2h_s")), _ms(p.get("cpu_step_s")), _ms(p.get("h2d_s"))]
            line += [_mib(r.get("peak_gpu_bytes"))] if cuda else []
            line += [_mib(host), f"{r['losses'][-1]:.4f}" if r["losses"] else "-"]
            if r["baseline"]:
                line += ["", "(baseline)"]
            elif lc is None:
                line += ["-", "reference" if r["optimizer"] == report["config"]["reference"] else "-"]
            else:
                verdict = ("agrees" if lc["agrees"] else
                           "drifts (expected)" if lc.get("expected_drift") else "DISAGREES")
                line += [f"{lc['max_rel_diff']:.2e}", verdict]
            body.append(line)
        widths = [max(len(str(x[i])) for x in [head] + [b for b in body if len(b) == len(head)])
                  for i in range(len(head))]
        m = report["config"]["model"]
        out.append(f"batch {batch} x {m['seq_len']} tokens, model {report['config']['size']} "
                   f"({m['layers']} layers x {m['width']}, {report['config']['num_params'] / 1e6:.2f} M params), "
                   f"{report['config']['timed_steps']} timed steps")
        out.append("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
        for b in body:
            if len(b) != len(head):
                out.append(f"{b[0].ljust(widths[0])}  {b[1].rjust(widths[1])}  {b[2]}")
            else:
                out.append("  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                                     for i, (x, w) in enumerate(zip(b, widths))))
        out.append("")
        out.extend(_relative_lines(rows, report["config"]["reference"]))
    out.append("ms: medians over the timed steps. step = time in opt.step()+zero_grad(); exposed = iteration - "
               "the no-optimizer iteration; d2h/cpu step/h2d: offload_adam's own profile. host MiB: the "
               "optimizer's host bytes (offload buffers, or its state). max rel diff: largest per-step "
               "|loss - reference| / reference.")
    return "\n".join(out)


def _relative_lines(rows: list[dict], reference: str) -> list[str]:
    """The contenders compared with another (the state formats with fp32 moments), beside the
    drift of pure-bf16 AdamW for scale."""
    related = [r for r in rows if (r.get("loss_check") or {}).get("relative_to")]
    if not related:
        return []
    by_name = {r["optimizer"]: r for r in rows}
    out = ["loss curves against another contender's (largest per-step |loss - other| / other):"]
    for r in related:
        lc = r["loss_check"]
        out.append(f"  {r['optimizer']:<28} vs {lc['relative_to']:<16} {lc['max_rel_diff_to_relative']:.2e}"
                   f"   final loss {r['losses'][-1]:.4f} (other {by_name[lc['relative_to']]['losses'][-1]:.4f})")
    for name in ("torch_adamw_bf16", "torch_master_bf16"):
        lc = (by_name.get(name) or {}).get("loss_check")
        if lc:
            out.append(f"  for scale: {name:<17} vs {reference:<16} {lc['max_rel_diff']:.2e}")
    return out + [""]


# ---- JSON -------------------------------------------------------------------------------------------


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")


_RUN_KEYS = {"optimizer": str, "label": str, "batch": int, "param_dtype": str, "precision": str,
             "baseline": bool, "status": str}


def validate(report: dict) -> list[str]:
    """Problems with a report's shape (empty when it is well formed)."""
    problems = []
    for key, kind in (("schema", str), ("machine", dict), ("config", dict), ("runs", list),
                      ("wall_s", (int, float))):
        if not isinstance(report.get(key), kind):
            problems.append(f"top-level {key!r} missing or not {kind}")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema is {report['schema']!r}, expected {SCHEMA!r}")
    for key in ("cpu_model", "cpu_cores", "torch", "gpu", "offload_adam_isa"):
        if key not in report["machine"]:
            problems.append(f"machine.{key} missing")
    for key in ("device", "size", "model", "batches", "steps", "warmup", "optimizers", "reference"):
        if key not in report["config"]:
            problems.append(f"config.{key} missing")
    for i, r in enumerate(report["runs"]):
        for key, kind in _RUN_KEYS.items():
            if not isinstance(r.get(key), kind):
                problems.append(f"runs[{i}].{key} missing or not {kind.__name__}")
        if r.get("status") not in ("ok", "skipped", "failed", "oom"):
            problems.append(f"runs[{i}].status {r.get('status')!r} unknown")
        if r.get("status") in ("skipped", "failed", "oom") and not r.get("reason"):
            problems.append(f"runs[{i}] is {r.get('status')} without a reason")
        if r.get("status") == "ok":
            t = r.get("timing")
            if not isinstance(r.get("losses"), list) or len(r["losses"]) != report["config"]["steps"]:
                problems.append(f"runs[{i}].losses is not one loss per step")
            if not isinstance(t, dict):
                problems.append(f"runs[{i}].timing missing")
            else:
                for key in ("iteration_s", "fwd_bwd_s", "optimizer_s", "other_s"):
                    if not isinstance(t.get(key), float):
                        problems.append(f"runs[{i}].timing.{key} missing")
                parts = sum(t.get(k, 0.0) for k in ("fwd_bwd_s", "optimizer_s", "other_s"))
                if abs(parts - t.get("iteration_s", 0.0)) > 1e-6 * max(1.0, parts):
                    problems.append(f"runs[{i}].timing parts do not sum to iteration_s")
            lc = r.get("loss_check")
            if lc is not None and not {"reference", "max_rel_diff", "tolerance", "agrees"} <= lc.keys():
                problems.append(f"runs[{i}].loss_check incomplete")
    sweep = report.get("sweep")
    if sweep is not None:
        for name, s in sweep.get("results", {}).items():
            if "bound" not in s or "largest" not in s:
                problems.append(f"sweep.results.{name} lacks bound/largest")
    return problems

"""Tests of the end-to-end benchmark's pieces (bench/e2e), on CPU with tiny configurations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks (bench/) are not installed with the package

from bench.e2e import contenders as C  # noqa: E402
from bench.e2e.data import MarkovTokens  # noqa: E402
from bench.e2e.model import GPTConfig, build_model, config_for  # noqa: E402
from bench.e2e.report import check_losses, table, validate  # noqa: E402
from bench.e2e.sweep import largest_trainable, size_family  # noqa: E402
from bench.e2e.timing import IterationClock, median_split  # noqa: E402
TINY = GPTConfig(vocab_size=32, seq_len=16, layers=2, width=32, heads=2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy CI machine OpenMP threads waiting for each
    other make them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- model ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("param_dtype,compute_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                                       (torch.bfloat16, None)])
def test_model_shapes_and_grads(param_dtype, compute_dtype):
    model = build_model(TINY, "cpu", param_dtype, compute_dtype)
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params()
    assert all(p.dtype == param_dtype for p in model.parameters())
    tokens = torch.randint(TINY.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, TINY.vocab_size)
    assert logits.dtype == (compute_dtype or param_dtype)
    loss = model(tokens, torch.randint(TINY.vocab_size, (3, 10)))
    assert loss.shape == () and loss.dtype == torch.float32
    loss.backward()
    for name, p in model.named_parameters():
        if name == "pos_emb":  # rows past position 10 get no gradient but the tensor has one
            assert p.grad is not None
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == param_dtype, name


def test_model_init_is_deterministic_and_bf16_is_fp32_rounded():
    a = build_model(TINY, "cpu", torch.float32, seed=3)
    b = build_model(TINY, "cpu", torch.bfloat16, seed=3)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.to(torch.bfloat16), pb), n
    c = build_model(TINY, "cpu", torch.float32, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_model_rejects_long_sequences_and_bad_configs():
    model = build_model(TINY, "cpu", torch.float32)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTConfig(width=30, heads=4)
    assert config_for(24, 1024, 8192, 1024).heads == 16


# ---- data -------------------------------------------------------------------------------------------

def test_data_is_deterministic_and_shifted():
    data = MarkovTokens(64, seed=1)
    b1 = data.batches(3, 4, 16)
    b2 = MarkovTokens(64, seed=1).batches(3, 4, 16)
    assert len(b1) == 3
    for (x, y), (x2, y2) in zip(b1, b2):
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
        # every transition is one the chain allows
        assert torch.isfinite(data._logp[x, y]).all()
    x, y = b1[0]
    assert data.optimal_loss(x, y) < 0.5 * data.uniform_loss()


def test_data_is_learnable():
    torch.manual_seed(0)
    data = MarkovTokens(TINY.vocab_size, seed=0)
    model = build_model(TINY, "cpu", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data.batches(25, 8, TINY.seq_len):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - data.uniform_loss()) < 0.3      # starts knowing nothing
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5           # and learns within a few steps


# ---- timing -----------------------------------------------------------------------------------------

def test_timing_split_sums():
    clock = IterationClock(torch.device("cpu"))
    samples = []
    for _ in range(3):
        clock.start()
        time.sleep(0.02)
        clock.lap("fwd_bwd")
        time.sleep(0.01)
        clock.lap("optimizer")
        time.sleep(0.005)
        s = clock.stop()
        assert s["fwd_bwd_s"] >= 0.02 and s["optimizer_s"] >= 0.01 and s["other_s"] >= 0.004
        assert s["fwd_bwd_s"] + s["optimizer_s"] + s["other_s"] == pytest.approx(s["iteration_s"], abs=1e-12)
        marks = clock.mark_offsets()
        assert marks["fwd_bwd"] == pytest.approx(s["fwd_bwd_s"])
        assert marks["optimizer"] == pytest.approx(s["fwd_bwd_s"] + s["optimizer_s"])
        samples.append(s)
    med = median_split(samples)
    assert med["fwd_bwd_s"] + med["optimizer_s"] + med["other_s"] == pytest.approx(med["iteration_s"])


# ---- contenders -------------------------------------------------------------------------------------

def test_peers_report_why_they_do_not_run_on_cpu():
    cpu = torch.device("cpu")
    for name in ("torchao_offload", "torchao_offload_grads", "deepspeed_cpu_adam"):
        reason = C.CONTENDERS[name].unavailable(cpu)
        assert reason and ("not installed" in reason or "CPU-only" in reason)
    assert "GPU baseline" in C.CONTENDERS["torch_adamw_amp"].unavailable(cpu)
    assert C.CONTENDERS["torch_adamw_fp32"].unavailable(cpu) is None
    with pytest.raises(ValueError, match="unknown optimizer"):
        C.resolve(["adamw_typo"])


def test_master_weights_twin_matches_torch_adamw_on_fp32():
    """The twin's arithmetic is torch AdamW on the fp32 masters: with fp32 params it is torch AdamW."""
    hp = C.HParams(lr=1e-2)
    a = build_model(TINY, "cpu", torch.float32)
    b = build_model(TINY, "cpu", torch.float32)
    opt_a = C.CONTENDERS["torch_adamw_fp32"].build(a, hp)
    opt_b = C.MasterWeights(b, lambda ms: torch.optim.AdamW(ms, fused=True, **hp.adam_kwargs()), "cpu")
    for x, y in MarkovTokens(TINY.vocab_size).batches(3, 2, TINY.seq_len):
        for m, o in ((a, opt_a), (b, opt_b)):
            m(x, y).backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---- size sweep -------------------------------------------------------------------------------------

def _fake_try(limit_params, status="oom", reason="CUDA out of memory"):
    def try_size(c, cfg):
        if cfg.num_params() > limit_params:
            return {"status": status, "reason": reason}
        return {"status": "ok", "timing": {"iteration_s": cfg.num_params() * 1e-9}}
    return try_size


def test_sweep_finds_the_largest_size_and_names_the_bound():
    fam = size_family(256, 64)
    sizes = [cfg.num_params() for _, cfg in fam]
    assert sizes == sorted(sizes)
    c = C.CONTENDERS["offload_adam"]
    far = time.monotonic() + 60
    r = largest_trainable(c, fam, _fake_try(sizes[4]), None, far)
    assert r["largest_params"] == sizes[4] and r["bound"] == "GPU memory"
    assert [p["status"] for p in r["points"]] == ["ok"] * 5 + ["oom"]
    # host RAM: checked before trying, from the contender's bytes per param
    r = largest_trainable(c, fam, _fake_try(10**15), host_available_bytes=16 * sizes[3] / 0.9 + 1,
                          deadline=far)
    assert r["largest_params"] == sizes[3] and r["bound"] == "host RAM"
    # ... or the optimizer refuses
    r = largest_trainable(c, fam, _fake_try(sizes[2], "failed", "RuntimeError: not enough host memory"),
                          None, far)
    assert r["bound"] == "host RAM" and r["largest_params"] == sizes[2]
    r = largest_trainable(c, fam, _fake_try(10**15), None, deadline=time.monotonic() - 1)
    assert r["bound"] == "time budget" and r["largest"] is None
    r = largest_trainable(c, fam, _fake_try(10**15), None, far)
    assert r["bound"] == "all sizes fit" and r["largest"] == fam[-1][0]


# ---- report -----------------------------------------------------------------------------------------

def _row(name, losses, precision="bf16", baseline=False):
    return {"optimizer": name, "status": "ok", "losses": losses, "precision": precision, "baseline": baseline}


def test_loss_check_tolerances():
    ref = [4.0, 3.0, 2.0]
    rows = [_row("torch_adamw_fp32", ref, "fp32"),
            _row("torch_master_bf16", [4.0, 3.003, 2.002]),              # twin: 1e-3
            _row("offload_adam", [4.0, 3.003, 2.004]),                  # 2e-3 <= 2 * 1e-3 + 2e-3
            _row("torch_adamw_bf16", [4.0, 3.1, 2.2]),                  # 0.1 > tolerance
            _row("offload_adam_fp32", [4.0, 3.0, 2.0000001], "fp32"),
            _row("no_optimizer[float32]", [4.0, 4.0, 4.0], "fp32", baseline=True)]
    check_losses(rows, "torch_adamw_fp32", "torch_master_bf16")
    by = {r["optimizer"]: r for r in rows}
    assert by["offload_adam"]["loss_check"]["agrees"]
    assert by["offload_adam"]["loss_check"]["max_rel_diff_to_twin"] == pytest.approx(2e-3 / 2.002)
    assert not by["torch_adamw_bf16"]["loss_check"]["agrees"]
    assert by["offload_adam_fp32"]["loss_check"]["agrees"]
    assert by["torch_master_bf16"]["loss_check"]["agrees"]
    assert "loss_check" not in by["no_optimizer[float32]"] and "loss_check" not in by["torch_adamw_fp32"]


# ---- the CLI, end to end ----------------------------------------------------------------------------

def _bench(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = (*args, "--threads", "1") if "--help" not in args else args
    return subprocess.run([sys.executable, "-m", "bench.e2e", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_help():
    r = _bench("--help", timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--size", "--layers", "--width", "--steps", "--optimizers", "--out", "--batch", "--quick"):
        assert flag in r.stdout


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny run of torch's optimizers only (no kernel build involved), two batch sizes."""
    out = tmp_path_factory.mktemp("e2e")
    r = _bench("--quick", "--steps", "5", "--warmup", "2", "--batch", "2,3", "--micro-batch", "2",
               "--optimizers", "torch_adamw_fp32,torch_adamw_bf16,torch_master_bf16,torchao_offload",
               "--out", str(out), "--no-progress", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    return r, out, json.loads((out / "results.json").read_text())


def test_tiny_end_to_end_run(tiny_run):
    r, out, report = tiny_run
    assert validate(report) == []
    assert "torch_adamw_fp32" in r.stdout and "reference" in r.stdout
    runs = {(x["optimizer"], x["batch"]): x for x in report["runs"]}
    assert set(b for _, b in runs) == {2, 3}
    assert runs[("torch_master_bf16", 3)]["accumulation"] == 2         # 3 sequences in micro-batches of 2
    assert runs[("torchao_offload", 2)]["status"] == "skipped" and runs[("torchao_offload", 2)]["reason"]
    assert runs[("no_optimizer[bfloat16]", 2)]["baseline"]
    for batch in (2, 3):
        row = runs[("torch_master_bf16", batch)]
        assert row["status"] == "ok" and row["loss_check"]["agrees"]
        assert "exposed_s" in row["timing"] and len(row["losses"]) == 5
    m = report["machine"]
    assert m["cpu_cores"] >= 1 and m["torch"] == torch.__version__


def test_tiny_end_to_end_run_with_offload_adam(tmp_path):
    """offload_adam on bf16 params against its exact twin. The first run on a machine compiles the
    kernels (about a minute on 2 cores); the timeout allows for it."""
    r = _bench("--quick", "--steps", "4", "--warmup", "1", "--out", str(tmp_path), "--no-progress",
               "--no-plots", "--optimizers", "torch_adamw_fp32,torch_master_bf16,offload_adam,offload_adam_fp32",
               timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "results.json").read_text())
    assert validate(report) == []
    runs = {x["optimizer"]: x for x in report["runs"]}
    for name in ("offload_adam", "offload_adam_fp32"):
        assert runs[name]["status"] == "ok", runs[name].get("reason")
        assert runs[name]["loss_check"]["agrees"], runs[name]["loss_check"]
    # bf16 params through an fp32 master: the same curve as torch AdamW on fp32 masters
    assert runs["offload_adam"]["loss_check"]["max_rel_diff_to_twin"] < 1e-3
    assert report["machine"]["offload_adam_isa"] in ("avx512", "avx2", "scalar")


def test_report_table_and_schema_catch_problems(tiny_run):
    _, _, report = tiny_run
    text = table(report)
    assert "iter ms" in text and "skipped" in text
    broken = json.loads(json.dumps(report))
    broken["runs"][0]["timing"]["other_s"] += 1.0
    del broken["machine"]["gpu"]
    problems = validate(broken)
    assert any("sum" in p for p in problems) and any("machine.gpu" in p for p in problems)


def test_plots_are_pngs(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    from bench.e2e.plots import write_plots
    _, out, report = tiny_run
    for f in report["plots"]["files"]:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {Path(f).name for f in report["plots"]["files"]} >= {"losses.png", "split.png"}
    # the timeline and sweep plots, from a synthetic profile and sweep
    report = json.loads(json.dumps(report))
    row = next(r for r in report["runs"] if r["status"] == "ok" and not r["baseline"])
    row["timeline"] = {"iteration_start_s": 10.0, "marks": {"fwd_bwd": 0.02, "optimizer": 0.03},
                       "buckets": [{"bucket": b, "phase": ph, "start_s": 10.0 + 0.005 * b + dt,
                                    "end_s": 10.0 + 0.005 * b + dt + 0.004}
                                   for b in range(3) for ph, dt in (("d2h", 0.0), ("cpu_step", 0.02),
                                                                    ("h2d", 0.025))]}
    report["sweep"] = {"batch": 1, "seq_len": 16, "results": {
        "offload_adam": {"largest": "small", "largest_params": 3e6, "bound": "host RAM", "detail": "",
                         "points": [{"params": 1e5, "iteration_s": 0.01}, {"params": 3e6, "iteration_s": 0.1}]},
        "torch_adamw_amp": {"largest": "tiny", "largest_params": 1e5, "bound": "GPU memory", "detail": "",
                            "points": [{"params": 1e5, "iteration_s": 0.01}]}}}
    files = write_plots(report, str(tmp_path))["files"]
    assert {Path(f).name for f in files} == {"losses.png", "split.png", "timeline.png", "sweep.png"}
    for f in files:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""bench/step_bench.py runs end to end on a tiny size: table header, JSON schema, ratios consistent with times,
for every case (fp32, mixed, and the mixed shape with bf16 and 8-bit moments)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "step_bench.py"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    # Build (or load) the kernels here first, so the subprocess's time is the benchmark's, not the compiler's.
    from offload_adam._build import load_kernels
    load_kernels()
    out = tmp_path_factory.mktemp("step_bench")
    cmd = [sys.executable, str(SCRIPT), "--numel", "5003", "--tensors", "3", "--steps", "4", "--warmup", "1",
           "--threads", "1", "--tag", "pytest", "--out", str(out), "--no-plot",
           "--no-deepspeed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads((out / "step_bench_pytest.json").read_text())


def test_table_header_and_machine_line(bench_run):
    stdout, _ = bench_run
    assert stdout.startswith("offload_adam step microbenchmark: 5,003 params in 3 tensors")
    assert "machine: " in stdout and "1 threads" in stdout and "torch " in stdout
    for col in ("contender", "median ms", "min ms", "max ms", "ns/param", "GB/s", "limit/t", "t/ours"):
        assert col in stdout
    for case in ("fp32", "mixed", "bf16_moments", "q8_moments"):
        assert f"[{case}]" in stdout
    assert "deepspeed: unavailable: skipped (--no-deepspeed)" in stdout


def test_json_schema(bench_run):
    _, doc = bench_run
    assert doc["schema"] == "offload_adam.step_bench/3"
    m = doc["machine"]
    for key in ("host", "date", "cpu_model", "logical_cpus", "threads", "isas_supported", "isa_default",
                "torch", "cpu_flags", "deepspeed"):
        assert key in m
    assert m["threads"] == 1 and m["isas_supported"] and m["deepspeed"]["available"] is False
    assert doc["config"]["numel"] == 5003 and doc["config"]["tensors"] == 3
    assert set(doc["cases"]) == {"fp32", "mixed", "bf16_moments", "q8_moments"}
    bytes_per_param = {"fp32": 28, "mixed": 28, "bf16_moments": 20, "q8_moments": 16 + 16 / 256}
    formats = {"fp32": "fp32", "mixed": "fp32", "bf16_moments": "bf16", "q8_moments": "q8"}
    for case, res in doc["cases"].items():
        assert res["bytes_per_param"] == bytes_per_param[case] and res["moment_format"] == formats[case]
        names = {r["name"] for r in res["results"]}
        for isa in m["isas_supported"]:
            assert f"ours[{isa}]" in names and f"limit[{isa}]" in names
        if case in ("bf16_moments", "q8_moments"):  # no peers: paired with our fp32-moment kernel
            for isa in m["isas_supported"]:
                assert f"ours fp32 moments[{isa}]" in names
            assert not any(r["kind"] in ("torch", "deepspeed") for r in res["results"])
        vector = [i for i in m["isas_supported"] if i != "scalar"] or ["scalar"]
        assert {f"ours AdamW class[{isa}]" for isa in vector} <= names  # the class on every vector ISA
        if case in ("bf16_moments", "q8_moments"):
            continue
        assert any(r["kind"] == "torch" for r in res["results"])
        ds = [r for r in res["results"] if r["kind"] == "deepspeed"]
        assert ds and all(r["status"] == "unavailable" and r["reason"] == "skipped (--no-deepspeed)" for r in ds)


def paired_ratio(slow, fast):
    """The median over passes of slow / fast (the fixture runs 4 passes)."""
    per_pass = sorted(a / b for a, b in zip(slow, fast))
    return (per_pass[1] + per_pass[2]) / 2


def test_numbers_consistent(bench_run):
    _, doc = bench_run
    n = doc["config"]["numel"]
    expected_samples = doc["config"]["steps"]
    for case, res in doc["cases"].items():
        ok = {r["name"]: r for r in res["results"] if r["status"] == "ok"}
        # Our kernels, the limits and torch must all have run; only optional peers may be unavailable.
        for r in res["results"]:
            if r["kind"] in ("ours", "ours_class", "limit", "torch", "ours_fp32_moments"):
                assert r["status"] == "ok", (case, r)
        for r in ok.values():
            assert len(r["times_s"]) == expected_samples
            assert all(t > 0 for t in r["times_s"])
            assert r["min_s"] <= r["median_s"] <= r["max_s"]
            assert math.isclose(r["ns_per_param"], r["median_s"] / n * 1e9, rel_tol=1e-9)
            assert math.isclose(r["gb_per_s"], res["bytes_per_param"] * n / r["median_s"] / 1e9, rel_tol=1e-9)
            lim = ok[r["limit_name"]]
            assert math.isclose(r["vs_limit"], lim["median_s"] / r["median_s"], rel_tol=1e-9)
        best = ok[res["best_ours"]]
        assert best["median_s"] == min(r["median_s"] for r in ok.values() if r["kind"] == "ours")
        for r in ok.values():
            assert math.isclose(r["ours_speedup"], r["median_s"] / best["median_s"], rel_tol=1e-9)
        ratios = res["ratios"]
        limit = ok[res["best_limit"]]
        assert math.isclose(ratios["ours_vs_limit"], limit["median_s"] / best["median_s"], rel_tol=1e-9)
        # paired ratios: the median over passes of the two times of the same pass
        paired = res["ratios_paired"]
        assert math.isclose(paired["ours_vs_limit"], paired_ratio(limit["times_s"], best["times_s"]), rel_tol=1e-9)
        for r in ok.values():
            if r["kind"] in ("ours", "ours_class"):
                assert math.isclose(paired[f"{r['name']}_vs_limit[{r['isa']}]"],
                                    paired_ratio(ok[f"limit[{r['isa']}]"]["times_s"], r["times_s"]), rel_tol=1e-9)
                if res["moment_format"] != "fp32":
                    fp32m = ok[f"ours fp32 moments[{r['isa']}]"]
                    assert math.isclose(paired[f"{r['name']}_vs_fp32_moments[{r['isa']}]"],
                                        paired_ratio(fp32m["times_s"], r["times_s"]), rel_tol=1e-9)
        if res["moment_format"] != "fp32":
            continue
        torch_best = ok[res["best_torch"]]
        assert math.isclose(ratios["ours_vs_torch_best"], torch_best["median_s"] / best["median_s"], rel_tol=1e-9)
        for name, r in ok.items():
            if r["kind"] == "torch":
                assert math.isclose(ratios[f"ours_vs[{name}]"], r["median_s"] / best["median_s"], rel_tol=1e-9)
        torch_rows = [r for r in ok.values() if r["kind"] == "torch"]
        fastest = [min(r["times_s"][i] for r in torch_rows) for i in range(expected_samples)]
        assert math.isclose(paired["ours_vs_torch_best"], paired_ratio(fastest, best["times_s"]), rel_tol=1e-9)


def test_llama_shapes(tmp_path):
    """--shapes llama: the param set of a Llama-style decoder at about --numel params."""
    cmd = [sys.executable, str(SCRIPT), "--numel", "3000000", "--shapes", "llama", "--cases", "mixed",
           "--steps", "2", "--warmup", "1", "--threads", "1", "--tag", "llama", "--out", str(tmp_path),
           "--no-plot", "--no-deepspeed", "--only", r"class|limit\["]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "step_bench_llama.json").read_text())
    assert doc["config"]["shapes"] == "llama"
    assert "of a Llama-style decoder" in proc.stdout
    assert doc["config"]["tensors"] == 1 + 6 * 9 + 2  # embedding, 6 layers of 9, final norm, head
    res = doc["cases"]["mixed"]
    assert all(r["status"] == "ok" for r in res["results"])
    assert any(r["kind"] == "ours_class" for r in res["results"])

"""FSDP2 on 2 ranks (gloo, CPU): each rank steps its shards; nothing is gathered.

The scenarios run in two processes started once for this module
(tests/distributed_ranks.py, ~20 s on 2 cores); each test below checks one of
them on both ranks. "_engine" scenarios go through the offload engine on the
simulated device, the others step in place. The model's dims are uneven (15
rows over 2 ranks, and a one-row head: rank 1 holds empty shards).
"""
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORLD = 2
RANKS = Path(__file__).with_name("distributed_ranks.py")

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch was built without torch.distributed / gloo")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, names=()):
    """Runs the named scenarios (default: all but the kill's, which run alone) on WORLD
    ranks writing into `out`; each rank's exit code and results: [(code, results), ...]."""
    port = _free_port()
    # The children import this checkout's offload_adam, as pytest does.
    repo = str(RANKS.parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(r), str(WORLD), str(port),
                               str(out), *names],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for r, p in enumerate(procs):
        path = out / f"rank{r}.json"
        if p.returncode == -9:   # a rank the scenario killed
            results.append((p.returncode, None))
            continue
        assert path.is_file(), f"rank {r} wrote no results:\n" + "\n".join(logs)
        results.append((p.returncode, json.loads(path.read_text())))
        path.unlink()
    return results


@pytest.fixture(scope="module")
def ranks(kernels, tmp_path_factory):
    """Every scenario's results, per rank: [rank0 results, rank1 results]."""
    return [res for _, res in launch(tmp_path_factory.mktemp("fsdp2"))]


def result(ranks, name):
    """The scenario's measurements on each rank (fails with its traceback)."""
    out = []
    for r, res in enumerate(ranks):
        assert name in res, f"scenario {name} did not run on rank {r}"
        assert res[name]["ok"], f"rank {r}, {name}:\n{res[name]['error']}"
        out.append(res[name])
    return out


# ---- results against torch / an fp32-master reference ----------------------------

@pytest.mark.parametrize("variant", ["inplace", "engine", "mixed", "accumulate", "accumulate_engine"])
def test_fsdp2_fp32_params_match_torch_adamw(ranks, variant):
    # fp32 sharded params (mixed: MixedPrecisionPolicy(param_dtype=bf16,
    # reduce_dtype=fp32); accumulate: 3 micro-batches, gradient sync only on the
    # last) with max_grad_norm=, against torch AdamW + clip_grad_norm_ under the
    # same FSDP2 setup: equal to fp32 rounding, on each rank's shards.
    for res in result(ranks, f"against_torch_{variant}"):
        assert res["params"]["max_rel"] < 1e-6, res
        assert res["moments"]["max_rel"] < 1e-6, res
        assert max(res["torch_norms"]) > 0.5   # the clip did clip


def test_fsdp2_uneven_shards(ranks):
    r0, r1 = result(ranks, "against_torch_inplace")
    assert r0["local_shapes"][0] == [8, 8] and r1["local_shapes"][0] == [7, 8]
    assert r0["local_shapes"][-1] == [1] and r1["local_shapes"][-1] == [0]   # an empty shard


GRAD_PLACES = ["inplace", "engine", "engine_freed", "engine_no_overlap"]


@pytest.mark.parametrize("variant", GRAD_PLACES)
def test_fsdp2_bf16_params_match_fp32_master_reference(ranks, variant):
    for res in result(ranks, f"bf16_master_{variant}"):
        assert res["master"]["max_rel"] < 1e-6, res
        assert res["bf16_elements_differing"] <= res["elements"] // 100, res


# ---- clipping: the global norm ----------------------------------------------------

@pytest.mark.parametrize("variant", GRAD_PLACES)
def test_fsdp2_clip_grad_norm_is_the_global_norm(ranks, variant):
    results = result(ranks, f"clip_norm_{variant}")
    for res in results:
        assert math.isclose(res["ours"], res["float64"], rel_tol=1e-6), res
        # torch's norm of bf16 grads is computed in bf16 (engine variant).
        assert math.isclose(res["ours"], res["theirs"], rel_tol=1e-6 if variant == "inplace" else 1e-2)
        assert res["local"] < res["ours"] * 0.9                  # not this rank's norm
        assert (res["ours_type"], res["ours_placements"]) == (
            res["theirs_type"], res["theirs_placements"]) == ("DTensor", "(Replicate(),)")
    assert results[0]["ours"] == results[1]["ours"]
    assert results[0]["local"] != results[1]["local"]


def test_clip_grad_norm_over_a_process_group(ranks):
    for res in result(ranks, "clip_process_group"):
        assert math.isclose(res["ours"], res["expected"], rel_tol=1e-6), res
        assert math.isclose(res["without_group"], res["local"], rel_tol=1e-6), res


# ---- checkpoints --------------------------------------------------------------------

RESUMES = [f"{how}_{v}" for how, variants in (
    ("plain", ("fp32", "bf16", "bf16_engine")),       # opt.load_state_dict(opt.state_dict())
    ("dcp", ("fp32", "bf16", "bf16_engine",           # get_state_dict + dcp.save / dcp.load
             "bf16_bf16moments", "bf16_bf16moments_engine",   # state_dtype=torch.bfloat16
             "bf16_8bit", "bf16_8bit_engine")),               # state_dtype="8bit" (saved as fp32)
    ("full", ("bf16", "bf16_engine")),                # full_state_dict=True on every rank
    ("broadcast", ("fp32", "bf16", "bf16_engine")),   # cpu_offload on rank 0, broadcast_from_rank0
) for v in variants]


@pytest.mark.parametrize("name", RESUMES)
def test_fsdp2_checkpoint_resumes_bitwise(ranks, name):
    results = result(ranks, f"resume_{name}")
    for res in results:
        assert res["params_bitwise"] and res["state_bitwise"], res
        assert res["state_entries"] >= 18
        if "saved_state_types" in res:   # DCP saw the moments as DTensors (sharded)
            assert res["saved_state_types"] == ["DTensor"]
    if name.startswith("broadcast"):
        assert [r["rank_holds_full_state"] for r in results] == [True, False]


def test_state_dict_shows_dtensors_of_the_params_layout(ranks):
    for res in result(ranks, "state_layout"):
        assert res["types"] == {"exp_avg": "DTensor", "exp_avg_sq": "DTensor",
                                "master_param": "DTensor", "step": "Tensor"}, res
        assert res["same_layout_as_param"] and res["local_is_the_state"], res


@pytest.mark.parametrize("variant", ["fp32", "bf16", "bf16_engine", "bf16_8bit"])
def test_fsdp2_state_on_disk_one_folder_per_rank(ranks, variant):
    """state_dirs= under FSDP2 (distributed_ranks.nvme): bitwise the RAM optimizer, through
    a DCP checkpoint into a fresh model, as in RAM through a state dict without masters loaded
    before the model, and resumed from the files on fresh params."""
    for res in result(ranks, f"nvme_{variant}"):
        assert res["rank_folders"] == ["rank0", "rank1"], res
        assert res["disk_bitwise"] and res["dcp_bitwise"], res
        assert res["optimizer_first_bitwise"], res
        assert res["resume_bitwise"] and res["resumed_steps_bitwise"], res


def test_a_rank_refusing_its_state_files_is_refused_by_every_rank(ranks):
    """distributed_ranks.nvme_one_rank_refused: rank 0's files are of another layout, rank
    1 has none: both raise (rank 1 naming rank 0's refusal), neither waits."""
    rank0, rank1 = result(ranks, "nvme_one_rank_refused")
    assert "of another model or optimizer" in rank0["error"], rank0
    assert rank1["error"].startswith("offload_adam: rank 0 refused its state files, so every "
                                     "rank does: "), rank1
    assert "of another model or optimizer" in rank1["error"], rank1


def test_a_state_damaged_on_one_rank_is_refused_by_every_rank(ranks):
    """distributed_ranks.nvme_damaged_on_one_rank: the resume's restore finds rank 1's
    files damaged after the ranks agreed on the step: both raise, rank 0 naming rank 1."""
    rank0, rank1 = result(ranks, "nvme_damaged_on_one_rank")
    assert rank1["error"] is not None and "damaged" in rank1["error"], rank1
    assert rank0["error"] is not None and rank0["error"].startswith(
        "ValueError: offload_adam: rank 1 refused its state files, so every rank does: "), rank0
    assert "damaged" in rank0["error"], rank0


def test_a_refusal_before_the_files_is_refused_by_every_rank(ranks):
    """distributed_ranks.resume_refused_before_the_files: rank 1 refused before opening
    its files (a DDP replica's directory missing; an engine not made after the options
    were compared): rank 0 raises naming it, instead of waiting for rank 1 in its files'
    first collective."""
    rank0, rank1 = result(ranks, "resume_refused_before_the_files")
    assert "does not exist" in rank1["ddp"], rank1
    assert rank0["ddp"].startswith("ValueError: offload_adam: rank 1 refused its state "
                                   "files, so every rank does: ValueError: "), rank0
    assert "does not exist" in rank0["ddp"], rank0
    assert "no page-locked memory left" in rank1["engine"], rank1
    assert rank0["engine"].startswith("ValueError: offload_adam: rank 1 refused its state "
                                      "files, so every rank does: RuntimeError: no "
                                      "page-locked"), rank0


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_step_failed_on_one_rank_raises_on_every_rank(ranks, footprint):
    """distributed_ranks.step_failed_on_one_rank: rank 1's files refuse its step part way:
    both ranks' step() raise, rank 0 naming rank 1's error; rebuilt with state_resume=True
    they resume from one step."""
    rank0, rank1 = result(ranks, f"step_failed_on_one_rank_{footprint}")
    assert rank1["error"] is not None and "lock" in rank1["error"], rank1
    assert rank0["error"] is not None and "offload_adam: rank 1's step() failed" in (
        rank0["error"]), rank0
    assert "lock" in rank0["error"], rank0
    assert rank0["resumed"] == rank1["resumed"] and rank0["resumed"][0] in (2, 3), rank0


def test_a_rank_folder_without_state_beside_others_with_state_is_hinted(tmp_path):
    """A resume that finds no step in its rank's folder while the folders of other ranks
    beside it hold state (per-rank directories given to other ranks after a restart) says
    so in its warning, naming them (found from outside: both ranks started afresh with a
    warning that named nothing)."""
    from offload_adam.nvme.manifest import MANIFEST
    from offload_adam.nvme_tier import _other_ranks_hint
    for r in (0, 1, 2):
        (tmp_path / f"rank{r}").mkdir()
    (tmp_path / "rank1" / MANIFEST).write_bytes(b"x")
    hint = _other_ranks_hint([str(tmp_path / "rank0")])
    assert str(tmp_path / "rank1") in hint and "rank2" not in hint, hint
    assert _other_ranks_hint([str(tmp_path / "rank1")]) == ""   # (its own state: not named)
    assert _other_ranks_hint([str(tmp_path)]) == ""   # (not a rank folder)


@pytest.mark.parametrize("footprint", ["ram", "two_generations", "compact"])
def test_inf_found_on_one_rank_skips_every_ranks_step(ranks, footprint):
    """distributed_ranks.found_inf_on_one_rank: GradScaler's found_inf on rank 1 alone:
    both ranks skip that step, then both step."""
    for res in result(ranks, f"found_inf_on_one_rank_{footprint}"):
        assert res["after_0"] == [0, 0] and res["after_1"] == [1, 1], res


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_files_of_two_runs_are_refused_on_every_rank(ranks, footprint):
    """distributed_ranks.files_of_two_runs: rank 1's folder from another run at the same
    step: refused on both ranks, naming it."""
    for res in result(ranks, f"files_of_two_runs_{footprint}"):
        assert res["error"] is not None and "are of different runs" in res["error"], res


def test_a_one_process_state_given_to_ranks_is_refused(ranks):
    """distributed_ranks.nvme_one_process_state: a one-process state resumed by two ranks
    is refused on each, naming it (it started at step 0 beside it), and no rank folder is
    made."""
    for res in result(ranks, "nvme_one_process_state"):
        assert res["error"] is not None and "holds a one-process optimizer state" in res["error"], res
        assert res["rank_folders"] == [], res


def test_streaming_a_sharded_model_is_refused(ranks):
    """distributed_ranks.stream_sharded: stream_params of an FSDP2 model is refused, naming
    a DTensor param, and makes no param_dirs."""
    for res in result(ranks, "stream_sharded"):
        assert "param 0.weight is a DTensor (FSDP2's fully_shard" in (res["error"] or ""), res
        assert "stream_params and FSDP2 do not combine" in res["error"] and not res["made"], res


def test_a_step_refused_on_one_rank_is_refused_on_every_rank(ranks):
    """distributed_ranks.step_refused_on_one_rank: an option set on one rank after the
    optimizers were built, then a step refused on one rank and caught, left the other
    waiting in the step's collectives (found from outside: a hang). Every rank raises,
    naming the cause, nothing stepped; the next step goes on on both."""
    rank0, rank1 = result(ranks, "step_refused_on_one_rank")
    for res in (rank0, rank1):
        assert res["errors"][0].startswith(
            "ValueError: offload_adam: max_grad_norm differs between the ranks (rank 0: None, "
            "rank 1: 0.5) at step(), set on some ranks since the optimizers were built"), res
        assert res["errors"][2] is None and res["unchanged"] and res["stepped"], res
    assert rank1["errors"][1].startswith("ValueError: offload_adam: lr=1e+39"), rank1
    assert rank0["errors"][1].startswith(
        "RuntimeError: offload_adam: rank 1's step() was refused, so every rank's is, nothing "
        "stepped (its collectives would wait for that rank): ValueError: offload_adam: "
        "lr=1e+39"), rank0


@pytest.mark.parametrize("variant", ["ram", "two_generations", "compact"])
def test_a_step_refused_after_steps_in_backward_is_refused_on_every_rank(ranks, variant):
    """distributed_ranks.early_step_refused_on_one_rank: with step_in_backward, rank 1's lr
    changed between backward and step() refuses its step; the other rank used to commit its
    step alone (found from outside: state files a step apart between the ranks, silently;
    the compact footprint hung). Both refuse, naming rank 1's cause, and stay at one step."""
    rank0, rank1 = result(ranks, f"early_step_refused_on_one_rank_{variant}")
    assert "param group 0's hyperparameters changed after its step started" in rank1["error"]
    assert rank0["error"].startswith(
        "offload_adam: rank 1's step was refused, so every rank's is: param group 0's "
        "hyperparameters changed after its step started (lr 0.01 -> 0.02"), rank0
    assert rank0["counts"] == rank1["counts"], (rank0, rank1)
    if variant != "ram":   # (in RAM the steps that ran in backward stay: the README's)
        assert rank0["after_refusal"] == rank1["after_refusal"] == 1
        assert rank0["counts"] == [3, 3]


def test_an_optimizer_refused_on_one_rank_is_refused_on_every_rank(ranks):
    """distributed_ranks.constructor_refused_on_one_rank: rank 1's constructor refused
    (state_dirs a file, a negative lr) left rank 0 waiting in the ranks' comparison of
    options until the group's timeout (found from outside). Both raise at once, rank 0
    naming rank 1's cause; built right, both train."""
    rank0, rank1 = result(ranks, "constructor_refused_on_one_rank")
    assert rank1["errors"][0].startswith("ValueError: state_dirs: ") and "is not a directory" in \
        rank1["errors"][0], rank1
    assert rank1["errors"][1] == "ValueError: Invalid learning rate: -1.0", rank1
    for mine, theirs in zip(rank0["errors"], rank1["errors"]):
        assert mine == ("RuntimeError: offload_adam: rank 1's optimizer was refused while "
                        "being built, so every rank's is (the ranks compare their options as "
                        f"they build it, and would wait for that rank): {theirs}"), rank0
    for res in (rank0, rank1):
        assert max(res["seconds"]) < 30 and res["count"] == 2, res


def test_a_state_dtype_named_two_ways_is_one_format_on_every_rank(ranks):
    """distributed_ranks.state_dtype_spelled_two_ways: torch.bfloat16 on one rank and "bf16"
    on the other were refused as differing (found from outside); they step."""
    for res in result(ranks, "state_dtype_spelled_two_ways"):
        assert res["count"] == 2, res


@pytest.mark.parametrize("variant", ["retry", "zero_grad"])
def test_an_edit_before_backward_on_one_rank_leaves_no_rank_a_step_behind(ranks, variant):
    """distributed_ranks.early_refused_before_backward_on_one_rank: with step_in_backward
    (state in RAM), rank 1's edit before backward made its step() refuse and its backward
    start no step, while rank 0's ran in backward. Rank 0's error said "nothing stepped",
    and rank 1's zero_grad() dropped the grads silently: the ranks a step apart from then on
    (found from outside). Rank 0's error says what ran; rank 1's zero_grad() raises keeping
    the grads; step() again steps them; both end bitwise the training without the edit."""
    rank0, rank1 = result(ranks, f"early_refused_before_backward_on_one_rank_{variant}")
    assert rank1["step"].startswith("ValueError: Invalid beta parameter at index 0: 1.5"), rank1
    assert rank0["step"].startswith(
        "RuntimeError: offload_adam: rank 1's step() was refused, so every rank's is, nothing "
        "more stepped (the step of 6 params ran during backward on this rank and stays"), rank0
    if variant == "zero_grad":
        assert rank1["zero_grad"].startswith(
            "offload_adam: zero_grad() after this rank's step() was refused (ValueError: "
            "Invalid beta parameter"), rank1
        assert "had already run during backward on rank 0" in rank1["zero_grad"], rank1
        assert "cannot be undone" in rank0["zero_grad"], rank0
    for res in (rank0, rank1):
        assert res["counts"] == [4, 4] and res["same"], res


def test_accumulation_with_steps_in_backward_is_refused_at_step(ranks):
    """distributed_ranks.early_accumulation_refused: a second backward before step() with
    step_in_backward, under FSDP2. Refused inside FSDP2's backward, it left the modules
    unsharded, and the steps after stepped nothing, silently (found from outside). Now the
    backward ends, step() refuses, naming the cause, and training goes on stepping every
    param."""
    for res in result(ranks, "early_accumulation_refused"):
        assert res["second"] is None, res
        assert "a grad arrived again for a param whose step already started" in res["step"], res
        assert res["dtensors"] and res["moved"] == [True, True], res
        assert res["steps"] == [4.0], res   # (the refused step ran in backward: RAM keeps it)


def test_options_that_differ_between_the_ranks_are_refused_by_every_rank(ranks):
    """distributed_ranks.options_differ: one rank clips, the other not; both raise, naming
    max_grad_norm and each rank's value, before any step waits for the other."""
    for res in result(ranks, "options_differ"):
        assert res["error"] == (
            "offload_adam: max_grad_norm differs between the ranks (rank 0: 0.5, rank 1: None): "
            "every rank's optimizer must be built with the same options (a step's collectives "
            "depend on them)"), res


def test_the_fsdp2_example_trains_and_resumes_bitwise(kernels, tmp_path):
    example = RANKS.parent.parent / "examples" / "fsdp2_cpu.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(example.parent.parent), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(example), "--steps", "4",
                           "--checkpoint", str(tmp_path / "ckpt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + "\n" + proc.stderr[-4000:]
    assert proc.stdout.count("resumed run bitwise equal to the uninterrupted one: True") == 2


@pytest.mark.parametrize("variant", ["forward", "back"])
def test_fsdp2_compact_ranks_killed_in_a_step_resume_one_step(kernels, tmp_path, variant):
    """Compact state files (one copy and a redo log) under FSDP2: no rank moves a bucket
    of a step before every rank's log of it is durable, so ranks killed anywhere resume
    at one step: "forward", rank 0 killed before its step's last commit while rank 1
    completed it: both at the later step (rank 0 finishes it from its log); "back", rank 0
    killed before its log and rank 1 after its own: both at the earlier step (rank 1 drops
    what it began, warned). Bitwise the uninterrupted run, and on."""
    codes = [code for code, _ in launch(tmp_path, [f"nvme_compact_kill_{variant}"])]
    assert codes == ([-9, 0] if variant == "forward" else [-9, -9]), codes
    after = [res for _, res in launch(tmp_path, [f"nvme_compact_after_kill_{variant}"])]
    r0, r1 = result(after, f"nvme_compact_after_kill_{variant}")
    step = 3 if variant == "forward" else 2
    assert r0["resumed_step"] == r1["resumed_step"] == step
    assert not r0["warned"]
    assert len(r1["warned"]) == (1 if variant == "back" else 0), r1
    for res in (r0, r1):
        assert res["resumed_bitwise"] and res["trained_on_bitwise"], res


@pytest.mark.parametrize("variant", ["fp32", "bf16"])
def test_fsdp2_ranks_killed_between_their_commits_resume_one_step(kernels, tmp_path, variant):
    """Issue 25 item 7, with real processes and files: rank 0 is SIGKILLed right before it
    commits step 3, which rank 1 committed. Resumed with state_resume=True, both ranks are
    at step 2 (rank 1 went back, warned), bitwise the uninterrupted run, and train on
    bitwise; never ranks at steps [2, 3] mixing shards of two steps."""
    (code0, _), (code1, phase1) = launch(tmp_path, [f"nvme_kill_{variant}"])
    assert code0 == -9 and code1 == 0
    assert phase1[f"nvme_kill_{variant}"]["step"] == 3   # rank 1 committed step 3
    # ... and its step() raised, the ranks' word after the pass finding rank 0 gone
    assert phase1[f"nvme_kill_{variant}"]["error"] is not None
    after = [res for _, res in launch(tmp_path, [f"nvme_after_kill_{variant}"])]
    r0, r1 = result(after, f"nvme_after_kill_{variant}")
    assert r0["resumed_step"] == r1["resumed_step"] == 2
    assert not r0["warned"] and len(r1["warned"]) == 1, (r0, r1)
    for res in (r0, r1):
        assert res["resumed_bitwise"] and res["trained_on_bitwise"], res


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_ddp_replicas_resume_from_one_step(ranks, footprint):
    """distributed_ranks.ddp_resume: replicas whose files are a step apart resume from one
    step (two generations: rank 0 goes back to rank 1's step, with a warning; compact
    ranks step together), and an optimizer state of another step loaded after is refused
    on both although DDP's broadcast wrote the params (found from outside: taken, two
    steps mixed)."""
    r0, r1 = result(ranks, f"ddp_resume_{footprint}")
    assert r0["step_count"] == r1["step_count"] == 3, (r0, r1)
    assert len(r0["warned"]) == (footprint == "two_generations") and not r1["warned"], (r0, r1)
    for res in (r0, r1):
        assert res["at_three"], res
        assert "state_resume=True set the params to the state files' step 3" in str(
            res["mixed_loaded"]), res


@pytest.mark.parametrize("variant", ["inplace", "engine"])
def test_ddp_replicas_take_the_averaged_grads(ranks, variant):
    """distributed_ranks.ddp: under DistributedDataParallel the ranks stay bitwise
    equal and follow torch; the options that took each rank's own grads in backward
    are refused by name (found from outside: the ranks stepped apart); one state_dirs
    given to both ranks is refused on one, saying each rank needs its own."""
    both = result(ranks, f"ddp_{variant}")
    assert sum("state_dirs" in res["refused"] for res in both) == 1, both   # one held them
    for res in both:
        assert res["ranks_equal"] and not res["hooked"], res
        assert res["max_rel"] < 1e-5, res
        late = res["refused"].pop("built before the process group", None)
        assert (late is not None) == (variant == "engine"), res
        assert late is None or "the optimizer was built before torch.distributed's process " \
                               "group" in late, late
        shared = res["refused"].pop("state_dirs", None)
        assert shared is None or "give each optimizer (and each rank) its own" in shared, res
        assert sorted(res["refused"]) == ["free_grads_after_copy", "step_in_backward"], res
        assert all("as under DistributedDataParallel" in m for m in res["refused"].values())

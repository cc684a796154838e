"""The planner (offload_adam/plan.py): its byte counts against what the code allocates
(host_bytes(), the state files written, the simulated device's bytes and peak) on a
transformers Llama, and its command line."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import offload_adam
from offload_adam import nvme_tier, param_files, plan as planner
from offload_adam.nvme.direct_io import allocated_bytes
from offload_adam.param_files import FILE_NAME
from offload_adam.testing import AsyncSimDevice, simulated
from conftest import holes_supported, sim_path

transformers = pytest.importorskip(
    "transformers", reason="the planner's byte counts are checked on transformers' Llama "
    "(installed by the README's test command)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def llama_config(**kw):
    # vocab x hidden = 65536 elements: the embedding is cut into two pieces at bucket_mb=0.05
    cfg = dict(vocab_size=1024, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    cfg.update(kw)
    return transformers.LlamaConfig(**cfg)


def build(config):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def shape_of(config, tmp_path):
    config.save_pretrained(tmp_path)   # as users give it: a config.json
    return planner.load_model(str(tmp_path))


@pytest.mark.parametrize("tied", [False, True])
def test_the_planner_lists_the_params_of_transformers_llama(tmp_path, tied):
    config = llama_config(tie_word_embeddings=tied)
    model = build(config)
    shape = shape_of(config, tmp_path)
    assert [s for _, s in shape.tensors()] == [tuple(p.shape) for p in model.parameters()]
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.block_params == sum(p.numel() for p in model.model.layers[0].parameters())


def micro_batch(model, seed, config):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    model(input_ids=tokens, labels=tokens).loss.backward()


STATES = ["ram", "ram+early", "files", "compact", "compact+2dirs"]


@pytest.mark.parametrize("state_dtype,params,state", [
    (d, p, s) for s in STATES for p in ("gpu", "ram", "files") for d in planner.STATE_DTYPES
] + [(d, "files+heads", s) for s in STATES[2:] for d in planner.STATE_DTYPES])
def test_host_and_disk_bytes_are_the_allocated_ones(kernels, tmp_path, monkeypatch, state_dtype,
                                                    params, state):
    """host_bytes() (+ the streamer's host copies, or its param files' cache) and the
    state files and param files on disk, after a step, are the planner's to the byte; so
    are the bytes the simulated device moved per link in a step (grads freed once copied;
    with the state in RAM, 2 micro-batches accumulated on the host, or one stepped in
    backward; in files, one, stepped in backward; one micro-batch through the grad ring,
    from the first backward on). "+heads": the state laid out with the blocks' values as
    its buckets' heads (nvme_tier.HEADS, the default), the param files' extents given back."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    monkeypatch.setattr(nvme_tier, "HEADS", params.endswith("+heads"))
    params = params.removesuffix("+heads")
    early = state == "ram+early"
    dirs = 2 if state == "compact+2dirs" else 1   # (4 spare buckets in each)
    state = state.removesuffix("+2dirs")
    # (stepped in backward with the state in RAM, the grad ring holds two streamed blocks'
    # grads where they exceed 4 buckets: wide enough blocks here that they do)
    config = llama_config(intermediate_size=640 if early else 160)
    shape = shape_of(config, tmp_path / "cfg")
    state = "ram" if early else state
    run = planner.Run(batch=2, seq=8, micro=2 if state == "ram" and not early else 1,
                      prefetch=1, bucket_mb=0.05, state_dirs=dirs)
    layout = planner.Layout(params, state, state_dtype)
    p = planner.plan(shape, planner.MACHINES["desktop-24gb"], run, layout)
    folders = [tmp_path / "state"] + [tmp_path / f"state{k}" for k in range(1, dirs)]
    for f in folders:
        f.mkdir()
    sim = AsyncSimDevice(seed=0)
    try:
        with simulated(sim), sim.watch():
            model = build(config)
            files = (dict(param_dirs=tmp_path / "params",
                          param_cache_mb=p.host["param cache"] / 2**20)
                     if params == "files" else {})
            streamer = (offload_adam.stream_params(model, LlamaDecoderLayer, prefetch=1,
                                                   **files)
                        if params != "gpu" else None)
            kw = {"ram": dict(step_in_backward=early),
                  "files": dict(state_dirs=[str(tmp_path / "state")], step_in_backward=True),
                  "compact": dict(state_dirs=list(map(str, folders)), step_in_backward=True,
                                  state_footprint="compact")}[state]
            opt = offload_adam.AdamW(model.parameters(), lr=1e-3, state_dtype=state_dtype,
                                     bucket_mb=0.05, free_grads_after_copy=True, **kw)
            # the disk's bytes before the first step and after it, the larger the peak
            # (two generations: the slots the second step writes reserved after the first;
            # the heads: the param files' extents given back then)
            holes = holes_supported(tmp_path)
            if holes:
                opened = on_disk(tmp_path)
                assert 0 <= opened - p.disk_before_first <= 65536 * (dirs + 1)
            for step in range(2):   # the first learns the order; the second is counted
                before = sim.counters()
                for m in range(run.micro):
                    micro_batch(model, 10 * step + m, config)
                if step == 0:
                    first = opt.host_bytes() + (streamer.host_bytes() if streamer else 0)
                opt.step()
                opt.zero_grad()
            after = sim.counters()
            host = opt.host_bytes() + (streamer.host_bytes() if streamer else 0)
            if streamer is not None and streamer.files is not None:
                path = tmp_path / "params" / FILE_NAME
                assert os.path.getsize(path) == p.disk["param files"]
                # (with the heads, the blocks in them have given their extents back)
                if holes_supported(tmp_path):
                    assert allocated_bytes(str(path)) <= p.disk["param files"] - p.freed.get(
                        "param files", 0)
                assert len(streamer.files.slots) >= len(streamer.files.sizes)   # all cached
            if early and streamer is not None:
                assert opt._engine.ring.nbytes > 4 * int(0.05 * 2**20)
            # (the head reads' buffers are beside the cache only while they fly: planned
            # at most, where the blocks are not read straight into their slots)
            heads_read = p.host.get("head reads (at most)", 0.0)
            assert host == p.host_total - heads_read, (p.host, host)
            if streamer is not None and streamer.files is not None \
                    and streamer.files.heads is not None:
                direct = all(streamer.files.heads.direct.values())
                assert (heads_read > 0) == (not direct), (p.host, streamer.files.heads.direct)
                if heads_read:
                    assert heads_read == param_files.HEAD_READS * max(streamer.files.sizes)
            # nor does the first step hold more (the pass in its backward guessed the order)
            assert first == host
            assert after["h2d_bytes"] - before["h2d_bytes"] == p.traffic["h2d"]
            assert after["d2h_bytes"] - before["d2h_bytes"] == p.traffic["d2h"]
            if holes:
                assert 0 <= on_disk(tmp_path) - p.disk_after_first <= 65536 * (dirs + 1)
            opt.close()
        sim.check()
    finally:
        sim.close()
    disk_total = sum(p.disk.values()) - p.disk.get("param files", 0)
    if state == "files":
        data = os.path.getsize(tmp_path / "state" / "offload_adam_state.bin")
        assert data == disk_total == p.disk["state (2 generations)"]
    elif state == "compact":
        data = sum(os.path.getsize(f / "offload_adam_state.bin") for f in folders)
        log = sum(os.path.getsize(f / "offload_adam_state.redo") for f in folders)
        spares = "4 spare buckets" + (f" in each of {len(folders)} directories"
                                      if len(folders) > 1 else "")
        assert data == p.disk[f"state (1 copy + {spares})"]
        assert log == p.disk["grad redo log"]   # (its records fit the reserve)
        assert disk_total == data + log
    else:
        assert disk_total == 0
    # what the plan leaves out, as its footer says: the small files beside the state's
    # data (spec, manifest, lock), ~0.25 KB per tensor or part (~0.4 with the heads: a
    # split master's three tensors)
    if state != "ram":
        tensors = sum(1 for _ in shape.tensors())
        per = 400 if planner.heads_layout(layout) else 256
        for f in folders:
            small = sum(os.path.getsize(f / name) for name in os.listdir(f)
                        if not name.endswith((".bin", ".redo")))
            assert 0 < small <= 4096 + per * tensors, (f, small, tensors)


def on_disk(root) -> int:
    """The disk bytes of the state's data files, redo logs and param files under root."""
    return sum(allocated_bytes(os.path.join(d, f)) for d, _, names in os.walk(root)
               for f in names if f.endswith((".bin", ".redo")) or f == FILE_NAME)


def test_unaligned_shapes_are_bounded_by_a_line_per_piece(kernels):
    """Pieces packed together share their cache-line padding in the engine; the planner
    pads each: never under, over by less than a line per packed piece."""
    shape = planner.ModelShape("odd", 97, 40, 72, 2, 4, 2)
    run = planner.Run(bucket_mb=0.05)
    sim = AsyncSimDevice(seed=0)
    try:
        with simulated(sim):
            model = transformers.LlamaForCausalLM(llama_config(
                vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)).to(torch.bfloat16)
            # (one micro-batch: the planner's recipe steps in backward, grads in the ring)
            opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.05, step_in_backward=True)
            real = opt.host_bytes()
            opt.close()
    finally:
        sim.close()
    p = planner.plan(shape, planner.MACHINES["desktop-24gb"], run,
                     planner.Layout("gpu", "ram", "float32"))
    assert 0 <= p.host_total - real < 2 * 64 * len(list(model.parameters()))


@pytest.mark.parametrize("layers,prefetch", [(6, 1), (6, 2), (2, 2)])
def test_the_simulated_device_peak_is_within_the_planned_block_buffers(kernels, layers,
                                                                      prefetch):
    """The streamer's device bytes at their peak over a step fill the planner's (k + 2)
    block buffers at most (never more blocks than the model has: a 2-block model was
    planned 4, found from outside), and more than k of them (the bound is not slack)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    config = llama_config(num_hidden_layers=layers)
    shape = planner.ModelShape.from_config(config.to_dict())
    run = planner.Run(batch=2, seq=8, prefetch=prefetch)
    p = planner.plan(shape, planner.MACHINES["desktop-24gb"], run,
                     planner.Layout("ram", "ram", "float32"))
    sim = AsyncSimDevice(seed=1)
    try:
        with simulated(sim), sim.watch():
            model = build(config)
            offload_adam.stream_params(model, LlamaDecoderLayer, prefetch=prefetch)
            opt = offload_adam.AdamW(model.parameters(), lr=1e-3)
            for step in range(2):
                if step:
                    sim.reset_peak()
                micro_batch(model, step, config)
                opt.step()
                opt.zero_grad()
            peak = sim.counters()["peak_materialized_bytes"]
            opt.close()
        sim.check()
    finally:
        sim.close()
    block = 2 * shape.block_params
    assert p.gpu["streamed block buffers"] == min(prefetch + 2, layers) * block
    assert min(prefetch, layers - 1) * block < peak <= p.gpu["streamed block buffers"]


def test_largest_fitting_is_the_edge_of_what_fits():
    m, run = planner.MACHINES["desktop-24gb"], planner.Run(batch=1)
    for layout in (planner.Layout("gpu", "ram", "8bit"), planner.Layout("ram", "files", "8bit")):
        big = planner.largest_fitting(planner.PRESETS["llama-3-8b"], m, run, layout)
        assert planner.plan(big, m, run, layout).fits
        assert not planner.plan(big.with_layers(big.layers + 1), m, run, layout).fits
    # more host RAM never fits fewer blocks; a GPU too small for the resident params, none
    lay = planner.Layout("ram", "ram", "8bit")
    small = planner.largest_fitting(planner.PRESETS["llama-3-8b"], m, run, lay)
    more = planner.largest_fitting(planner.PRESETS["llama-3-8b"],
                                   planner.replace(m, host_bytes=2 * m.host_bytes), run, lay)
    assert more.layers > small.layers
    assert planner.largest_fitting(planner.PRESETS["llama-3-70b"],
                                   planner.replace(m, gpu_bytes=4e9), run, lay) is None


def test_the_bounds_follow_the_physics():
    """The CPU step is the kernel's traffic over the DRAM bandwidth; streaming doubles
    the params' host-to-device bytes per micro-batch; the state in files reads and writes
    one generation per step."""
    m, run = planner.MACHINES["desktop-24gb"], planner.Run(batch=1, micro=1)
    model = planner.PRESETS["llama-3-8b"]
    n, streamed = model.params, model.layers * model.block_params
    resident = planner.plan(model, m, run, planner.Layout("gpu", "ram", "float32"))
    assert resident.traffic["dram"] == 28 * n
    assert resident.seconds["cpu"] == pytest.approx(28 * n / 80e9)
    assert resident.traffic["h2d"] == 2 * n
    stream = planner.plan(model, m, run, planner.Layout("ram", "files", "8bit"))
    assert stream.traffic["h2d"] == 4 * streamed + 2 * (n - streamed)
    files = planner.state_files([s for _, s in model.tensors()], "8bit", 32.0, None)
    assert stream.traffic["ssd_read"] == stream.traffic["ssd_write"] == files["generation_bytes"]
    assert 6.0 * n < files["generation_bytes"] < 6.1 * n
    assert files["data_file_bytes"] >= 2 * files["generation_bytes"]


def test_a_param_cache_given_sets_what_the_param_files_read():
    """--param-cache-mb (stream_params' param_cache_mb): the cache holds the whole blocks it
    has room for, forward and backward each read what it lacks, the step writes every
    block (how the GPU run of a 6.7B model from param files with a 4 GiB cache was planned)."""
    m, model = planner.MACHINES["desktop-24gb"], planner.PRESETS["llama-3-8b"]
    slot, extent = planner.param_slot_bytes(model), planner.param_file_bytes(model)
    lay = planner.Layout("files", "ram", "8bit")
    p = planner.plan(model, m, planner.Run(batch=1, param_cache_mb=6.5 * slot / 2**20), lay)
    assert p.host["param cache"] == 6 * slot
    assert p.traffic["ssd_read"] == 2 * (extent - 6 * slot)
    assert p.traffic["ssd_write"] == extent
    roomy = planner.plan(model, m, planner.Run(batch=1), lay)   # the host's room: all of it
    assert roomy.host["param cache"] >= extent and roomy.traffic["ssd_read"] == 0
    assert roomy.traffic["ssd_write"] == 0   # (no block given away: none written back)


def _param_files_bytes_a_step(model, opt, files, micro, config):
    """The param files' (read, written) bytes in the 4th of 4 steps (the first learns the
    order of uses); read: from the files, or from the state's heads (nvme_heads.py)."""
    for step in range(4):
        r, w = files.read_bytes + files.heads_read_bytes, files.written_bytes
        for m in range(micro):
            micro_batch(model, 10 * step + m, config)
        opt.step()
        opt.zero_grad()
    return files.read_bytes + files.heads_read_bytes - r, files.written_bytes - w


@pytest.mark.parametrize("layers,cached,micro,prefetch", [
    (8, 5, 1, 1), (8, 7, 1, 1), (8, 5, 2, 1), (8, 7, 2, 1), (12, 8, 3, 2)])
def test_the_param_files_bytes_a_step_are_the_planned_ones(kernels, tmp_path, layers, cached,
                                                          micro, prefetch):
    """`layers` blocks, `cached` of them in the cache, the state in RAM (stepped in backward
    with one micro-batch, at step() with more): the param files' bytes read in a step are
    the misses of forward and backward of each micro-batch, and those written the blocks
    the cache gave away with their new values (2 x a pass's misses: the blocks at the turn
    of forward and backward stay), as planned; the planner once counted every block
    written each step, and one more with micro-batches (the step at step() found the
    blocks backward used in their slots, the read-ahead having been refused them)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    config = llama_config(num_hidden_layers=layers)
    shape = shape_of(config, tmp_path / "cfg")
    run = planner.Run(batch=2, seq=8, micro=micro, prefetch=prefetch, bucket_mb=0.05,
                      param_cache_mb=(cached + 0.5) * planner.param_slot_bytes(shape) / 2**20)
    p = planner.plan(shape, planner.MACHINES["desktop-24gb"], run,
                     planner.Layout("files", "ram", "bfloat16"))
    with sim_path("sim-seed0"):   # (checked for ordering violations at its end)
        model = build(config)
        streamer = offload_adam.stream_params(
            model, LlamaDecoderLayer, prefetch=prefetch, param_dirs=tmp_path / "params",
            param_cache_mb=run.param_cache_mb)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, state_dtype="bfloat16",
                                 bucket_mb=0.05, step_in_backward=micro == 1)
        files = streamer.files
        assert len(files.slots) == cached
        assert _param_files_bytes_a_step(model, opt, files, micro, config) == (
            p.traffic["ssd_read"], p.traffic["ssd_write"])
        opt.close()


@pytest.mark.parametrize("heads", [False, True], ids=["whole", "heads"])
@pytest.mark.parametrize("state,state_dtype,micro,blocks", [("compact", "float32", 1, 5),
                                                            ("compact", "8bit", 1, 6),
                                                            ("files", "8bit", 2, 6),
                                                            ("files", "float32", 1, 4)])
def test_the_param_files_writes_with_the_state_in_files(kernels, tmp_path, monkeypatch, state,
                                                         state_dtype, micro, blocks, heads):
    """6 blocks, 4 in the cache, the state in files stepped by a pass at step() (or in
    backward): the param files' bytes are the planned ones, `blocks` written a step. With
    8-bit moments a file bucket holds the end of one block and the start of the next (more
    params a bucket), the pass holds both there and one more block goes back to its file a
    step, which the planner once missed (found from outside: it planned 5 blocks written
    where 6 were). With the heads (nvme_heads.py) the blocks are read from the state's
    heads, and the compact pass writes no param file; the two generations, a pass's misses."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    monkeypatch.setattr(nvme_tier, "HEADS", heads)
    config = llama_config(num_hidden_layers=6)
    shape = shape_of(config, tmp_path / "cfg")
    run = planner.Run(batch=2, seq=8, micro=micro, prefetch=1, bucket_mb=0.05,
                      param_cache_mb=4.5 * planner.param_slot_bytes(shape) / 2**20)
    p = planner.plan(shape, planner.MACHINES["desktop-24gb"], run,
                     planner.Layout("files", state, state_dtype))
    files_state = planner._model_files(shape, state_dtype, 0.05, None, 1)
    assert planner._seams(shape, files_state) == (state_dtype == "8bit")
    (tmp_path / "state").mkdir()
    with sim_path("sim-seed0"):
        model = build(config)
        streamer = offload_adam.stream_params(
            model, LlamaDecoderLayer, prefetch=1, param_dirs=tmp_path / "params",
            param_cache_mb=run.param_cache_mb)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, state_dtype=state_dtype,
                                 bucket_mb=0.05, step_in_backward=micro == 1,
                                 state_dirs=[tmp_path / "state"], state_footprint=(
                                     "compact" if state == "compact" else "two_generations"))
        files = streamer.files
        assert len(files.slots) == 4
        read, written = _param_files_bytes_a_step(model, opt, files, micro, config)
        assert (read, written) == (p.traffic["ssd_read_params"], p.traffic["ssd_write_params"])
        assert planner.heads_layout(p.layout) == heads
        if heads:   # (the state's layout differs)
            assert written == (2 * planner.param_slot_bytes(shape) if state == "files" else 0)
        else:   # the params' share of the plan: less the same layout's with params in RAM
            in_ram = planner.plan(shape, planner.MACHINES["desktop-24gb"], run,
                                  planner.Layout("ram", state, state_dtype)).traffic
            assert read == p.traffic["ssd_read"] - in_ram["ssd_read"]
            assert written == p.traffic["ssd_write"] - in_ram["ssd_write"]
            assert written // planner.param_slot_bytes(shape) == blocks
        opt.close()


def test_the_gpu_benchmark_plans_its_streamed_runs():
    """bench/stream_gpu.py compares each streamed run with the planner's step: its GPT as a
    Llama of the same width and params per block (within 0.5 % of the GPT's count), from
    param files the disk's bytes at the speeds it measured (the 2026-11-28 H200 run: 17.26 s
    planned, 17.57 s measured)."""
    import types
    from bench.e2e.model import config_for
    from bench.stream_gpu import planned_step
    cfg = config_for(32, 4096, 32000, 2048)
    args = types.SimpleNamespace(batch=4, seq=2048, checkpoint=True, prefetch="1,2",
                                 param_cache_mb=4096.0, param_dir="/d", state_dtype="8bit")
    got = planned_step(cfg, args, 54.9, dict(read_Bps=1.52e9, write_Bps=2.30e9))
    assert abs(got["params"] - cfg.num_params()) < 0.005 * cfg.num_params()
    assert got["bound"] == "ssd" and got["layout"] == "params files, state ram 8bit"
    model = planner.ModelShape("gpt", 32000, 4096, 10923, 32, 64, 64)
    slot, extent = planner.param_slot_bytes(model), planner.param_file_bytes(model)
    cached = 4096 * 2**20 // slot * slot
    assert got["step_s"] == pytest.approx(2 * (extent - cached) / 1.52e9 + extent / 2.30e9)
    # the param files' misses read in forward and in backward, their writes after: the
    # disk is busy the whole iteration (and step()'s copies of the resident params after)
    assert got["step_s"] < got["expected_s"] < got["step_s"] + 0.02
    args.param_dir = ""   # from host RAM: bound by the CPU step
    ram = planned_step(cfg, args, 54.9, None)
    assert ram["bound"] == "cpu" and ram["expected_s"] > ram["step_s"]


def test_the_schedule_estimate_serializes_what_the_code_does():
    """The estimate (`schedule`): forward with the CPU idle, backward with the CPU step
    inside it (its DRAM shared with the grads' and the params' copies), step()'s copies
    after; with accumulation the CPU step after backward; never under a bound; the
    state files' pass after the forward. The H200 numbers of 2026-11-28: a 12.9 B model from
    RAM measured 2.98-3.34 s, where this says 2.35 s and the largest bound 1.51 s."""
    m = planner.replace(planner.MACHINES["lent-h100"], pcie_gbps=54.9)
    model = planner.ModelShape("gpt", 32000, 5120, 13653, 40, 80, 80)
    run = planner.Run(batch=4, seq=2048)
    n, streamed = model.params, model.layers * model.block_params
    p = planner.plan(model, m, run, planner.Layout("ram", "ram", "8bit"))
    pcie, dram = 54.9e9, m.dram_gbps * 1e9
    forward = 2 * streamed / pcie   # PCIe-bound at this batch (the GPU's share: 0.22 s)
    assert forward > p.seconds["gpu"] / 4
    cpu = (p.traffic["dram"] + 2 * n + 2 * streamed) / dram
    tail = 2 * (n - streamed) / pcie
    assert p.expected_s == pytest.approx(forward + cpu + tail)
    assert 2.3 < p.expected_s < 2.4 and p.bound == "cpu" and p.step_s < 1.6
    accumulated = planner.plan(model, m, planner.replace(run, micro=2), p.layout)
    backward = max(p.seconds["gpu"] * 3 / 4, 2 * streamed / pcie, 2 * n / pcie)
    cpu2 = accumulated.traffic["dram"] / dram
    assert accumulated.expected_s == pytest.approx(2 * forward + 2 * backward + cpu2 + tail)
    for layout in planner.all_layouts():
        q = planner.plan(model, m, run, layout)
        assert q.expected_s >= q.step_s - 1e-12, layout
    # the state's pass over its files starts in backward: the forward comes before it
    files = planner.plan(model, m, run, planner.Layout("ram", "files", "8bit"))
    assert files.bound == "ssd"
    assert files.expected_s == pytest.approx(forward + files.seconds["ssd"] + tail)


def test_command_line_prints_every_layout_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "offload_adam.plan", "llama-3-70b", "--batch",
                        "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "llama-3-70b: 70.55 B params" in r.stdout
    # a "no" in the table says what it is short of, below it (without --detail too)
    assert "Does not fit:\n  params gpu, state ram float32: GPU " in r.stdout
    got = json.loads(out.read_text())
    assert len(got["plans"]) == 27
    assert {p["bound"] for p in got["plans"]} <= {"gpu", "pcie", "cpu", "ssd"}
    assert sum(p["layout"]["params"] == "files" for p in got["plans"]) == 9


@pytest.mark.parametrize("argv,message", [
    (["./no-such/config.json"], "no such file"),
    (["./no-such-dir"], "'./no-such-dir': no such file or directory"),   # (not a hub name)
    (["/no/such/model"], "'/no/such/model': no such file or directory"),
    ([".", "--batch", "1"], "'.': a directory without a config.json"),
    (["llama-3-8b", "--host-reserve-gb", "-2"],
     "--host-reserve-gb: must be a finite number >= 0, got -2"),
    (["--layers", "4"], "--hidden, --intermediate, --vocab, --heads missing"),
    (["llama-3-8b", "--machine", "laptop"], "--machine 'laptop'"),
    (["llama-3-8b", "--ram-gb", "-1"], "--ram-gb: must be a positive number, got -1"),
    (["llama-3-8b", "--batch", "0"], "--batch must be a whole number >= 1"),
    (["llama-3-8b", "--prefetch", "-1"], "--prefetch must be a whole number >= 0"),
    (["llama-3-8b", "--layers", "100000"], "100000 layers; the planner plans models of up to 4096"),
    (["llama-3-8b", "--state-dirs", "0"], "--state-dirs must be a whole number >= 1"),
    (["llama-3-7b"], "not a preset; did you mean 'llama-2-7b'"),
    (["llama-3-700b"], "not a preset (presets: llama-2-7b, "),   # (not llama-3-70b)
    (["llama-2-70b"], "not a preset; did you mean 'llama-3-70b'"),   # (the same size)
    (["llama-3-8b", "--param-cache-mb", "100"], "--param-cache-mb 100 holds 0 of the largest "
     "block (416.015625 MiB); --prefetch 2 needs 5 (--param-cache-mb >= 2080.078125)"),
    (["llama-3-8b", "--gpu-gb", "nan"], "--gpu-gb: must be a positive number, got nan"),
    (["llama-3-8b", "--ram-gb", "inf"], "--ram-gb: must be a positive number, got inf"),
    (["llama-3-8b", "--bucket-mb", "0"], "--bucket-mb must be a positive number"),
    (["llama-3-8b", "--bucket-mb", "-5"], "--bucket-mb must be a positive number"),
    (["llama-3-8b", "--state-budget-mb", "nan"], "--state-budget-mb must be a positive number"),
    (["llama-3-8b", "--json", "./no-such/plan.json"], "--json './no-such/plan.json'"),
    (["llama-3-8b", "--state-dir", "."], "--state-dir is about this machine"),
    (["llama-3-8b", "--machine", "here", "--state-dir", "./no-such"],
     "--state-dir './no-such': no such directory"),
    (["llama-3-8b", "--machine", "here", "--measure", "--probe-gb", "0"], "--probe-gb: at least"),
    (["llama-3-8b", "--machine", "here", "--measure", "--probe-gb", "-1"], "--probe-gb: at least"),
    (["llama-3-8b", "--machine", "here", "--probe-gb", "1"], "give --measure"),
    # (a probe larger than the machine: 2 x 1000 GB of RAM asked for, the planner killed)
    (["llama-3-8b", "--machine", "here", "--measure", "--probe-gb", "1000"],
     "--probe-gb 1000: the memory probe holds 2 x 1000 GB, more than half of the"),
    (["llama-3-8b", "--heads", "7"], "must be a multiple of heads (7, num_attention_heads)"),
    # which of the two conditions failed, by the config's keys too (one message named both)
    (["llama-3-8b", "--kv-heads", "3"], "heads (32, a config's num_attention_heads) must be "
     "a multiple of kv_heads (3, num_key_value_heads)"),
    (["/dev/null"], "model '/dev/null': not a regular file"),
    (["~/no-such-config.json"], "no such file or directory (~ is not expanded here"),
    # figures past any machine's overflowed to inf and nan (a traceback, and an empty --json)
    (["llama-3-8b", "--ram-gb", "1e300", "--json", "plan.json"],
     "--ram-gb: at most 1e+09 (GB), got 1e+300"),
    (["llama-3-8b", "--pcie-gbps", "1e-300"], "--pcie-gbps: at least 0.001 (GB/s), got 1e-300"),
    (["llama-3-8b", "--gpu-tflops", "1e12"], "--gpu-tflops: at most 1e+09 (TFLOPS)"),
    (["llama-3-8b", "--batch", str(10 ** 400)], "--batch 1000"),
    (["llama-3-8b", "--bucket-mb", "1e300"], "--bucket-mb 1e+300: the planner plans up to"),
    (["--layers", "2", "--hidden", "2097152", "--intermediate", "8", "--vocab", "8", "--heads",
      "1"], "hidden 2097152; the planner plans hidden up to 1048576"),
    # a reserve of all the memory or more left a negative room in every plan
    (["llama-3-8b", "--host-reserve-gb", "200"],
     "--host-reserve-gb 200 is not below --ram-gb 128 (desktop-24gb's)"),
    (["llama-3-8b", "--ram-gb", "8"], "--host-reserve-gb 8 is not below --ram-gb 8 (given)"),
    (["llama-3-8b", "--gpu-gb", "1"], "--gpu-reserve-gb 1.5 is not below --gpu-gb 1 (given)"),
    (["llama-3-8b", "--machine", "lent-h100", "--gpu-reserve-gb", "80"],
     "--gpu-reserve-gb 80 is not below --gpu-gb 80 (lent-h100's)"),
    # the planner's time grows with the pieces and the directories: these took hours
    (["llama-3-8b", "--bucket-mb", "0.001", "--json", "plan.json"],
     "--bucket-mb 0.001 cuts model 'llama-3-8b' (8.03 B params) into 245121 pieces; the "
     "planner plans up to 65536 (its time grows with them): give a larger --bucket-mb"),
    (["llama-3-8b", "--state-dirs", "1000000"], "--state-dirs 1000000: the planner plans up to 64"),
    (["llama-3-8b", "--json", "."], "--json '.': a directory"),
])
def test_bad_input_is_named(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert planner.main(argv) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []   # (no plan written, no probe left)


def test_a_config_nested_too_deep_is_named_and_a_local_path_not_asked_of_the_hub(
        tmp_path, capsys, monkeypatch):
    """A config.json nested past Python's stack raised RecursionError, a traceback; a
    mistyped path of one slash whose first part is a directory here went to the hub (half
    a minute of retries offline): both found from outside, both now named."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert planner.main([str(deep)]) == 2
    assert "is not a config (JSON nested too deep" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.chdir(tmp_path)
    assert planner.main(["checkpoints/llama3"]) == 2
    assert "model 'checkpoints/llama3': no such file or directory" in capsys.readouterr().err


def test_the_report_reads_right_for_any_model(capsys):
    """Found from outside: the names of the compact float32/bfloat16 layouts overflowed
    the table's first column, shifting their numbers; a small model printed as "0.00 B
    params (2 blocks of 0 M)"; --state-dirs 4 said "4 spare buckets" of 16; and a layout
    short of host RAM was advised a param cache that RAM did not have."""
    assert planner.main(["llama-3-70b", "--detail", "--state-dirs", "4"]) == 0
    text = capsys.readouterr().out
    table = [line for line in text.splitlines() if line.startswith(("layout ", "params "))]
    assert len(table) == 28
    ends = {line.index("GPU GB") + len("GPU GB") if line.startswith("layout") else
            re.match(r"params [a-z]+, state [a-z]+ [a-z0-9]+ +[0-9.]+", line).end()
            for line in table}
    assert len(ends) == 1   # (every row's first number ends under the header's)
    assert "state (1 copy + 4 spare buckets in each of 4 directories)" in text
    cache = text.split("Params in files:")[1].split("\n\n")[0]
    assert "state files" in cache and "state ram" not in cache   # (those lack host RAM)
    assert planner.main(["--layers", "2", "--hidden", "64", "--intermediate", "128",
                         "--vocab", "100", "--heads", "4"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "model custom: 95.0 K params (2 blocks of 41.1 K, 12.9 K resident)" in head


def test_zero_kv_heads_is_refused_with_shape_flags_as_with_a_preset():
    """--kv-heads 0 is no count of heads: refused whether the shape comes from flags or
    from a preset (it was read as 'as many as heads' with flags only)."""
    flags = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--vocab", "100",
             "--heads", "4", "--kv-heads", "0"]
    for argv in (flags, ["llama-2-7b", "--kv-heads", "0"]):
        with pytest.raises(ValueError, match="kv_heads must be a positive int, got 0"):
            planner._model(planner._parser().parse_args(argv))


def test_shape_flags_apply_over_a_preset_or_a_config(tmp_path):
    """Every shape flag given with a model replaces that model's field (before, only
    --layers did and the rest were dropped without a word), and the model's name says so
    (it kept the preset's, whose shape it no longer has: found from outside)."""
    out = tmp_path / "plan.json"
    assert planner.main(["llama-3-8b", "--hidden", "2048", "--heads", "16", "--kv-heads", "4",
                         "--vocab", "1000", "--intermediate", "4096", "--layers", "2", "--tied",
                         "--head-dim", "256", "--state-dtype", "8bit", "--json", str(out)]) == 0
    model = json.loads(out.read_text())["plans"][0]["model"]
    assert model == dict(name="llama-3-8b with --layers 2 --hidden 2048 --intermediate 4096 "
                              "--vocab 1000 --heads 16 --kv-heads 4 --head-dim 256 --tied",
                         vocab=1000, hidden=2048, intermediate=4096, layers=2, heads=16,
                         kv_heads=4, tied=True, head_dim=256)


def test_json_goes_through_a_symlink_and_into_a_fifo(tmp_path):
    """--json wrote beside the path and renamed onto it: a symlink became a regular file
    (its target left as it was), a FIFO's reader got nothing, and as root a device node
    was replaced (found from outside: /dev/full). A link is written through (the link
    stays, its target takes the plan), a FIFO written into."""
    import stat
    import threading
    target, link, fifo = tmp_path / "target.json", tmp_path / "link.json", tmp_path / "pipe"
    target.write_text("old")
    link.symlink_to(target.name)
    args = ["llama-3-8b", "--state-dtype", "8bit", "--json"]
    assert planner.main(args + [str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["plans"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    assert planner.main(args + [str(fifo)]) == 0
    reader.join(60)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and json.loads(got[0])["plans"]


def test_json_to_this_process_stdout_follows_the_report(tmp_path):
    """--json /dev/stdout with the shell's stdout a regular file (`> out.txt`, `>> log`):
    the file was replaced by the JSON alone, the report and what it held before lost
    (found from outside). Now the JSON is appended after the report; an empty path is
    refused by name, not ignored."""
    out = tmp_path / "out.txt"
    out.write_text("BEFORE\n")
    cmd = [sys.executable, "-m", "offload_adam.plan", "llama-3-8b", "--state-dtype", "8bit"]
    with open(out, "a") as f:
        subprocess.run(cmd + ["--json", "/dev/stdout"], stdout=f, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = out.read_text()
    assert text.startswith("BEFORE\nmodel llama-3-8b")
    report, _, rest = text.partition("\n{")
    assert "largest" in report and json.loads("{" + rest)["plans"]
    assert planner.main(["llama-3-8b", "--json", ""]) == 2
    assert not any(tmp_path.glob("*.tmp"))


def test_here_says_what_it_did_not_measure(tmp_path, capsys):
    """--machine here keeps the desktop preset's figures for what it did not measure or
    was not given, and says which; a GPU it cannot see is said on stderr."""
    out = tmp_path / "plan.json"
    assert planner.main(["llama-3-8b", "--machine", "here", "--state-dir", str(tmp_path),
                         "--pcie-gbps", "30", "--state-dtype", "8bit", "--json", str(out)]) == 0
    got = capsys.readouterr()
    machine = json.loads(out.read_text())["machine"]
    assumed = set(machine["assumed"])
    assert "--pcie-gbps" not in assumed and "--ram-gb" not in assumed
    assert {"--gpu-tflops", "--dram-gbps", "--ssd-read-gbps"} <= assumed
    assert "not measured, the preset's: " in got.out
    if torch.cuda.is_available():
        assert "--gpu-gb" not in assumed
    else:
        assert "--gpu-gb" in assumed and "no CUDA GPU here" in got.err
    assert planner.main(["llama-3-8b", "--state-dtype", "8bit"]) == 0   # (a preset: no note)
    assert "not measured" not in capsys.readouterr().out


@pytest.mark.parametrize("cfg,message", [
    (dict(num_local_experts=8), "num_local_experts=8, a mixture of experts"),
    (dict(num_experts=60), "num_experts=60, a mixture of experts"),
    (dict(n_routed_experts=64), "n_routed_experts=64, a mixture of experts"),
    (dict(hidden_size="4096"), "hidden_size must be a positive int, got '4096'"),
    (dict(num_attention_heads=0), "num_attention_heads must be a positive int, got 0"),
    (dict(num_attention_heads=None), "num_attention_heads must be a positive int, got None"),
    (dict(intermediate_size=14336.0), "intermediate_size must be a positive int, got 14336.0"),
    (dict(num_hidden_layers=True), "num_hidden_layers must be a positive int, got True"),
    (dict(num_key_value_heads=2.5), "num_key_value_heads must be a positive int, got 2.5"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
])
def test_a_config_the_planner_cannot_read_is_refused_by_field(tmp_path, cfg, message):
    base = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    with pytest.raises(ValueError, match=message):
        planner.load_model(str(tmp_path))


def test_a_multimodal_config_plans_its_text_decoder(tmp_path):
    """A local LLaVA-style config.json holds the decoder in text_config (as the hub path
    already unwrapped); a config that is not JSON is named."""
    text = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, tie_word_embeddings=None)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava",
                                                      "text_config": text}))
    assert planner.load_model(str(tmp_path)) == planner.ModelShape(
        str(tmp_path), 32000, 4096, 11008, 32, 32, 32, False)
    (tmp_path / "config.json").write_text('{"vocab_size": ')
    with pytest.raises(ValueError, match="is not JSON"):
        planner.load_model(str(tmp_path))


def test_a_state_budget_below_three_buckets_does_not_fit():
    """state_budget_mb under 3 of the largest state bucket is refused by the code
    (nvme/pipeline.py ring_size), so the plan says it does not fit, for the state in files
    only."""
    m = planner.replace(planner.MACHINES["desktop-24gb"], gpu_bytes=1e12)
    run = planner.Run(batch=1, state_budget_mb=64)
    for state in ("files", "compact", "ram"):
        p = planner.plan(planner.PRESETS["llama-3-8b"], m, run,
                         planner.Layout("ram", state, "8bit"))
        refused = [s for s in p.misfits() if "state_budget_mb 64" in s]
        assert (p.fits, len(refused)) == ((True, 0) if state == "ram" else (False, 1)), p.misfits()
    files = planner.state_files([(4096, 4096)], "8bit", 32.0, 64)
    budget = planner.Run(batch=1, state_budget_mb=3 * files["largest_bucket_bytes"] / 2**20)
    assert planner.plan(planner.PRESETS["llama-3-8b"], m, budget,
                        planner.Layout("ram", "files", "8bit")).refused == []


def test_a_tiny_width_stops_the_search_at_max_blocks():
    """largest_fitting stops at MAX_BLOCKS (each plan's cost grows with the blocks: a tiny
    width used to take minutes), and the report says 'at least'."""
    tiny = planner.ModelShape("tiny", 100, 64, 128, 1, 1, 1)
    m, run = planner.MACHINES["desktop-24gb"], planner.Run()
    lay = planner.Layout("files", "compact", "8bit")
    assert planner.largest_fitting(tiny, m, run, lay).layers == planner.MAX_BLOCKS
    text, plans = planner.report(tiny, m, run, [lay])
    assert plans[0]["largest_fitting"]["at_least"] is True
    assert re.search(rf">= +42\.1 M \({planner.MAX_BLOCKS}\)", text)   # (1024 x 41 K)
    # below the cap the edge is exact (the bisection) and not 'at least'
    small = planner.replace(m, ssd_bytes=planner.plan(tiny.with_layers(300), m, run,
                                                      lay).disk_total)
    big = planner.largest_fitting(tiny, small, run, lay)
    assert big.layers == 300
    assert planner.report(tiny, small, run, [lay])[1][0]["largest_fitting"]["at_least"] is False


def test_here_measures_this_machine(tmp_path):
    """--machine here takes this machine's RAM and free disk; --measure probes its DRAM
    and disk speeds too (small probes here), and leaves no file behind."""
    m = planner.machine_here(planner.MACHINES["desktop-24gb"], str(tmp_path), measure=True,
                             probe_bytes=32 << 20)
    assert {"host_bytes", "ssd_bytes", "dram_gbps"} <= set(m.measured)
    assert 0 < m.dram_gbps < 10_000 and m.host_bytes > 1e9
    if "ssd_read_gbps" in m.measured:   # (a filesystem refusing O_DIRECT is not probed)
        assert m.ssd_read_gbps > 0 and m.ssd_write_gbps > 0
    assert list(tmp_path.iterdir()) == []
    assert planner.main(["llama-3-8b", "--measure"]) == 2   # (only with --machine here)


def test_here_takes_a_containers_memory_limit(tmp_path, monkeypatch):
    """In a container /proc/meminfo's MemTotal is the host's: --machine here plans with
    the memory cgroup's limit when it is smaller (engine/host_memory.py reads it)."""
    from offload_adam.engine import host_memory
    monkeypatch.setattr(host_memory, "cgroup_memory", lambda: (3 << 30, 2 << 30))
    m = planner.machine_here(planner.MACHINES["desktop-24gb"], str(tmp_path))
    assert m.host_bytes == min(3 << 30, host_memory._meminfo("MemTotal"))


def test_a_config_without_the_llama_shape_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks intermediate_size, num_hidden_layers"):
        planner.load_model(str(tmp_path))


# What a block of each model type holds beyond the matrices and two norms the planner counts
# (plan.MODEL_TYPES: under 1/hidden of the block), by its config (h: hidden, kv: kv_dim).
_UNCOUNTED = {
    "qwen2": lambda c, h, kv: h + 2 * kv,                # q/k/v biases
    "qwen3": lambda c, h, kv: 2 * c.head_dim,            # q/k norms, per head
    "olmo2": lambda c, h, kv: h + kv,                    # q/k norms, of the projections
}


_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "olmo2", "smollm3")


@pytest.mark.parametrize("model_type,biased", [(t, False) for t in _TYPES] + [("llama", True)])
def test_each_model_type_is_counted_as_transformers_builds_it(tmp_path, model_type, biased):
    """For every model_type the planner takes, its count of params is the one of the model
    transformers builds from the same config (on the meta device: no memory), but for the
    few vectors of a block it documents as not counted; a config that leaves out
    num_key_value_heads, head_dim or tie_word_embeddings gets its config class's default
    (Gemma's tie its embeddings: were they taken as untied, the head would be counted
    twice)."""
    assert sorted(planner.MODEL_TYPES) == sorted(_TYPES)   # (every one of them checked)
    defaults = planner.MODEL_TYPES[model_type]
    kv = defaults.get("num_key_value_heads")
    heads = 2 * kv if kv else 8   # (not kv: the class's default must be the one taken)
    hidden = heads * defaults.get("head_dim", 16)
    given = dict(vocab_size=1000, hidden_size=hidden, intermediate_size=3 * hidden,
                 num_hidden_layers=3, num_attention_heads=heads)
    if biased:
        given.update(attention_bias=True, mlp_bias=True)
    config = transformers.AutoConfig.for_model(model_type, pad_token_id=0, **given)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    for name, cfg in (("left out", {"model_type": model_type, **given}),
                      ("all", config.to_dict())):
        shape = planner.ModelShape.from_config(cfg, name)
        assert (shape.tied, shape.kv_heads) == (config.tie_word_embeddings,
                                                config.num_key_value_heads), name
        uncounted = _UNCOUNTED.get(model_type, lambda c, h, kv: 0)(config, hidden, shape.kv_dim)
        if biased:   # q, k, v, o biases; gate, up, down biases
            uncounted += 2 * hidden + 2 * shape.kv_dim + 2 * shape.intermediate + hidden
        assert real == shape.params + shape.layers * uncounted, name
        assert uncounted < shape.block_params / shape.hidden


def test_a_multimodal_config_is_tied_when_the_outer_config_says_so():
    """A multimodal config's tie_word_embeddings at the top (LLaVA-OneVision's) was left
    out: its text_config, planned alone, untied, counted the head twice (+27 % for a
    Qwen2-0.5B decoder). transformers ties when either says so."""
    text = dict(model_type="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=160,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    for outer, inner, tied in ((True, None, True), (True, False, True), (False, None, False),
                               (None, True, True), (None, None, False)):
        cfg = {"model_type": "llava", "text_config": dict(text, tie_word_embeddings=inner)}
        if outer is not None:
            cfg["tie_word_embeddings"] = outer
        assert planner.ModelShape.from_config(cfg).tied is tied, (outer, inner)
    with pytest.raises(ValueError, match="tie_word_embeddings must be true or false, got 1"):
        planner.ModelShape.from_config({"tie_word_embeddings": 1, "text_config": text})


def test_the_param_cache_to_pass_is_said_and_plans_the_same(tmp_path, capsys):
    """The plan of params in files takes what host RAM has left as their cache, where
    stream_params' default is prefetch + 5 blocks (Llama-3-70B at batch 1: 217 s of SSD
    against 267 s): the report lists the param_cache_mb to pass for each such layout, and
    planning with it gives the same plan; none for a layout short of host RAM (the state
    in RAM, here: it has none left for one). A state_dtype given twice is planned once."""
    argv = ["llama-3-70b", "--batch", "1", "--state-dtype", "8bit", "--state-dtype", "8bit"]
    assert planner.main(argv + ["--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "(its default, prefetch + 5 blocks, is 11424 MiB here;" in out
    given = dict(re.findall(r"  (params files, state \w+ 8bit): param_cache_mb=(\d+)", out))
    assert sorted(given) == ["params files, state compact 8bit", "params files, state files 8bit"]
    assert re.search(r"params files, state ram 8bit: host RAM \S+ GB > ", out)
    plans = json.loads((tmp_path / "a.json").read_text())["plans"]
    assert len(plans) == 9
    for i, lay in enumerate(p["layout"] for p in plans):
        if lay["params"] != "files" or lay["state"] == "ram":
            continue
        layout = f"params files, state {lay['state']} 8bit"
        assert planner.main(["llama-3-70b", "--batch", "1", "--state-dtype", "8bit",
                             "--param-cache-mb", given[layout], "--json",
                             str(tmp_path / "b.json")]) == 0
        again = json.loads((tmp_path / "b.json").read_text())["plans"][i]
        assert again["layout"] == lay
        assert again["host_bytes"] == plans[i]["host_bytes"]
        assert again["traffic_bytes"] == plans[i]["traffic_bytes"]
    assert "param_cache_mb=" not in capsys.readouterr().out   # (given: nothing to say)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "gemma"])
def test_heads_times_head_dim_apart_from_hidden_is_counted(tmp_path, capsys, model_type):
    """A config whose heads x head_dim is not hidden_size (Qwen3-4B: 32 x 128 over 2560;
    Gemma-7B: 16 x 256 over 3072; Mistral-NeMo: 32 x 128 over 5120) was refused, and no
    flag planned it (the flags' q and o were hidden x hidden): its q, k, v and o are of
    heads x head_dim, as transformers builds them; --head-dim gives it as a flag."""
    given = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=48)
    config = transformers.AutoConfig.for_model(model_type, pad_token_id=0, **given)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    shape = planner.ModelShape.from_config({"model_type": model_type, **given})
    assert (shape.q_dim, shape.kv_dim) == (4 * 48, 2 * 48)
    uncounted = _UNCOUNTED.get(model_type, lambda c, h, kv: 0)(config, 64, shape.kv_dim)
    assert real == shape.params + shape.layers * uncounted
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert planner.main([str(tmp_path), "--state-dtype", "8bit", "--json",
                         str(tmp_path / "a.json")]) == 0
    flags = ["--layers", "3", "--hidden", "64", "--intermediate", "160", "--vocab", "1000",
             "--heads", "4", "--kv-heads", "2", "--head-dim", "48", "--state-dtype", "8bit",
             "--json", str(tmp_path / "b.json")]
    if shape.tied:
        flags.append("--tied")
    assert planner.main(flags) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    keys = ("params", "gpu_bytes", "host_bytes", "disk_bytes", "seconds", "traffic_bytes")
    assert a["plans"] and all(x["params"] == real - shape.layers * uncounted for x in a["plans"])
    assert [[x[k] for k in keys] for x in a["plans"]] == [[x[k] for k in keys] for x in b["plans"]]
    capsys.readouterr()


@pytest.mark.parametrize("model_type", ["gpt_neox", "starcoder2", "phi", "bamba", "bert",
                                        "qwen3_5_text", "mixtral"])
def test_a_model_type_the_planner_does_not_count_is_refused(tmp_path, capsys, model_type):
    """A config of another model_type was planned as a Llama of its widths (at their config
    classes' defaults: GPT-NeoX +32 % params, StarCoder2 +37 %, Phi +28 %, Bamba -20 %,
    Qwen3.5 -8 %, BERT, an encoder, +25 %). Refused, naming the type, the ones taken, and
    the flags that plan it as a Llama anyway."""
    config = transformers.AutoConfig.for_model(model_type).to_dict()
    assert {"hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
            "num_attention_heads"} <= set(config)   # (the keys the planner reads)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert planner.main([str(tmp_path), "--state-dtype", "8bit"]) == 2
    err = capsys.readouterr().err
    assert f"model_type {model_type!r} is not one whose params the planner counts (gemma, " \
        in err
    assert "give the shape as flags instead of the config: --layers --hidden" in err


def test_a_config_without_a_model_type_is_a_llamas():
    """Without a model_type (a config written by hand) a config is taken as a Llama's, as
    before; one that is not a name is refused."""
    cfg = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               num_attention_heads=4)
    want = planner.ModelShape("config", 1000, 64, 160, 2, 4, 4, False)
    assert planner.ModelShape.from_config(cfg) == want
    assert planner.ModelShape.from_config({**cfg, "model_type": None}) == want
    for bad in (5, ["llama"]):
        with pytest.raises(ValueError, match=re.escape(f"model_type {bad!r} is not one")):
            planner.ModelShape.from_config({**cfg, "model_type": bad})


def test_a_failed_plan_leaves_the_json_file_as_it_was(tmp_path, monkeypatch):
    """--json is written beside its path and put in place once whole: a failure midway
    leaves a plan written before untouched and no other file (it used to truncate it)."""
    out = tmp_path / "plan.json"
    out.write_text("{}")

    def fail(*args, **kw):
        raise RuntimeError("midway")
    monkeypatch.setattr(planner, "report", fail)
    with pytest.raises(RuntimeError, match="midway"):
        planner.main(["llama-3-8b", "--json", str(out)])
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert out.read_text() == "{}"


def test_the_search_stops_where_the_pieces_would_be_too_many(monkeypatch):
    """A plan cuts at most MAX_PIECES engine pieces (check_size: its time grows with them,
    and a tiny bucket_mb took hours), and largest_fitting stops where more blocks would cut
    more, said as 'at least'."""
    run = planner.Run(bucket_mb=0.0625)   # (64 KiB: the smallest piece the engine cuts)
    wide = planner.ModelShape("wide", 1000, 1024, 4096, 3, 8, 8)
    most = planner.most_blocks(wide, run)
    assert 1 < most < planner.MAX_BLOCKS
    planner.check_size(wide.with_layers(most), run)
    too_many = planner.piece_count(wide.with_layers(most + 1), run.bucket_mb)
    assert too_many > planner.MAX_PIECES
    with pytest.raises(ValueError, match=f"cuts model 'wide' .* into {too_many} pieces"):
        planner.check_size(wide.with_layers(most + 1), run)
    assert planner.piece_count(wide, 32.0) == 3 * 9 + 3   # (a piece per param at 32 MiB)
    # the search, on a machine everything fits, under a cap small enough to be quick
    monkeypatch.setattr(planner, "MAX_PIECES", 300)
    small = planner.ModelShape("small", 1000, 256, 1024, 3, 4, 4)
    most = planner.most_blocks(small, run)
    assert most == (300 - 17 - 32) // 32 + 1   # (17 resident pieces, 32 a block)
    m = planner.replace(planner.MACHINES["desktop-24gb"], gpu_bytes=1e15, host_bytes=1e15,
                        ssd_bytes=1e15)
    lay = planner.Layout("ram", "files", "8bit")
    assert planner.largest_fitting(small, m, run, lay).layers == most
    assert planner.report(small, m, run, [lay])[1][0]["largest_fitting"]["at_least"] is True


def test_a_probe_larger_than_the_free_disk_is_refused(capsys, tmp_path, monkeypatch):
    """--measure's disk probe writes a file of --probe-gb: past half the free space it is
    refused before anything is written (a full disk for the user's other work)."""
    monkeypatch.chdir(tmp_path)
    usage = planner.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(planner.shutil, "disk_usage",
                        lambda path: usage._replace(free=int(0.08 * planner.GB)))
    argv = ["llama-3-8b", "--machine", "here", "--measure", "--probe-gb", "0.05"]
    assert planner.main(argv) == 2
    assert ("--probe-gb 0.05: the disk probe writes a file of 0.05 GB, more than half of the "
            "0.1 GB free" in capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []

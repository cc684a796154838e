"""A bucket's head region (layout.BucketSpec.head, NvmeState.read_head): the params of a
streamed block kept in their state's bucket, read alone by a forward, beside the pass that
steps the state on another thread. Checked here: the head round-trips and survives a
reopen, with its own checksum (a damaged head is refused, damage elsewhere is not its);
a bucket without a head keeps the fingerprint of files made before heads existed; and a
head read in flight pins its range: a compact pass that reuses that room waits for it."""
import threading
import time

import pytest
import torch

from nvme_adam import adam_fn, fill_initial, flip_byte, grads_record, make_spec
from offload_adam.nvme import NvmeError, NvmeState, StateSpec, StepPipeline, direct_io
from offload_adam.nvme.direct_io import AlignedBuffer
from offload_adam.nvme.layout import (ALIGN, HEADER_BYTES, SUM_BYTES, BucketSpec, TensorSpec,
                                      differences)

# bucket 1's params span two checksum chunks: the head's checksum is over several
HEAD_NUMEL = [3000, SUM_BYTES // 2 + 5000, 700]


def head_spec(fmt="fp32", numels=HEAD_NUMEL):
    """make_spec's buckets, each with a bf16 `param` tensor per bucket as its head."""
    base = make_spec(fmt, buckets=len(numels), numel=4000)
    return StateSpec(tuple(
        BucketSpec((TensorSpec(f"b{i}.param", torch.bfloat16, (n,)),) + b.tensors, head=1)
        for i, (b, n) in enumerate(zip(base.buckets, numels))), base.state_format)


def with_params(fn, seed):
    """fn(i, t) (fill_initial, adam_fn), then the bucket's param set from `seed`, its step:
    a step writes the head with the rest, as the split master's kernel will."""
    calls = []

    def step(i, t):
        fn(i, t)
        g = torch.Generator().manual_seed(seed * 1009 + i * 17 + len(calls))
        calls.append(i)
        p = t[f"b{i}.param"]
        p.copy_(torch.randn(p.shape, generator=g).to(torch.bfloat16))
    return step


def open_state(folder, spec, compact):
    if not compact:
        return NvmeState.open([folder], spec)
    log = [sum(t.numel * 4 for t in b.tensors if t.name.endswith(".master")) + 4096
           for b in spec.buckets]
    return NvmeState.open([folder], spec, compact=True, log_bytes=log)


def one_step(state, pipe, seed, step):
    if state.compact:
        state.begin(state.step + 1, {i: grads_record(seed, step, i, b)
                                     for i, b in enumerate(state.spec.buckets)})
    pipe.step(with_params(adam_fn(seed, step), step))


def read_head(state, i):
    """Bucket i's head read alone: {name: tensor} of its head tensors."""
    b = state.spec.buckets[i]
    buf = AlignedBuffer(b.head_bytes, pin=False)
    state.finish_head(state.read_head(i, buf))
    return {t.name: buf.tensor[o:o + t.nbytes].view(t.dtype).view(t.shape).clone()
            for t, o in zip(b.tensors[:b.head], b.offsets())}


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
def test_a_head_reads_alone_what_the_step_committed_also_after_a_reopen(tmp_path, compact):
    spec = head_spec()
    assert [b.head_bytes % ALIGN for b in spec.buckets] == [0] * 3
    assert spec.buckets[1].head_bytes > SUM_BYTES   # (two chunks)
    with open_state(tmp_path, spec, compact) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        pipe.load(with_params(fill_initial(0), 100), step=0)
        for s in range(3):
            one_step(state, pipe, 0, s)
            for i in range(3):
                assert torch.equal(read_head(state, i)[f"b{i}.param"],
                                   state.views(i)[f"b{i}.param"])
        pipe.close()
        want = [state.views(i)[f"b{i}.param"].clone() for i in range(3)]
    with open_state(tmp_path, spec, compact) as state:   # (the checksums: the manifest's)
        assert state.step == 3
        assert all(torch.equal(read_head(state, i)[f"b{i}.param"], want[i]) for i in range(3))
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        one_step(state, pipe, 0, 3)   # (its full reads check the slots as before)
        pipe.close()


@pytest.mark.parametrize("where", ["head", "state"])
def test_a_damaged_head_is_refused_and_damage_past_it_is_not_the_heads(tmp_path, where):
    spec = head_spec()
    with open_state(tmp_path, spec, False) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        pipe.load(with_params(fill_initial(0), 100), step=0)
        one_step(state, pipe, 0, 0)
        pipe.close()
        b = spec.buckets[1]
        at = state.where(1).offset + (b.head_bytes - 100 if where == "head"
                                      else b.head_bytes + 100)
    flip_byte(state.paths[0], at)
    with open_state(tmp_path, spec, False) as state:
        if where == "head":
            with pytest.raises(NvmeError, match="params kept in bucket 1 .* are damaged"):
                read_head(state, 1)
        else:
            read_head(state, 1)
            with pytest.raises(NvmeError, match="bucket 1 of the optimizer state .* damaged"):
                state.views(1)
        read_head(state, 0)
        read_head(state, 2)


def test_a_bucket_without_a_head_keeps_its_fingerprint(tmp_path):
    """Files made before heads existed resume: a bucket without one is written to the
    spec as it was (a list of tensors); one with a head names it, and a difference in
    it is said."""
    plain = make_spec("fp32", buckets=2)
    assert all(isinstance(b, list) for b in plain.to_json()["buckets"])
    assert StateSpec.from_json(plain.to_json()) == plain
    headed = head_spec(numels=[100, 200])
    assert StateSpec.from_json(headed.to_json()) == headed
    assert headed.digest() != StateSpec.from_json(headed.to_json() | {"buckets": [
        b["tensors"] for b in headed.to_json()["buckets"]]}).digest()
    apart = StateSpec(tuple(BucketSpec(b.tensors) for b in headed.buckets), headed.state_format)
    assert any("first 1 tensors kept apart" in d for d in differences(headed, apart))
    with NvmeState.open([tmp_path], plain) as state:
        with pytest.raises(RuntimeError, match="bucket 0 has no head region"):
            state.read_head(0, AlignedBuffer(ALIGN, pin=False))


def test_a_head_read_in_flight_holds_back_the_write_that_reuses_its_room(tmp_path,
                                                                         monkeypatch):
    """Compact: a forward reads bucket 0's params from its committed copy while the pass
    steps the state; once bucket 0's new copy is committed its old room is free, and a
    later bucket's write reuses it (here bucket 4's, in a ring of 4 spares). That write
    waits for the read in flight: the read gets the bytes it started on (checked against
    their checksum), not the other bucket's."""
    spec = head_spec(numels=[5000] * 6)
    with open_state(tmp_path, spec, True) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        pipe.load(with_params(fill_initial(0), 100), step=0)
        before = state.views(0)["b0.param"].clone()
        held, release = threading.Event(), threading.Event()
        first = HEADER_BYTES + state._body["offsets"][0]
        real_read, real_write = direct_io._read, direct_io._write
        writes = []

        def slow_read(fd, view, offset):
            if offset == first and not held.is_set():   # (the head read below, only)
                held.set()
                release.wait(30)
            return real_read(fd, view, offset)

        def write(fd, view, offset):
            writes.append((offset, len(view)))
            return real_write(fd, view, offset)
        monkeypatch.setattr(direct_io, "_read", slow_read)
        monkeypatch.setattr(direct_io, "_write", write)
        buf = AlignedBuffer(spec.buckets[0].head_bytes, pin=False)
        req = state.read_head(0, buf)
        assert held.wait(30)
        errors = []

        def run():
            try:
                one_step(state, pipe, 0, 0)
            except BaseException as e:   # (said below)
                errors.append(e)
        stepping = threading.Thread(target=run)
        stepping.start()
        time.sleep(1.0)
        n = spec.buckets[0].nbytes
        overlapping = [w for w in writes if w[0] < first + n and first < w[0] + w[1]]
        assert stepping.is_alive() and not overlapping   # (waiting for the read)
        release.set()
        stepping.join(60)
        assert not errors and not stepping.is_alive()
        assert [w for w in writes if w[0] < first + n and first < w[0] + w[1]]   # (reused)
        state.finish_head(req)
        t = spec.buckets[0].tensors[0]
        assert torch.equal(buf.tensor[:t.nbytes].view(t.dtype), before)
        assert state.step == 1 and not state.pending
        pipe.close()


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
@pytest.mark.parametrize("fmt", ["bfloat16", "8bit"])
def test_a_split_bucket_steps_in_files_as_its_fp32_master_bucket(tmp_path, compact, fmt):
    """param_state.adam_bucket(split=True): the params' bf16 values as the head, each
    master's low half and tie bits in its place. Stepped through the pipeline with each
    param's head as its high half (KernelArgs), it is bit for bit the bucket of fp32
    masters stepped with the params beside it; the head read alone is the params."""
    from offload_adam import split_master
    from offload_adam.kernel_step import Hyper, KernelArgs
    from offload_adam.param_state import ParamState, adam_bucket
    shapes = [[("a", (3000,)), ("b", (70001,))], [("c", (5, 7))]]
    gen = torch.Generator().manual_seed(3)
    masters = {n: torch.randn(s, generator=gen) * 0.02 for b in shapes for n, s in b}
    grads = [{n: (torch.randn(m.shape, generator=gen) * 1e-3).bfloat16()
              for n, m in masters.items()} for _ in range(3)]
    hyper = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                  amsgrad=False, maximize=False, decoupled_weight_decay=True)
    got = {}
    for split in (False, True):
        spec = StateSpec(tuple(adam_bucket(b, fmt, split=split) for b in shapes), fmt)
        assert [b.head for b in spec.buckets] == ([2, 1] if split else [0, 0])
        params = {n: split_master.encode(m)[0] for n, m in masters.items()}   # (beside)

        def fill(i, t):
            for v in t.values():
                v.zero_()
            for n, _ in shapes[i]:
                if split:
                    p, lo, tie = split_master.encode(masters[n])
                    t[f"{n}.param"].copy_(p)
                    t[f"{n}.master_lo"].copy_(lo.view(t[f"{n}.master_lo"].shape))
                    t[f"{n}.master_tie"].copy_(tie)
                else:
                    t[f"{n}.master"].copy_(masters[n])

        def step(k):
            def fn(i, t):
                args = KernelArgs()
                for n, _ in shapes[i]:
                    args.add(ParamState.in_bucket(t, n), t[f"{n}.param"] if split else params[n])
                args.run([grads[k][n] for n, _ in shapes[i]], hyper, 1.0, 2)
            return fn
        folder = tmp_path / str(split)
        folder.mkdir()
        with open_state(folder, spec, compact) as state:
            pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
            pipe.load(fill, step=0)
            for k in range(3):
                if compact:
                    state.begin(state.step + 1, {i: ({"k": k}, []) for i in range(2)})
                pipe.step(step(k))
            pipe.close()
            out = {}
            for i, b in enumerate(shapes):
                v = state.views(i)
                for n, _ in b:
                    if split:
                        assert torch.equal(read_head(state, i)[f"{n}.param"], v[f"{n}.param"])
                        master = split_master.decode(v[f"{n}.param"], v[f"{n}.master_lo"],
                                                     v[f"{n}.master_tie"])
                        params[n] = v[f"{n}.param"].clone()
                    else:
                        master = v[f"{n}.master"].clone()
                    out[n] = (master, params[n], {k: x.clone() for k, x in v.items()
                                                  if k.startswith(n + ".exp_avg")})
        got[split] = out
    for n in masters:
        (m0, p0, s0), (m1, p1, s1) = got[False][n], got[True][n]
        assert torch.equal(m0.view(torch.int32), m1.view(torch.int32)), n
        assert torch.equal(p0.view(torch.int16), p1.view(torch.int16)), n
        assert s0.keys() == s1.keys() and all(torch.equal(s0[k].view(torch.uint8),
                                                          s1[k].view(torch.uint8)) for k in s0)
        assert not torch.equal(m0, masters[n])   # (it stepped)

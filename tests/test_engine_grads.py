"""Which host copy of a grad is current (offload_adam/engine/grads.py): copy
records, stale copies copied again, fingerprints, and GradScaler's unscale_.
Engine-only tests run on the asynchronous simulated device (conftest.sim)."""
import contextlib
import threading

import pytest
import torch

import offload_adam
from offload_adam.engine import grads as engine_grads
from offload_adam.freed_grad import is_freed
from engine_watch import buckets_of
from models import (BF16, MLP_OPTS, OPTS, assert_same, loss_of, make_mlp, make_pair, mlp_loss,
                    states)



# The device's fingerprint (torch ops: CUDA, the simulated device) and the host's (the
# kernels: HostDevice, a CPU engine's), one number.
FINGERPRINTS = ["grad_fingerprint", "host_fingerprint"]


# Whole chunks a round of the device's version: the CPU's 1, and a GPU's several (its
# own 8 there), here on the CPU.
ROWS = [1, 3]


@pytest.mark.parametrize("fingerprint", FINGERPRINTS)
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [64, 1 << 22])
@pytest.mark.parametrize("per_round", ROWS)
def test_grad_fingerprint(monkeypatch, kernels, fingerprint, dtype, chunk, per_round):
    """The fingerprint moves for the edits a user makes through .data, also
    those that keep the sum of the bit patterns (negating a tensor with as many
    positive as negative elements), and not for an untouched or copied grad."""
    monkeypatch.setattr(engine_grads, "_FINGERPRINT_CHUNK", chunk)
    monkeypatch.setattr(engine_grads, "_rows", lambda device: per_round)
    fp = getattr(engine_grads, fingerprint)
    half = torch.rand(500, generator=torch.Generator().manual_seed(0)) + 0.5
    g = torch.cat([half, -half]).to(dtype)
    base = fp(g)
    assert torch.equal(base, fp(g.clone()))
    one_ulp = g.clone()
    one_ulp.view(torch.int16 if g.element_size() == 2 else torch.int32)[7] += 1
    swapped = g.clone()   # (two elements a chunk apart: each in the other's place)
    swapped[[3, 3 + min(chunk, 500)]] = swapped[[3 + min(chunk, 500), 3]]
    rows = g[:min(chunk, 250) * 4].reshape(4, -1)   # (rows of a chunk's width reversed)
    for edited in (-g, g * 2, one_ulp, g.clamp(-1, 1), torch.zeros_like(g), swapped):
        assert not torch.equal(fp(edited), base)
    assert not torch.equal(fp(rows.flip(0)), fp(rows))
    wide = torch.stack([g, g])  # non-contiguous columns
    assert torch.equal(fp(wide.t()), fp(wide.t().contiguous()))


@pytest.mark.parametrize("fingerprint", FINGERPRINTS)
@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float64])
@pytest.mark.parametrize("per_round", ROWS + [4])
def test_grad_fingerprint_is_its_formula(monkeypatch, kernels, fingerprint, dtype,
                                        per_round):
    """The fingerprint is the sum, modulo 2^64, of each element's bit pattern (signed)
    times the odd weight of its position in its chunk and its chunk's odd factor:
    computed here with Python's integers over a grad of several chunks and a partial
    last one. (A float64 grad is twice as many 32-bit words: the device's version
    summed only the first half of them, in a product buffer too short, until
    2026-12-08.) The device's version reduces `per_round` whole chunks a round: a bf16
    or float32 grad here is 15 of them and a partial one, 3 rounds of 4 and one of 3 at 4."""
    monkeypatch.setattr(engine_grads, "_FINGERPRINT_CHUNK", 64)
    monkeypatch.setattr(engine_grads, "_rows", lambda device: per_round)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(dtype)
    bits = g.view(torch.int16 if g.element_size() == 2 else torch.int32).tolist()
    weights = engine_grads._weights(g.device, 64).tolist()
    assert all(w % 2 for w in weights)
    want = sum(b * weights[i % 64] * engine_grads._chunk_factor(i // 64)
               for i, b in enumerate(bits)) % 2**64
    want -= 2**64 if want >= 2**63 else 0
    assert getattr(engine_grads, fingerprint)(g).item() == want


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("per_round", ROWS)
def test_the_host_fingerprint_is_the_device_fingerprint_on_every_isa(kernels, monkeypatch,
                                                                     dtype, per_round):
    """The kernels' fingerprint (every ISA variant this CPU runs) gives the torch ops'
    number at the CPU's real chunk: sizes within one chunk, on its edges, over several;
    a strided grad and a transposed one (each taken as its values in order)."""
    monkeypatch.setattr(engine_grads, "_rows", lambda device: per_round)
    chunk = engine_grads._chunk(torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(n, generator=gen).to(dtype)
             for n in (0, 1, 31, chunk - 1, chunk, chunk + 1, 3 * chunk + 5)]
    wide = torch.randn(2, chunk + 3, generator=gen).to(dtype)
    grads += [wide[0, ::2], wide.t()]
    assert not grads[-2].is_contiguous() and not grads[-1].is_contiguous()
    active = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            for g in grads:
                got, want = engine_grads.host_fingerprint(g), engine_grads.grad_fingerprint(g)
                assert got.dtype == torch.int64 and got.shape == () and got.device == g.device
                assert torch.equal(got, want), (isa, g.shape)
    finally:
        kernels.set_isa(active)


def test_the_kernels_fingerprint_refuses_what_is_no_grad_s_bits(kernels):
    w = engine_grads._weights(torch.device("cpu"), 64)
    with pytest.raises(TypeError, match="bits must be int16 or int32.*Float"):
        kernels.grad_fingerprint(torch.zeros(4), w)
    with pytest.raises(TypeError, match="weights must be int64"):
        kernels.grad_fingerprint(torch.zeros(4, dtype=torch.int16), w.to(torch.int32))
    with pytest.raises(ValueError, match="at least one weight"):
        kernels.grad_fingerprint(torch.zeros(4, dtype=torch.int16), w[:0])
    with pytest.raises(ValueError, match="contiguous"):
        kernels.grad_fingerprint(torch.zeros(8, dtype=torch.int16)[::2], w)


def test_a_host_engine_sees_a_hidden_edit_with_the_kernels_fingerprint(kernels, monkeypatch):
    """bf16 params in host memory stepped by the engine (step_in_backward: its
    HostDevice, no simulated device) fingerprint their grads with the kernels, and a
    .data edit after backward (no version bump) is still seen at step()."""
    from offload_adam.engine.device import HostDevice
    calls = []

    def spy(grad):
        calls.append(grad.numel())
        return engine_grads.host_fingerprint(grad)
    monkeypatch.setattr(HostDevice, "fingerprint", staticmethod(spy))
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **MLP_OPTS)
    mlp_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    assert set(calls) == {p.numel() for p in model.parameters()}   # (each at its copy, and more)
    mlp_loss(model, 1).backward()
    model[2].weight.grad.data.mul_(0.5)
    with pytest.raises(RuntimeError, match="changed after it was copied"):
        opt.step()


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("n", [3, 64, 1000])
def test_bits_sum_is_the_sum_of_the_bit_patterns_in_chunks(monkeypatch, dtype, n):
    """engine/param_check.bits_sum sums a chunk at a time (torch widens an int64 sum's
    whole input first: 4x a bf16 param's bytes on the device at every step, seen on an
    H200): the exact sum of the signed bit patterns for sizes within a chunk, on its
    edge and over several with a partial last one; bits_sums stacks them (one tensor)."""
    from offload_adam.engine import param_check
    monkeypatch.setattr(param_check, "_CHUNK", 64)
    g = torch.randn(n + 1, generator=torch.Generator().manual_seed(n)).to(dtype)[1:]
    # (offset by one element, odd sizes: the CPU's 8-byte word shortcut not taken)
    bits = g.view(torch.int16 if g.element_size() == 2 else torch.int32).tolist()
    assert param_check.bits_sum(g).item() == sum(bits)
    sums = param_check.bits_sums([g, -g])
    assert [t.item() for t in sums] == [sum(bits), param_check.bits_sum(-g).item()]
    assert sums[0].untyped_storage().data_ptr() == sums[1].untyped_storage().data_ptr()


def test_a_copy_record_follows_identity_and_version():
    g = torch.ones(3)
    copy = engine_grads.GradCopy(g, None, pieces=1)
    assert copy.is_of(g) and not copy.is_of(g.clone()) and not copy.is_of(None)
    g.add_(1)
    assert not copy.is_of(g)
    assert copy.unsent == 1
    piece = object()
    copy.sent("transfer", piece)
    assert copy.unsent == 0 and copy.transfers == ["transfer"]
    assert copy.sent_ids == {id(piece)}   # (a kernel checks its own pieces were sent)


@contextlib.contextmanager
def host_copies(device, params):
    """Inside the block: the params whose grad `device` (the simulated one)
    copies to the host, in the order their first copy starts."""
    seen, d2h = {}, device.d2h

    def recording_d2h(dsts, srcs, after=None):
        for s in srcs:
            seen.setdefault(s.untyped_storage().data_ptr(), None)
        return d2h(dsts, srcs, after)

    copied = []
    device.d2h = recording_d2h
    try:
        yield copied
    finally:
        device.d2h = d2h
        by_storage = {p.grad.untyped_storage().data_ptr(): p for p in params
                      if p.grad is not None}
        copied += [by_storage[s] for s in seen if s in by_storage]


def test_only_changed_grads_are_copied_again(sim):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    loss_of(model, 0).backward()
    model.head.weight.grad.mul_(2)        # a version bump
    model.head.bias.grad.data.mul_(2)     # no bump: the fingerprint
    with host_copies(sim.sim, list(model.parameters())) as again:
        opt.step()
    assert len(again) == 2
    assert {id(p) for p in again} == {id(model.head.weight), id(model.head.bias)}


def test_fingerprint_checks_are_waited_for_by_the_bucket_jobs(sim):
    """step() only queues the comparisons; each bucket's job waits for its own
    (on a GPU, step() must not wait for the rest of backward)."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    waited_in = []
    fetch = sim.sim.fetch

    def recording_fetch(t):
        result, done = fetch(t)

        def recorded():
            waited_in.append(threading.current_thread().name)
            return result()
        return recorded, done

    sim.sim.fetch = recording_fetch
    loss_of(model, 0).backward()
    model.head.bias.grad.data.mul_(2)
    opt.step()
    assert waited_in and set(waited_in) == {"offload_adam-worker"}
    assert len(waited_in) == len(buckets_of(opt.last_step_profile))   # one per bucket stepped


def _scaled_backward(model, scaler, it):
    scaler.scale(mlp_loss(model, it)).backward()


def test_unscale_after_freed_grads_is_an_error(path):
    """free_grads_after_copy dropped the grads in backward, so GradScaler.unscale_
    has nothing to unscale: it raises, and nothing is stepped with the scaled
    copies."""
    model = make_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=True, **MLP_OPTS)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _scaled_backward(model, scaler, 0)
    assert all(is_freed(p.grad) for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"unscale_ cannot unscale the grad of param "
                                           r"group 0, param \d+ \(shape"):
        scaler.unscale_(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("misuse", ["step_again", "backward_again"])
@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_a_stepped_freed_grad_is_refused_until_zero_grad(path, misuse, zero):
    """torch keeps a stepped grad until zero_grad(): a second step() steps it again and
    the next backward adds to it. A freed grad's host copy is let go after its step, so
    both raise, naming the param, with nothing stepped (before, both went on silently
    from no grad); after zero_grad(), the optimizer's or the model's, training goes on
    bitwise as without the option."""
    a, b = make_mlp(), make_mlp()
    ref = offload_adam.AdamW(a.parameters(), **MLP_OPTS)
    opt = offload_adam.AdamW(b.parameters(), free_grads_after_copy=True, **MLP_OPTS)
    for m, o in ((a, ref), (b, opt)):
        mlp_loss(m, 0).backward()
        o.step()
    before = [p.detach().clone() for p in b.parameters()]
    with pytest.raises(RuntimeError, match=r"grad of param group 0, param \d+ \(shape .* "
                                           r"let go after the last step\(\) stepped it"):
        if misuse == "step_again":
            opt.step()
        else:
            mlp_loss(b, 1).backward()
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))
    ref.zero_grad()
    (opt if zero == "optimizer" else b).zero_grad()
    for m, o in ((a, ref), (b, opt)):
        mlp_loss(m, 1).backward()
        o.step()
        o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_grad_freed_by_another_optimizer_is_refused(path):
    """An optimizer built between backward and step() over params whose grads another
    freed (one dropped for another: the documented way to undo stream_params): those
    grads are in the first's host copies, not readable by the second, whose step() once
    read them as no grad and stepped nothing, silently. Refused, naming the param; after
    zero_grad() and a backward again, the second steps as torch's would."""
    a, b = make_mlp(), make_mlp()
    ref = offload_adam.AdamW(a.parameters(), **MLP_OPTS)
    first = offload_adam.AdamW(b.parameters(), free_grads_after_copy=True, **MLP_OPTS)
    mlp_loss(a, 0).backward()
    mlp_loss(b, 0).backward()
    second = offload_adam.AdamW(b.parameters(), **MLP_OPTS)   # (after: it copied nothing)
    del first   # (kept until its backward freed the grads)
    before = [p.detach().clone() for p in b.parameters()]
    with pytest.raises(RuntimeError, match=r"grad of param group 0, param \d+ \(shape .* freed "
                                           r"in backward by another optimizer"):
        second.step()
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))
    second.zero_grad()
    mlp_loss(b, 0).backward()
    for o in (ref, second):
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _unverified_scaler_run(device, overlap):
    """GradScaler with unscale_ without fingerprints: only invalidate_copies
    makes step() copy the unscaled grads again."""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, verify_grads=False, **MLP_OPTS)
    checks, fetch = [], device.fetch   # the device fetches only fingerprint comparisons
    device.fetch = lambda t: (checks.append(t), fetch(t))[1]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    params = list(model.parameters())
    for it in range(3):
        with host_copies(device, params) as in_backward:
            _scaled_backward(model, scaler, it)
        scaler.unscale_(opt)
        with host_copies(device, params) as again:
            scaler.step(opt)
        scaler.update()
        if overlap:  # copied in backward, then once more in step()
            assert len(in_backward) == 4 and len(again) == 4
        opt.zero_grad()
    device.fetch = fetch
    assert not checks   # no fingerprints: an in-place edit is not seen
    return model, opt


def test_unscale_without_verify_grads_copies_again(sim, monkeypatch):
    # (the params' bits check fetches too: off, so that only grad fingerprints would)
    from offload_adam.engine.param_check import ParamCheck
    monkeypatch.setattr(ParamCheck, "start", lambda self, params: None)
    assert_same(_unverified_scaler_run(sim.sim, True), _unverified_scaler_run(sim.sim, False))


def test_opt_clip_after_unscale_without_verify_grads_is_an_error(sim):
    """Without fingerprints opt.clip_grad_norm_ after unscale_ computed its norm
    from the stale (scaled) host copies: refused, nothing stepped."""
    model = make_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = offload_adam.AdamW(model.parameters(), verify_grads=False, **MLP_OPTS)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _scaled_backward(model, scaler, 0)
    scaler.unscale_(opt)
    opt.clip_grad_norm_(0.5)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ was called after "
                       r"GradScaler.unscale_\(opt\)"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not any(states(opt).get(p) for p in model.parameters())


def _tanh_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _inputs(n):
    return [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]


@pytest.mark.parametrize("options", [{}, {"step_in_backward": True},
                                     {"free_grads_after_copy": True}],
                         ids=["plain", "in-backward", "freed"])
def test_a_first_backward_that_raised_in_a_grad_hook_steps_each_param_once(sim, options):
    """A post-accumulate-grad hook of the user's (registered after the optimizer: it runs
    after the engine's) raises in the first backward, a batch skipped; the training that
    goes on is the one without that batch. The param was in the learned bucket order
    twice (its hook ran in both backwards before any copy) and was stepped twice every
    step, in two buckets (found from outside)."""
    xs = _inputs(4)
    runs = []
    for skipped in (False, True):
        m = _tanh_mlp()
        opt = offload_adam.AdamW(m.parameters(), lr=1e-2, **options)
        if skipped:
            def guard(p):
                raise FloatingPointError("a bad batch")
            handle = m[2].bias.register_post_accumulate_grad_hook(guard)
            with pytest.raises(FloatingPointError):
                m(xs[0]).pow(2).sum().backward()
            handle.remove()
            opt.zero_grad()
        for x in xs[1:]:
            m(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        assert {float(opt.state[p]["step"]) for p in m.parameters()} == {3.0}
        runs.append(m)
    assert all(torch.equal(a, b) for a, b in zip(runs[0].parameters(), runs[1].parameters()))


@pytest.mark.parametrize("verify_grads", [True, False])
def test_an_unpickled_optimizer_takes_grad_scaler_s_scale_as_the_original(path, verify_grads):
    """torch's pickled optimizer state leaves out _step_supports_amp_scaling: an unpickled
    (or deepcopied) optimizer let GradScaler unscale the grads in place after the
    engine had copied them, and without verify_grads stepped the copies still scaled
    (found from outside: 7.6e-3 off in 6 steps). It trains bit for bit as the original."""
    import pickle

    xs = _inputs(6)
    runs = []
    for copied in (False, True):
        m = _tanh_mlp()
        opt = offload_adam.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3,
                                 verify_grads=verify_grads)
        if copied and path.files:   # (a copy would share the original's files)
            with pytest.raises(RuntimeError, match="is in use by another optimizer"):
                pickle.loads(pickle.dumps((m, opt)))
            opt.close()
            return
        if copied:
            m, opt = pickle.loads(pickle.dumps((m, opt)))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for x in xs:
            scaler.scale(m(x).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(m)
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(runs[0].parameters(), runs[1].parameters()))


def test_the_fingerprint_bench_runs_and_its_contenders_agree(kernels, tmp_path):
    """bench/fingerprint_bench.py on a tiny size: it checks every contender's numbers equal
    before timing (rows 1 and 3 of the torch version, the kernels per ISA) and writes a
    median per contender."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(repo / "bench" / "fingerprint_bench.py"), "--grads", "2",
           "--numel", str(3 * 131072 + 5), "--rows", "1,3", "--passes", "2", "--tag", "pytest",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=repo,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "fingerprint_bench_pytest.json").read_text())
    names = {"torch/rows=1", "torch/rows=3"} | {f"kernel/{i}" for i in kernels.supported_isas()}
    assert set(result["medians"]) == names
    assert all(len(s["done_ns"]) == 2 and min(s["done_ns"]) > 0
               for s in result["samples"].values())

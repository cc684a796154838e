"""Which host copy of a grad is current (offload_adam/engine/grads.py): copy
records, stale copies copied again, fingerprints, and GradScaler's unscale_.
Engine-only tests run on the asynchronous simulated device (conftest.sim)."""
import threading

import pytest
import torch

import offload_adam
from offload_adam.engine import grads as engine_grads
from offload_adam.freed_grad import is_freed
from models import BF16, MLP_OPTS, OPTS, assert_same, loss_of, make_mlp, make_pair, mlp_loss



@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [64, 1 << 22])
def test_grad_fingerprint(monkeypatch, dtype, chunk):
    """The fingerprint moves for the edits a user makes through .data, also
    those that keep the sum of the bit patterns (negating a tensor with as many
    positive as negative elements), and not for an untouched or copied grad."""
    monkeypatch.setattr(engine_grads, "_FINGERPRINT_CHUNK", chunk)
    fp = engine_grads.grad_fingerprint
    half = torch.rand(500, generator=torch.Generator().manual_seed(0)) + 0.5
    g = torch.cat([half, -half]).to(dtype)
    base = fp(g)
    assert torch.equal(base, fp(g.clone()))
    one_ulp = g.clone()
    one_ulp.view(torch.int16 if g.element_size() == 2 else torch.int32)[7] += 1
    for edited in (-g, g * 2, one_ulp, g.clamp(-1, 1), torch.zeros_like(g)):
        assert not torch.equal(fp(edited), base)
    wide = torch.stack([g, g])  # non-contiguous columns
    assert torch.equal(fp(wide.t()), fp(wide.t().contiguous()))


def test_a_copy_record_follows_identity_and_version():
    g = torch.ones(3)
    copy = engine_grads.GradCopy(g, None, pieces=1)
    assert copy.is_of(g) and not copy.is_of(g.clone()) and not copy.is_of(None)
    g.add_(1)
    assert not copy.is_of(g)
    assert copy.unsent == 1
    copy.sent("transfer")
    assert copy.unsent == 0 and copy.transfers == ["transfer"]


def test_only_changed_grads_are_copied_again(sim):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    loss_of(model, 0).backward()
    engine = opt._engine
    copies = {id(r): r.copy for r in engine.recs}
    model.head.weight.grad.mul_(2)        # a version bump
    model.head.bias.grad.data.mul_(2)     # no bump: the fingerprint
    opt.step()
    again = [r.param for r in engine.recs if r.copy is not copies[id(r)]]
    assert len(again) == 2
    assert again[0] is model.head.weight and again[1] is model.head.bias


def test_fingerprint_checks_are_waited_for_by_the_bucket_jobs(sim):
    """step() only queues the comparisons; each bucket's job waits for its own
    (on a GPU, step() must not wait for the rest of backward)."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    engine = opt._engine
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
    assert len(waited_in) == len({r.pieces[0].bucket.index for r in engine.recs
                                  if r.param.grad is not None})


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
    with pytest.raises(RuntimeError, match=r"unscale_ cannot unscale the grad of a param"):
        scaler.unscale_(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _unverified_scaler_run(overlap):
    """GradScaler with unscale_ without fingerprints: only invalidate_copies
    makes step() copy the unscaled grads again."""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, verify_grads=False, **MLP_OPTS)
    assert not opt._engine.sees_in_place_edits
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for it in range(3):
        _scaled_backward(model, scaler, it)
        scaler.unscale_(opt)
        copies = [r.copy for r in opt._engine.recs]
        scaler.step(opt)
        scaler.update()
        if overlap:  # copied in backward, then once more in step()
            assert all(c is not None and r.copy is not c
                       for r, c in zip(opt._engine.recs, copies))
        opt.zero_grad()
    return model, opt


def test_unscale_without_verify_grads_copies_again(sim):
    assert_same(_unverified_scaler_run(True), _unverified_scaler_run(False))


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
    assert not any(opt.state.get(p) for p in model.parameters())

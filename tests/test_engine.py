"""The offload engine on CPU: bf16 params run the whole pipeline (hooks, host
copies, buckets, redo, staging, resume) with plain copies for transfers.

References: torch.optim.AdamW on fp32 copies (fp32 master, bf16 param = master
rounded), compared with a tolerance (different but equivalent float order), and
offload_adam.AdamW on fp32 CPU copies: the same kernel without the engine, so
equal bit for bit.
"""
import copy
import threading

import pytest
import torch

import offload_adam

# Every test runs on both grad paths (conftest.grad_path).
pytestmark = pytest.mark.usefixtures("grad_path")

BF16 = torch.bfloat16


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=37, dim=32, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)
        self.unused = torch.nn.Linear(dim, dim)  # never gets a grad

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def make_pair(seed=0):
    torch.manual_seed(seed)
    ref = TinyTransformer()
    model = copy.deepcopy(ref).to(BF16)
    ref.load_state_dict({k: v.to(BF16).float() for k, v in ref.state_dict().items()})
    return model, ref


def loss_of(model, seed, dtype):
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, 37, (2, 8), generator=g)
    logits = model(tokens).to(dtype)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def copy_grads(model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = None if p.grad is None else p.grad.float()


def masters(opt, model):
    return [opt.state[p].get("master_param") for p in model.parameters()]


def assert_bf16_is_master_rounded(opt, model):
    for p in model.parameters():
        st = opt.state.get(p)
        if st:
            assert torch.equal(p, st["master_param"].to(BF16))


OPTS = dict(lr=3e-3, weight_decay=0.1, bucket_mb=0.01)


@pytest.mark.parametrize("overlap", [True, False])
def test_transformer_matches_torch_adamw(kernels, overlap):
    model, ref = make_pair()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    for it in range(4):
        loss_of(model, it, BF16).backward()
        copy_grads(model, ref)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    assert len(opt._engine.buckets) > 3
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in ropt.state:
            torch.testing.assert_close(opt.state[p]["master_param"], q, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ropt.state[q]["exp_avg_sq"])
        else:
            assert not opt.state.get(p)  # unused: no state, as torch
            assert torch.equal(p.float(), q)
    assert_bf16_is_master_rounded(opt, model)


def run(model, opt, iters, edit=None, micro=1, start=0):
    for it in range(start, start + iters):
        for m in range(micro):
            loss_of(model, 10 * it + m, BF16).backward()
        if edit is not None:
            edit(model, opt)
        opt.step()
        opt.zero_grad()


def train_shadow(shadow, ref, ropt, steps, micro=1):
    """The reference run: `shadow` (bf16, holding ref's params rounded) makes the
    grads of `run`'s batches, `ropt` steps the fp32 `ref` with them."""
    for it in range(steps):
        for m in range(micro):
            loss_of(shadow, 10 * it + m, BF16).backward()
        copy_grads(shadow, ref)
        ropt.step()
        shadow.zero_grad()
        with torch.no_grad():
            for p, q in zip(shadow.parameters(), ref.parameters()):
                p.copy_(q)


def test_overlap_and_not_are_bitwise_equal_to_the_cpu_class(kernels):
    """Engine (both modes) == the same kernel on fp32 copies, bit for bit."""
    results = []
    for overlap in (True, False):
        model, _ = make_pair()
        opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
        run(model, opt, 3)
        results.append((model, opt))
    # the reference: fp32 CPU params (the optimizer's direct path, no engine),
    # fed the grads of a bf16 shadow model that holds its params rounded
    shadow, ref = make_pair()
    ropt = offload_adam.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    train_shadow(shadow, ref, ropt, steps=3)
    (m1, o1), (m2, o2) = results
    for p1, p2, q in zip(m1.parameters(), m2.parameters(), ref.parameters()):
        assert torch.equal(p1, p2)
        assert torch.equal(p1, q.to(BF16))
        if o1.state.get(p1):
            assert torch.equal(o1.state[p1]["master_param"], q)
            assert torch.equal(o2.state[p2]["master_param"], q)
            assert torch.equal(o1.state[p1]["exp_avg_sq"], ropt.state[q]["exp_avg_sq"])
        else:
            assert not ropt.state.get(q)


def _clip(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _scale(model, opt):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def _edit_one(model, opt):
    model.head.weight.grad[0].fill_(0.25)


def _edit_data(model, opt):
    model.head.weight.grad.data.mul_(-3)  # .data: a new version counter, no bump


def _unscale_in_place(model, opt):
    # GradScaler.unscale_'s op: changes the grads and bumps no version counter
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._amp_foreach_non_finite_check_and_unscale_(
        grads, torch.zeros(1), torch.full((1,), 0.25))


def _drop_one(model, opt):
    model.head.bias.grad = None


def _replace_one(model, opt):
    model.embed.weight.grad = model.embed.weight.grad * 3


EDITS = [_clip, _scale, _edit_one, _edit_data, _unscale_in_place, _drop_one, _replace_one]


def _edited_runs(edit, **options):
    """The params after two steps with `edit` between backward and step, with
    overlap=True (options) and with overlap=False (everything inside step())."""
    out = []
    for overlap in (True, False):
        model, _ = make_pair()
        opt = offload_adam.AdamW(model.parameters(), overlap=overlap, eps=1e-2,
                                 **{**OPTS, **options})
        run(model, opt, 2, edit=edit)
        out.append(list(model.parameters()))
    return out


@pytest.mark.parametrize("edit", EDITS)
def test_changes_between_backward_and_step_are_seen(kernels, edit):
    """Whatever happens to p.grad after backward, the step uses what is there at
    step(): compare with overlap=False, which copies everything inside step().
    (eps is large so that scaling a grad changes Adam's update.)"""
    a, b = _edited_runs(edit)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("edit", [_edit_data, _unscale_in_place])
def test_hidden_edits_are_caught_by_the_fingerprint(kernels, grad_path, edit):
    """Without verify_grads a copied grad changed behind its version counter is
    missed (the check above would fail): the fingerprint is what sees it. Live
    grads need no check."""
    a, b = _edited_runs(edit, verify_grads=False)
    same = all(torch.equal(p, q) for p, q in zip(a, b))
    assert same == (grad_path == "live-grad")


def test_only_changed_grads_are_copied_again(kernels, grad_path):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    loss_of(model, 0, BF16).backward()
    tokens = {id(s): s.copy_token for s in opt._engine.slots}
    model.head.weight.grad.mul_(2)
    model.head.bias.grad.data.mul_(2)
    seen = []
    real = opt._engine._kernels
    opt._engine._kernels = lambda: _Spy(real(), seen)
    opt.step()
    changed = [s for s in opt._engine.slots if s.copy_token != tokens[id(s)]]
    if grad_path == "copied-grad":
        assert [s.param for s in changed] == [model.head.weight, model.head.bias]
    else:  # nothing is copied: the kernel reads each grad where it is
        grads = {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
        assert seen and set(seen) == grads
        assert all(s.host_grad is None for s in opt._engine.slots)  # not kept alive


def test_fingerprint_checks_are_waited_for_by_the_bucket_jobs(kernels, grad_path):
    """step() only queues the comparisons; each bucket's job waits for its own
    (on a GPU, step() must not wait for the rest of backward)."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    engine = opt._engine
    waited_in = []
    fetch = engine.device.fetch

    def recording_fetch(t):
        result, done = fetch(t)

        def recorded():
            waited_in.append(threading.current_thread().name)
            return result()
        return recorded, done

    engine.device.fetch = recording_fetch
    loss_of(model, 0, BF16).backward()
    model.head.bias.grad.data.mul_(2)
    opt.step()
    if grad_path == "live-grad":
        assert waited_in == []
    else:
        assert waited_in and set(waited_in) == {"offload_adam-worker"}
        assert len(waited_in) == len({s.bucket for s in engine.slots
                                      if s.param.grad is not None})


class _Spy:
    """The kernels, noting the address of every grad adam_step reads."""

    def __init__(self, kernels, seen):
        self._kernels, self._seen = kernels, seen

    def adam_step(self, params, grads, *args):
        self._seen.extend(g.data_ptr() for g in grads)
        return self._kernels.adam_step(params, grads, *args)

    def __getattr__(self, name):
        return getattr(self._kernels, name)


def test_grad_accumulation_over_micro_batches(kernels):
    out = []
    for overlap in (True, False):
        model, _ = make_pair()
        opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
        run(model, opt, 2, micro=3)
        out.append((model, opt))
    # reference: the same accumulated grads summed by hand, stepped by torch
    model, ref = make_pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    shadow = copy.deepcopy(model)
    train_shadow(shadow, ref, ropt, steps=2, micro=3)
    (m1, o1), (m2, o2) = out
    for p1, p2, q in zip(m1.parameters(), m2.parameters(), ref.parameters()):
        assert torch.equal(p1, p2)
        if q in ropt.state:
            torch.testing.assert_close(o1.state[p1]["master_param"], q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overlap", [True, False])
def test_clip_fast_path_matches_torch_clip(kernels, overlap):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
    model2, _ = make_pair()
    opt2 = offload_adam.AdamW(model2.parameters(), overlap=overlap, max_grad_norm=0.05, **OPTS)
    model3, ref = make_pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    for it in range(3):
        loss_of(model, it, BF16).backward()
        loss_of(model2, it, BF16).backward()
        copy_grads(model, ref)
        before = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
        norm = opt.clip_grad_norm_(0.05)
        for p, g in before.items():
            assert torch.equal(p.grad, g)  # the fast path leaves p.grad alone
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        opt.step(), opt2.step(), ropt.step()
        opt.zero_grad(), opt2.zero_grad(), ropt.zero_grad()
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                q.copy_(opt.state[p]["master_param"] if opt.state.get(p) else p.float())
    for p, p2 in zip(model.parameters(), model2.parameters()):
        if opt.state.get(p):
            torch.testing.assert_close(opt.state[p]["master_param"],
                                       opt2.state[p2]["master_param"], rtol=1e-5, atol=1e-7)


def test_state_dict_resume_is_bitwise(kernels):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())
    for st in sd["state"].values():
        assert st["master_param"].dtype == torch.float32
        assert st["exp_avg"].device.type == "cpu" and st["step"].dim() == 0
    run(model, opt, 2, start=2)

    model2, _ = make_pair(seed=5)
    model2.load_state_dict(msd)
    opt2 = offload_adam.AdamW(model2.parameters(), **OPTS)
    opt2.load_state_dict(sd)
    run(model2, opt2, 2, start=2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        if opt.state.get(p):
            for key in ("master_param", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_scheduler_groups_and_step_without_backward(kernels):
    model, _ = make_pair()
    groups = [{"params": list(model.body.parameters()), "weight_decay": 0.0},
              {"params": list(model.embed.parameters()) + list(model.head.parameters())
               + list(model.unused.parameters()), "lr": 1e-2}]
    opt = offload_adam.AdamW(groups, lr=3e-3, bucket_mb=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    opt.step()  # no backward yet: nothing happens
    assert not opt.state
    model2, ref = make_pair()
    rgroups = [{"params": list(ref.body.parameters()), "weight_decay": 0.0},
               {"params": list(ref.embed.parameters()) + list(ref.head.parameters())
                + list(ref.unused.parameters()), "lr": 1e-2}]
    ropt = torch.optim.AdamW(rgroups, lr=3e-3)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, 1, gamma=0.5)
    for it in range(3):
        loss_of(model, it, BF16).backward()
        copy_grads(model, ref)
        opt.step(), ropt.step(), sched.step(), rsched.step()
        opt.zero_grad(), ropt.zero_grad()
        with torch.no_grad():  # keep the reference on the bf16 trajectory
            for p, q in zip(model.parameters(), ref.parameters()):
                q.copy_(opt.state[p]["master_param"] if opt.state.get(p) else p.float())
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in ropt.state:
            torch.testing.assert_close(opt.state[p]["exp_avg"], ropt.state[q]["exp_avg"])
    assert not opt.state.get(model.unused.weight)


def test_several_optimizers_and_mixed_fp32_cpu(kernels):
    model, _ = make_pair()
    extra = torch.nn.Linear(4, 4)  # fp32 CPU: the direct path, beside the engine
    opt1 = offload_adam.AdamW(list(model.body.parameters()) + list(extra.parameters()), **OPTS)
    opt2 = offload_adam.Adam(list(model.embed.parameters()) + list(model.head.parameters()),
                             lr=1e-3, bucket_mb=0.01)
    for it in range(2):
        (loss_of(model, it, BF16) + extra(torch.ones(4)).sum()).backward()
        opt1.step(), opt2.step()
        opt1.zero_grad(), opt2.zero_grad()
    assert "master_param" not in opt1.state[extra.weight]
    assert_bf16_is_master_rounded(opt1, model)
    assert_bf16_is_master_rounded(opt2, model)


def test_del_optimizer_frees_buffers_and_hooks(kernels, grad_path):
    import gc
    import weakref
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 1)
    arena = weakref.ref(opt._engine._arenas[0]._arenas[("state", torch.float32)])
    engine = weakref.ref(opt._engine)
    # live grads: nothing to overlap, the step runs on the caller's thread
    assert (opt._engine._worker is None) == (grad_path == "live-grad")
    thread = opt._engine._worker._thread if opt._engine._worker else None
    del opt
    gc.collect()
    assert engine() is None and arena() is None
    if thread is not None:
        thread.join(timeout=5)
        assert not thread.is_alive()
    loss_of(model, 0, BF16).backward()  # hooks are gone or harmless


@pytest.mark.parametrize("early", [False, True])
def test_profile_and_host_bytes(kernels, grad_path, early):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS, step_in_backward=early)
    assert opt.last_step_profile is None
    n = sum(p.numel() for p in model.parameters())
    # master + 2 moments (fp32), plus alignment; a host grad (bf16) when grads
    # are copied (a live grad is read in place, except for early steps); a
    # staging buffer (bf16) only when the kernel may run while backward reads
    # the params: otherwise a CPU param is written by the kernel directly.
    copied = early or grad_path == "copied-grad"
    per_param = 12 + 2 * copied + 2 * early
    assert per_param * n <= opt.host_bytes() < per_param * n + 64 * 5 * len(list(model.parameters()))
    run(model, opt, 1)
    prof = opt.last_step_profile
    assert set(prof) == {"d2h_s", "cpu_step_s", "h2d_s", "exposed_s", "timeline"}
    phases = {r["phase"] for r in prof["timeline"]}
    assert phases == {"d2h", "cpu_step", "h2d"} - ({"h2d"} if not early else set()) \
        - ({"d2h"} if not copied else set())
    for r in prof["timeline"]:
        assert r["end_s"] >= r["start_s"] and isinstance(r["bucket"], int)
    assert prof["exposed_s"] >= prof["cpu_step_s"] > 0


def test_free_grads_after_copy(kernels):
    out = []
    for free in (True, False):
        model, _ = make_pair()
        opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=free, **OPTS)
        for it in range(2):
            loss_of(model, it, BF16).backward()
            if free:
                assert all(p.grad is None for p in model.parameters())
            opt.clip_grad_norm_(0.1)
            opt.step()
            opt.zero_grad()
        out.append(model)
    for p, q in zip(*(m.parameters() for m in out)):
        assert torch.equal(p, q)
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=True, **OPTS)
    loss_of(model, 0, BF16).backward()
    with pytest.raises(RuntimeError, match="accumulat"):
        loss_of(model, 1, BF16).backward()


def _scaler_run(overlap, unscale, clip=None, max_grad_norm=None, opt_clip=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4)).to(BF16)
    # eps large enough that a grad left scaled changes the update (Adam is
    # otherwise nearly invariant to the grads' scale)
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, eps=1e-2,
                             max_grad_norm=max_grad_norm, **OPTS)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for it in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(it)).to(BF16)
        scaler.scale(model(x).float().pow(2).sum()).backward()
        if unscale:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if opt_clip:
            opt.clip_grad_norm_(opt_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return opt, list(model.parameters())


@pytest.mark.parametrize("overlap", [True, False])
def test_opt_clip_after_unscale(kernels, overlap):
    """opt.clip_grad_norm_ after GradScaler.unscale_ sees the unscaled grads
    (fingerprints, or live grads) and equals clipping inside the kernel with
    the grads still scaled (the scale is a power of two: bitwise)."""
    o1, a = _scaler_run(True, unscale=False, max_grad_norm=0.5)
    o2, b = _scaler_run(overlap, unscale=True, opt_clip=0.5)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(o1.state[p]["master_param"], o2.state[q]["master_param"])


def test_grad_scaler(kernels):
    """Low-precision params under torch.amp.GradScaler. unscale_ changes grads
    without bumping version counters: the engine must copy them again. (bf16:
    GradScaler refuses to unscale fp16 grads; on CUDA the usual case is fp32
    params, which the engine steps there.) The scale is a power of two, so
    unscaling in the kernel or before is the same."""
    _, a = _scaler_run(True, unscale=True)
    _, b = _scaler_run(False, unscale=True)
    _, c = _scaler_run(True, unscale=False)
    for p, q, r in zip(a, b, c):
        assert torch.equal(p, q) and torch.equal(p, r)
    # clipping: in-kernel (max_grad_norm, grads still scaled) vs unscale_ + torch's
    # clip, which rounds the clipped grads to bf16 (the kernel keeps them fp32):
    # equal up to that rounding, moved by Adam's normalisation at most ~lr.
    o1, d = _scaler_run(True, unscale=False, max_grad_norm=0.5)
    o2, e = _scaler_run(False, unscale=True, clip=0.5)
    for p, q in zip(d, e):
        torch.testing.assert_close(o1.state[p]["master_param"], o2.state[q]["master_param"],
                                   rtol=0, atol=3e-4)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [64, 1 << 22])
def test_grad_fingerprint(monkeypatch, dtype, chunk):
    """The fingerprint moves for the edits a user makes through .data, also
    those that keep the sum of the bit patterns (negating a tensor with as many
    positive as negative elements), and not for an untouched or copied grad."""
    from offload_adam import engine_device

    monkeypatch.setattr(engine_device, "_FINGERPRINT_CHUNK", chunk)
    fp = engine_device.grad_fingerprint
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

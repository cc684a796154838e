"""The offload engine on a real GPU (skipped without CUDA).

The CPU tests (tests/test_engine*.py) cover the pipeline logic; these cover
what only a GPU shows: results, no optimizer bytes on the device, events
rather than device syncs, pinned host memory, the device-mix error.
Race check (not run by pytest): compute-sanitizer --tool racecheck and
--tool synccheck on `python tests/cuda/test_engine_cuda.py` (the __main__ run).
"""
import copy
import gc

import pytest
import torch

import offload_adam
from offload_adam.freed_grad import is_freed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16 = torch.bfloat16


def make_model(dtype=BF16, seed=0, width=256):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, width),
        torch.nn.GELU(), torch.nn.Linear(width, 8)).to("cuda", dtype)


def loss_of(model, it, dtype=BF16):
    g = torch.Generator(device="cuda").manual_seed(it)
    x = torch.randn(16, 64, device="cuda", generator=g, dtype=dtype)
    return model(x).float().pow(2).mean()


def train(model, opt, iters, micro=1, edit=None):
    for it in range(iters):
        for m in range(micro):
            loss_of(model, 10 * it + m).backward()
        if edit:
            edit(model)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("micro", [1, 3])
def test_overlap_matches_no_overlap_and_torch(micro):
    runs = []
    for overlap in (True, False):
        model = make_model()
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, overlap=overlap, bucket_mb=0.05)
        train(model, opt, 3, micro=micro,
              edit=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1))
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(p, o1.state[p]["master_param"].to("cuda", BF16))
        assert o1.state[p]["master_param"].device.type == "cpu"
    # torch's fused AdamW on fp32 masters, fed the same bf16 grads
    model = make_model()
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ropt = torch.optim.AdamW(ref, lr=1e-3)
    for it in range(3):
        for m in range(micro):
            loss_of(model, 10 * it + m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        for p, r in zip(model.parameters(), ref):
            r.grad = p.grad.float()
        ropt.step()
        model.zero_grad()
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref):
                p.copy_(r)
    for p, r in zip(m1.parameters(), ref):
        torch.testing.assert_close(o1.state[p]["master_param"], r.cpu(), rtol=1e-5, atol=1e-6)


def test_hidden_grad_edits_are_seen():
    """p.grad.data edits (no version bump) between backward and step: the
    fingerprint check copies those grads again; equal to overlap=False."""
    def edit(model):
        for p in list(model.parameters())[::2]:
            p.grad.data.mul_(-2)
    runs = []
    for overlap in (True, False):
        model = make_model()
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, eps=1e-2, overlap=overlap,
                                 bucket_mb=0.05)
        train(model, opt, 3, edit=edit)
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("in_backward", [False, True])
def test_param_data_edits_are_followed(in_backward):
    """p.data.clamp_() between steps (WGAN's clip: no version bump of p): the sums of
    the params' bits, compared on the device (engine/param_check.py), show it and the
    next step goes on from the clamped values, as a run whose masters were dropped at
    the clamp (loaded from a state dict without them) does."""
    runs = []
    for drop in (False, True):
        model = make_model()
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, bucket_mb=0.05,
                                 step_in_backward=in_backward)
        train(model, opt, 2)
        for p in model.parameters():
            p.data.clamp_(-0.02, 0.02)
        if drop:
            sd = opt.state_dict()
            for st in sd["state"].values():
                st.pop("master_param", None)
            opt.close()
            opt = offload_adam.AdamW(model.parameters(), lr=1e-3, bucket_mb=0.05,
                                     step_in_backward=in_backward)
            opt.load_state_dict(sd)
        clamped = [p.detach().clone() for p in model.parameters()]
        train(model, opt, 2)
        for p, c in zip(model.parameters(), clamped):
            assert (p.float() - c.float()).abs().max() < 0.01   # on from the clamp
        runs.append(model)
        opt.close()
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


def test_no_optimizer_memory_on_the_gpu():
    model = make_model(width=2048)
    opt = offload_adam.AdamW(model.parameters(), bucket_mb=1)
    count = sum(p.numel() for p in model.parameters())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss_of(model, 0).backward()
    torch.cuda.reset_peak_memory_stats()
    before_step = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    # no state: only the temporaries of the fingerprint check (two int64 chunks
    # of 2^20) and of packed copies, far below Adam's 12 B/param
    assert torch.cuda.max_memory_allocated() - before_step < 4 * count
    opt.zero_grad()
    assert torch.cuda.memory_allocated() <= base + (1 << 20)
    assert opt.host_bytes() >= 16 * params // 2  # master + moments + buffers live on the host
    assert opt.pinned()


def page_locked(t: torch.Tensor) -> bool:
    """Whether CUDA sees t's first byte as page-locked host memory. Not t.is_pinned():
    torch asks about the storage's first byte, and an arena's views lie past its
    unpinned slack page (engine/host_memory.py)."""
    import ctypes

    lib = next(line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line)
    attrs = (ctypes.c_int * 64)()   # cudaPointerAttributes, with room to spare
    err = ctypes.CDLL(lib).cudaPointerGetAttributes(attrs, ctypes.c_void_p(t.data_ptr()))
    assert err == 0, f"cudaPointerGetAttributes: error {err}"
    return attrs[0] == 1   # cudaMemoryTypeHost


def test_only_what_the_copies_use_is_pinned():
    """The moments and a bf16 param's master are not page-locked (only the CPU kernel
    reads them); an fp32 param's master is (its copy's source); opt.pinned() holds."""
    model = make_model(width=512)
    model[-1].float()   # an fp32 head: both kinds of param
    model[-1].register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    opt = offload_adam.AdamW(model.parameters(), bucket_mb=1)
    loss_of(model, 0).backward()
    opt.step()
    torch.cuda.synchronize()
    for p in model.parameters():
        st = opt.state[p]
        assert not page_locked(st["exp_avg"]) and not page_locked(st["exp_avg_sq"])
        assert page_locked(st["master_param"]) == (p.dtype is torch.float32), p.dtype
    assert opt.pinned()


def test_free_grads_after_copy_saves_device_memory():
    after_backward = {}
    for free in (False, True):
        model = make_model(width=1024)
        opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=free)
        # An earlier test's engine, in reference cycles, freed by a collection during
        # backward would take its device memory out of the count (2026-11-28, H200).
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss_of(model, 0).backward()
        torch.cuda.synchronize()
        after_backward[free] = torch.cuda.memory_allocated() - base
        if free:   # each grad a FreedGrad once on the host: its shape, no device memory
            assert all(is_freed(p.grad) and p.grad.shape == p.shape for p in model.parameters())
            norm = opt.clip_grad_norm_(1.0)
            assert norm.device.type == "cuda" and torch.isfinite(norm)
        opt.step()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        del model, opt
    assert after_backward[False] - after_backward[True] >= params, after_backward


def test_step_uses_events_not_device_syncs():
    """No device or stream sync while step() runs (the profiler's own
    cudaDeviceSynchronize, at its exit, lies after the step's range)."""
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.05)
    train(model, opt, 1)
    loss_of(model, 1).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
    events = prof.events()
    # (torch 2.11 records the step's range twice, nested: the span of them all)
    steps = [e for e in events if e.name.startswith("Optimizer.step#")]
    assert steps
    start = min(e.time_range.start for e in steps)
    end = max(e.time_range.end for e in steps)
    syncs = [e.name for e in events
             if e.name in ("cudaDeviceSynchronize", "cudaStreamSynchronize")
             and start <= e.time_range.start <= end]
    assert syncs == []


def test_params_are_updated_when_step_returns():
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), lr=1e-2, bucket_mb=0.05)
    loss_of(model, 0).backward()
    opt.step()
    # read on the current stream right away, with no sync by us
    for p in model.parameters():
        assert torch.equal(p.detach().cpu(), opt.state[p]["master_param"].to(BF16))
    sd = model.state_dict()
    for (name, t), p in zip(sd.items(), model.parameters()):
        assert torch.equal(t, p)


def test_fp32_params_and_grad_scaler_with_autocast():
    runs = []
    for overlap in (True, False):
        model = make_model(dtype=torch.float32)
        opt = offload_adam.AdamW(model.parameters(), overlap=overlap, bucket_mb=0.05)
        scaler = torch.amp.GradScaler("cuda")
        for it in range(3):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_of(model, it, torch.float32)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.equal(p, q)


def test_state_dict_resume_is_bitwise():
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.05)
    train(model, opt, 2)
    sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    train(model, opt, 2)
    model2 = make_model(seed=1)
    model2.load_state_dict(msd)
    opt2 = offload_adam.AdamW(model2.parameters(), bucket_mb=0.05)
    opt2.load_state_dict(sd)
    train(model2, opt2, 2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_cuda_and_cpu_mix_is_a_clear_error():
    a = torch.nn.Parameter(torch.zeros(2, device="cuda"))
    b = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="several devices"):
        offload_adam.AdamW([a, b])


def test_pieces_and_packs_and_early_steps_match_the_cpu():
    """A param cut in pieces over several buckets, packed small params, and
    step_in_backward: the same bits as a CPU twin stepped in place from the same
    grads (the GPU's forward rounds differently from the CPU's, so the grads come
    from the GPU run)."""
    from bare_engine import BareEngine   # tests/ (on sys.path under pytest)
    from engine_watch import buckets_of

    def run(bare=False, **options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(8192, 64), torch.nn.LayerNorm(64),
                                    torch.nn.Linear(64, 64)).to("cuda", BF16)
        twin = copy.deepcopy(model).cpu()
        opt = (BareEngine if bare else offload_adam.AdamW)(model.parameters(), lr=1e-3,
                                                           bucket_mb=0.25, **options)
        ropt = offload_adam.AdamW(twin.parameters(), lr=1e-3, bucket_mb=0.25)   # in place
        for it in range(4):
            tokens = torch.randint(0, 8192, (256,), generator=torch.Generator().manual_seed(it))
            model(tokens.to("cuda")).float().pow(2).mean().backward()
            for p, q in zip(model.parameters(), twin.parameters()):
                q.grad = p.grad.cpu()
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p.cpu(), q), (options, it)
        return opt

    for options in ({}, {"step_in_backward": True}, {"overlap": False}):
        opt = run(**options)
        # The layout, read from an engine driven alike (the optimizer's is not
        # public), and the optimizer's last step went through as many buckets.
        bare = run(bare=True, **options)
        first = bare.param_groups[0]["params"][0]
        pieces = next(r for r in bare.engine.recs if r.param is first).pieces
        assert len(pieces) == 4
        assert any(p.packed for b in bare.engine.buckets for p in b.pieces)
        assert buckets_of(opt.last_step_profile) == set(range(len(bare.engine.buckets)))


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_packs_among_large_grads_match_the_cpu_fed_the_same_grads(dtype):
    """Issue 25: at the default bucket_mb a bucket's packed grads (norms,
    biases) lie among large weights' grads; a pack's copy wrote over those.
    The engine's steps equal a CPU twin's stepped in place from the same
    grads, bit for bit, and freed grads clip and step as kept ones."""
    runs = []
    for free in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.TransformerEncoderLayer(256, 4, dropout=0.0, batch_first=True),
            torch.nn.Linear(256, 37)).to("cuda", dtype)
        twin = copy.deepcopy(model).cpu()
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, free_grads_after_copy=free)
        ropt = offload_adam.AdamW(twin.parameters(), lr=1e-3)   # CPU params: in place
        norms = []
        for it in range(3):
            x = torch.randn(2, 8, 256, generator=torch.Generator().manual_seed(it))
            model(x.to("cuda", dtype)).float().pow(2).mean().backward()
            if not free:
                for p, q in zip(model.parameters(), twin.parameters()):
                    q.grad = p.grad.cpu()
                ropt.step()
                ropt.zero_grad()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            opt.step()
            opt.zero_grad()
            if not free:
                for p, q in zip(model.parameters(), twin.parameters()):
                    assert torch.equal(p.cpu(), q), it
        runs.append((model, norms))
    (kept, kept_norms), (freed, freed_norms) = runs
    assert freed_norms == pytest.approx(kept_norms, rel=1e-2)
    for p, q in zip(kept.parameters(), freed.parameters()):
        assert torch.equal(p, q)


def test_delete_frees_pinned_memory():
    import gc
    model = make_model(width=1024)
    opt = offload_adam.AdamW(model.parameters())
    loss_of(model, 0).backward()
    opt.step()
    del opt
    gc.collect()
    loss_of(model, 1).backward()  # hooks gone; nothing crashes


if __name__ == "__main__":  # a small run for compute-sanitizer
    for options in ({}, {"step_in_backward": True}, {"free_grads_after_copy": True}):
        model = make_model()
        opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.05, **options)
        train(model, opt, 3, micro=1 if options else 2,
              edit=None if options else lambda m: torch.nn.utils.clip_grad_norm_(
                  m.parameters(), 0.1))
        del opt
    torch.cuda.synchronize()
    print("ok")

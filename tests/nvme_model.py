"""The small model of the optimizer-level NVMe tests (tests/test_nvme_optimizer.py and the
crash test's optimizer worker, tests/nvme_crash_worker.py): CPU params of fp32 and bf16 in
two param groups, grads that are a function of (param, step, micro-batch) so that a run
resumed in another process continues exactly as an uninterrupted one, and the bitwise
comparison of params and optimizer state."""
import contextlib

import torch

SHAPES = ((40, 33), (700,), (5, 7, 3), (300,))
DTYPES = (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
NVME = dict(bucket_mb=0.005)   # ~5 KB buckets: a bucket of one or two params


def make_params(seed=0, shapes=SHAPES, dtypes=DTYPES):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 0.5).to(d).requires_grad_()
            for s, d in zip(shapes, dtypes)]


def groups(ps, split=2):
    """Two groups, with and without weight decay."""
    return [{"params": ps[:split], "weight_decay": 0.1},
            {"params": ps[split:], "weight_decay": 0.0}]


def grad(p, step, micro):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + p.numel() % 97)
    return torch.randn(p.shape, generator=gen).to(p.dtype)


def train(opt, ps, first, count, clip=False, accumulate=1):
    """Steps first..first+count-1; step 2 leaves param 1 without a grad (torch skips it)."""
    for k in range(first, first + count):
        for p in ps:
            p.grad = None
        for micro in range(accumulate):   # plain torch accumulation: grads add up
            for j, p in enumerate(ps):
                if k == 2 and j == 1:
                    continue
                g = grad(p, k, micro)
                p.grad = g if p.grad is None else p.grad + g
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()


def bits(t):
    t = t.detach().reshape(-1)
    return t.view(torch.int16 if t.element_size() == 2 else torch.uint8)


def assert_same(ps, qs, a, b):
    for p, q in zip(ps, qs):
        assert torch.equal(bits(p), bits(q))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sorted(sa["state"][i]) == sorted(sb["state"][i])
        for k in sa["state"][i]:
            assert torch.equal(bits(sa["state"][i][k]), bits(sb["state"][i][k])), (i, k)


def assert_stepped_from(after, before, other):
    """Each param went one step on from `before` (under 0.05 away), where `other` (the
    values a stale master would have moved it back to) lies further than that."""
    for a, b, o in zip(after, before, other):
        assert (a.float() - b.float()).abs().max() < 0.05 < (b.float() - o.float()).abs().max()


@contextlib.contextmanager
def kernel_interrupted(call=3):
    """The kernel's `call`-th call in the block raises KeyboardInterrupt (as a Ctrl-C
    would, mid-step), which must end the block: with compact state files the step is cut
    after its redo log."""
    import pytest
    from offload_adam import kernel_step
    real, calls = kernel_step.adam_step, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*a, **kw)
    kernel_step.adam_step = failing
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        kernel_step.adam_step = real
    assert len(calls) == call


def cut_short(opt, ps, step, call=3):
    """Trains step `step`, cut short by kernel_interrupted(call)."""
    with kernel_interrupted(call):
        train(opt, ps, step, 1)

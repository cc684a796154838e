"""Property tests: over shapes, dtypes and hyperparameters, ours is no further
from the float64 reference than torch's fp32 AdamW, and bf16/fp16 params equal
their masters rounded."""
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

import offload_adam  # noqa: E402
from reference import ReferenceAdam, assert_lp_matches_master, assert_no_worse_than_torch  # noqa: E402

# Sizes around the vector widths (8 and 16 floats) and cache-line chunks.
SIZES = [0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 127, 1000, 1031]
shapes = st.one_of(st.sampled_from(SIZES).map(lambda n: (n,)),
                   st.tuples(st.sampled_from([1, 3, 16, 17]), st.sampled_from([1, 15, 33])))


@given(
    shape_list=st.lists(shapes, min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    kind=st.sampled_from(["Adam", "AdamW"]),
    lr=st.sampled_from([0.0, 1e-4, 1e-3, 3e-2]),
    beta1=st.sampled_from([0.0, 0.5, 0.9]),
    beta2=st.sampled_from([0.0, 0.99, 0.999]),
    eps=st.sampled_from([0.0, 1e-8, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    grad_scale=st.sampled_from([None, 1024.0]),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2 ** 16),
)
def test_kernel_against_reference(kernels, shape_list, dtype, kind, lr, beta1, beta2, eps,
                                  weight_decay, amsgrad, maximize, grad_scale, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shape_list]
    hyper = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                 amsgrad=amsgrad, maximize=maximize)
    ours = [x.clone().requires_grad_() for x in init]
    theirs = [x.float().requires_grad_() for x in init]
    opt = getattr(offload_adam, kind)(ours, **hyper)
    topt = getattr(torch.optim, kind)(theirs, **hyper)
    refs = [ReferenceAdam(x, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                          decoupled=kind == "AdamW", amsgrad=amsgrad, maximize=maximize)
            for x in init]
    scale = grad_scale or 1.0
    for _ in range(steps):
        for p, q, r in zip(ours, theirs, refs):
            g = torch.randn(p.shape, generator=gen).to(dtype)
            # eps=0 with a zero grad gives 0/0 in every implementation; keep grads nonzero.
            g = torch.where(g == 0, torch.ones_like(g), g)
            p.grad = (g.float() * scale).to(dtype) if grad_scale else g
            q.grad = g.float()
            r.step(g)
        if grad_scale:
            opt.grad_scale = torch.tensor(grad_scale)
        opt.step()
        topt.step()
        opt.__dict__.pop("grad_scale", None)
    masters = [p.detach() if dtype == torch.float32 else opt.state[p]["master_param"] for p in ours]
    assert_no_worse_than_torch(masters, [q.detach() for q in theirs], [r.p for r in refs],
                               what=f"{kind} {dtype}")
    if dtype != torch.float32:
        for p, m in zip(ours, masters):
            assert_lp_matches_master(p.detach(), m)

"""Every kernel variant (OFFLOAD_ADAM_ISA=avx512|avx2|neon|scalar) is correct and all
give bitwise-identical results; bad values fail with clear errors.

Each variant runs in a subprocess because the variable is read when the module
loads."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload_adam

REPO = Path(__file__).resolve().parents[1]

# Every variant a build can have (isa_dispatch.cpp), best first.
KNOWN_ISAS = ["avx512", "avx2", "neon", "scalar"]

# Steps bf16 and fp32 params of awkward sizes, checks K.isa() and the error vs the
# float64 reference, and saves the results for the bitwise comparison.
SCRIPT = r"""
import sys, torch, offload_adam
from offload_adam._build import load_kernels
sys.path.insert(0, sys.argv[3])
from reference import ReferenceAdam, assert_no_worse_than_torch
assert load_kernels().isa() == sys.argv[1], (load_kernels().isa(), sys.argv[1])
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
shapes = [(1,), (15,), (16,), (17,), (33,), (1000,), (0,), (31, 33)]
out = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for amsgrad in (False, True):
        init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        ps = [x.clone().requires_grad_() for x in init]
        qs = [x.float().requires_grad_() for x in init]
        opt = offload_adam.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
        topt = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
        refs = [ReferenceAdam(x, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad) for x in init]
        for _ in range(3):
            for p, q, r in zip(ps, qs, refs):
                g = torch.randn(p.shape, generator=gen).to(dtype)
                p.grad, q.grad = g, g.float()
                r.step(g)
            opt.step()
            topt.step()
        masters = [p.detach() if dtype == torch.float32 else opt.state[p]["master_param"] for p in ps]
        assert_no_worse_than_torch(masters, [q.detach() for q in qs], [r.p for r in refs])
        key = f"{dtype}-{amsgrad}"
        out[key] = [torch.cat([m.flatten() for m in masters]),
                    torch.cat([p.detach().flatten().float() for p in ps])]
torch.save(out, sys.argv[2])
print("ok", sys.argv[1])
"""


def run_variant(isa, tmp_path, script=SCRIPT):
    env = dict(os.environ, OFFLOAD_ADAM_ISA=isa)
    out = tmp_path / f"{isa}.pt"
    proc = subprocess.run([sys.executable, "-c", script, isa, str(out), str(REPO / "tests")],
                          env=env, cwd=str(REPO), capture_output=True, text=True, timeout=600)
    return proc, out


def test_every_variant_is_correct_and_all_agree_bitwise(kernels, tmp_path):
    isas = offload_adam.supported_isas()
    assert isas[-1] == "scalar" and set(isas) <= set(KNOWN_ISAS)
    results = {}
    for isa in isas:
        proc, out = run_variant(isa, tmp_path)
        assert proc.returncode == 0, f"{isa}:\n{proc.stdout}\n{proc.stderr}"
        results[isa] = torch.load(out)
    first = isas[0]
    for isa in isas[1:]:
        for key, tensors in results[first].items():
            for a, b in zip(tensors, results[isa][key]):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (
                    f"{first} and {isa} differ on {key}")


ERROR_SCRIPT = r"""
import sys
from offload_adam._build import load_kernels
try:
    load_kernels()
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("NO ERROR")
"""


@pytest.mark.parametrize("isa", KNOWN_ISAS[:-1])
def test_unsupported_variant_raises_runtime_error(kernels, isa, tmp_path):
    supported = offload_adam.supported_isas()
    if isa in supported:
        pytest.skip(f"this CPU supports {isa}")
    proc, _ = run_variant(isa, tmp_path, ERROR_SCRIPT)
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    assert line.startswith("RuntimeError"), line
    assert isa in line
    for other in supported:
        assert other in line.split(isa, 1)[1], f"{other} not listed: {line}"


def test_unknown_variant_raises_value_error(kernels, tmp_path):
    proc, _ = run_variant("sse9", tmp_path, ERROR_SCRIPT)
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("ValueError") and "sse9" in line, line
    assert "expects " + ", ".join(KNOWN_ISAS) in line, line


def test_set_isa_in_process(kernels):
    active = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            assert kernels.isa() == isa
        with pytest.raises(ValueError, match="sse9"):
            kernels.set_isa("sse9")
    finally:
        kernels.set_isa(active)
    assert kernels.isa() == active


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grad_mul_rounds_as_torch_multiplies_on_every_variant(kernels, dtype):
    """adam_step's grad_mul (the factor torch's clip multiplied a freed grad by,
    free_grads_after_copy) steps the grad torch's multiplication in the grad's
    dtype leaves (the fp32 product rounded to nearest even), then grad_scale in
    fp32: bit for bit, on every variant, in the vector body and the scalar tail.
    1.5 makes half the 16-bit products ties; 0.3 rounds them every way."""
    from offload_adam.kernel_step import Hyper, adam_step
    gen = torch.Generator().manual_seed(5)
    n = 1013   # not a multiple of any vector width: a tail
    grad = (torch.randn(n, generator=gen) * 3).to(dtype)
    init = torch.randn(n, generator=gen)
    hyper = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                  decoupled_weight_decay=True, maximize=False, amsgrad=False)

    def step(g, grad_mul):
        state = [init.clone(), torch.zeros(n), torch.zeros(n)]
        adam_step([state[0]], [g], [state[1]], [state[2]], [], [], [torch.tensor(0.0)],
                  hyper, 0.7, 2, grad_mul=grad_mul)
        return torch.stack(state).view(torch.int32)

    active = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            for factor in (1.5, 0.3):
                coef = torch.tensor(factor, dtype=dtype)   # clip_grad_norm_'s, as the grads'
                ours = step(grad, float(coef))
                assert torch.equal(ours, step(grad * coef, 1.0)), (isa, factor)
                if dtype != torch.float32:   # (the rounding shows)
                    assert not torch.equal(ours, step(grad.float(), float(coef)))
    finally:
        kernels.set_isa(active)


def test_the_grad_norm_of_huge_grads_is_finite_and_the_same_on_every_variant(kernels):
    """A grad above ~1.8e19 squares past fp32's range. The kernel sums squares in fp32
    blocks of 64 vectors: such a block is summed again in double, so the norm of finite
    grads is finite, the float64 one, on every variant and wherever the grad sits (a
    block on one vector width, the double tail on another: inf on some before). An inf
    grad still gives inf, a NaN NaN. opt.clip_grad_norm_ twice then max_grad_norm
    (a coefficient of the coefficient) stays finite."""
    active = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            for n in (100, 600, 5000):
                for at in (0, n - 1):
                    g = torch.full((n,), 0.01)
                    g[at] = 2e19
                    p = torch.nn.Parameter(torch.zeros(n))
                    p.grad = g.clone()
                    opt = offload_adam.AdamW([p], lr=1e-3, weight_decay=0.0, max_grad_norm=1.0)
                    norm = opt.clip_grad_norm_(1.0)
                    exact = g.double().norm()
                    assert torch.isfinite(norm) and abs(norm.double() - exact) <= 1e-6 * exact, \
                        (isa, n, at, norm)
                    assert opt.clip_grad_norm_(1.0) <= 1.0 + 1e-6
                    opt.step()
                    assert torch.isfinite(p).all() and p[at] < 0, (isa, n, at)
                    for bad in (float("inf"), float("nan")):
                        p.grad = g.clone()
                        p.grad[n // 2] = bad
                        got = opt.clip_grad_norm_(1.0).item()
                        assert (math.isinf(got) if bad == float("inf") else math.isnan(got)), \
                            (isa, n, bad, got)
                        opt.zero_grad()
    finally:
        kernels.set_isa(active)

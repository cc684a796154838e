"""Bad input fails early, with torch's messages where torch has one and with the
param's name (or group and index) and shape where we add a check."""
import pytest
import torch

import offload_adam

BAD_HYPER = [
    {"lr": -1e-3},
    {"lr": torch.tensor([1e-3, 1e-3])},
    {"eps": -1.0},
    {"betas": (1.0, 0.999)},
    {"betas": (-0.1, 0.999)},
    {"betas": (0.9, 1.0)},
    {"betas": (0, 0.999)},
    {"weight_decay": -0.1},
]


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
@pytest.mark.parametrize("kwargs", BAD_HYPER, ids=lambda kw: repr(kw)[:40])
def test_invalid_hyperparameters_raise_like_torch(kind, kwargs):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError) as theirs:
        getattr(torch.optim, kind)([p], **kwargs)
    with pytest.raises(ValueError) as ours:
        getattr(offload_adam, kind)([p], **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("mode", ["capturable", "differentiable"])
def test_unsupported_modes(mode):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=mode):
        offload_adam.AdamW([p], **{mode: True})
    opt = offload_adam.AdamW([p])
    with pytest.raises(ValueError, match=mode):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], mode: True})
    assert len(opt.param_groups) == 1


def sparse_grad_model():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    return emb


def test_sparse_grad_names_the_param(kernels):
    emb = sparse_grad_model()
    opt = offload_adam.AdamW(emb.named_parameters())
    with pytest.raises(RuntimeError, match=r"sparse.*'weight' \(shape \(10, 4\)\)"):
        opt.step()
    emb2 = sparse_grad_model()
    opt2 = offload_adam.AdamW([torch.zeros(2, requires_grad=True), *emb2.parameters()])
    opt2.param_groups[0]["params"][0].grad = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"group 0, param 1 \(shape \(10, 4\)\)"):
        opt2.step()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
def test_unsupported_dtype_at_construction(dtype):
    # (an integer param is taken and never stepped, as by torch: test_torch_contract)
    good = torch.zeros(3, requires_grad=True)
    bad = torch.zeros(2, 2, dtype=dtype)
    with pytest.raises(TypeError, match=rf"group 0, param 1 \(shape \(2, 2\)\).*{dtype}"):
        offload_adam.AdamW([good, bad])
    with pytest.raises(TypeError, match=rf"'layer.w'.*{dtype}"):
        offload_adam.AdamW([("x", good), ("layer.w", bad)])
    opt = offload_adam.AdamW([good])
    with pytest.raises(TypeError, match=str(dtype)):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1  # the failed group was not added


def test_non_cpu_params_are_rejected():
    # No GPU here: a meta tensor stands in for any non-CPU device.
    p = torch.zeros(3, device="meta", requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"group 0, param 0.*meta"):
        offload_adam.AdamW([p])


def test_bad_params_argument_like_torch():
    with pytest.raises(TypeError):
        offload_adam.AdamW(torch.zeros(3, requires_grad=True))
    with pytest.raises(ValueError, match="empty parameter list"):
        offload_adam.AdamW([])

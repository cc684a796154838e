"""The NVMe tier (state_dirs=) on a real GPU (skipped without CUDA): both layouts of the
files, with and without step_in_backward, bitwise the engine with its state in host RAM.
The CPU tests (test_nvme_*.py) prove the logic on the simulated device; this is what
only CUDA shows: its streams and events ordering the grads the redo log reads (compact)
and the params the files' pass reads and writes."""
import pytest
import torch

import offload_adam

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Net(torch.nn.Module):
    """bf16 layers and an fp32 gain on their output (an fp32 param among the bf16 ones,
    outside the matmuls: cuBLAS takes one dtype)."""

    def __init__(self, width):
        super().__init__()
        self.seq = torch.nn.Sequential(
            torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, width),
            torch.nn.GELU(), torch.nn.Linear(width, 8)).to(torch.bfloat16)
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.seq(x).float() * self.gain


def make_model(seed=0, width=256):
    torch.manual_seed(seed)
    return Net(width).cuda()


def loss_of(model, it):
    g = torch.Generator(device="cuda").manual_seed(it)
    x = torch.randn(16, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    return model(x).pow(2).mean()


@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "step_in_backward"])
@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_state_files_on_cuda_match_host_ram(tmp_path, footprint, in_backward):
    runs = []
    for files in (False, True):
        model = make_model()
        kw = dict(state_dirs=str(tmp_path), state_footprint=footprint,
                  step_in_backward=in_backward, state_budget_mb=2) if files else {}
        opt = offload_adam.AdamW(model.parameters(), lr=1e-3, bucket_mb=0.05,
                                 state_dtype="8bit", **kw)
        for it in range(4):
            if it == 2:
                with torch.no_grad():   # an edit: the master starts again from the param
                    model.seq[0].weight.mul_(0.5)
            loss_of(model, it).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        runs.append((model, opt))
    (m1, _), (m2, o2) = runs
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    o2.close()
    # resumed from the files alone: the params come back bitwise
    model = make_model(seed=5)
    opt = offload_adam.AdamW(model.parameters(), lr=1e-3, bucket_mb=0.05, state_dtype="8bit",
                             state_dirs=str(tmp_path), state_footprint=footprint,
                             step_in_backward=in_backward, state_budget_mb=2,
                             state_resume=True)
    assert opt.step_count == 4
    for p, q in zip(m1.parameters(), model.parameters()):
        assert torch.equal(p, q)
    opt.close()

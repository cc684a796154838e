"""The optimizers the benchmark compares, each as a recipe: which param dtype the model gets, whether the
forward runs under autocast, and how to build the optimizer for the model.

Every recipe returns an object with `step()` and `zero_grad(set_to_none=True)`; the training loop does not
know which one it drives. Optional peers (torchao, DeepSpeed) are imported only when their recipe is built
and are reported as "not installed" when absent; offload_adam's variants that need an option this version
of offload_adam.AdamW lacks are reported as skipped with the option's name, never approximated.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class HParams:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def adam_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    label: str
    param_dtype: torch.dtype
    build: Callable[[nn.Module, HParams], Any]
    autocast: Optional[torch.dtype] = None       # forward under torch.autocast(dtype) when set
    devices: tuple[str, ...] = ("cpu", "cuda")
    why_not_cpu: str = ""                        # the reason shown when skipped on a CPU-only run
    needs_module: str = ""                       # optional peer package: "not installed" when absent
    needs_option: str = ""                       # offload_adam.AdamW keyword this variant needs
    host_bytes_per_param: float = 0.0            # host RAM the optimizer holds per param (sweep bound)
    baseline: bool = False                       # a no-optimizer run (timing baseline, not compared)
    expected_drift: str = ""                     # a known reason its loss curve leaves the reference's
    no_accumulation: str = ""                    # why it cannot accumulate micro-batches, if it cannot
    relative_to: str = ""                        # also compare its loss curve with this contender's

    @property
    def precision(self) -> str:
        """"fp32" when params and compute are fp32, else "bf16": which rounding explains its loss curve."""
        low = self.param_dtype != torch.float32 or self.autocast is not None
        return "bf16" if low else "fp32"

    def unavailable(self, device: torch.device) -> Optional[str]:
        """Why this contender cannot run here, or None."""
        if self.needs_module and importlib.util.find_spec(self.needs_module) is None:
            return f"not installed (pip install {self.needs_module})"
        if device.type not in self.devices:
            return self.why_not_cpu or f"needs {' or '.join(self.devices)}"
        if self.needs_option and self.needs_option not in _offload_adam_options():
            return f"offload_adam.AdamW has no {self.needs_option!r} option in this version"
        if self.name.startswith("offload_adam"):
            try:
                import offload_adam  # noqa: F401
            except Exception as e:  # an ImportError, or a failed build surfacing at import
                return f"offload_adam unavailable: {e}"
        return None


def _offload_adam_options() -> set[str]:
    try:
        from offload_adam import AdamW
    except Exception:
        return set()
    return set(inspect.signature(AdamW.__init__).parameters)


# ---- the recipes ------------------------------------------------------------------------------------


def _torch_adamw(model: nn.Module, hp: HParams):
    # fused=True exists on CUDA and, since torch 2.4, on CPU: the fastest torch has on either.
    return torch.optim.AdamW(model.parameters(), fused=True, **hp.adam_kwargs())


def _offload_adam(**options):
    def build(model: nn.Module, hp: HParams):
        from offload_adam import AdamW
        return AdamW(model.parameters(), **hp.adam_kwargs(), **options)
    return build


def _offload_adam_streamed(model: nn.Module, hp: HParams):
    """Params streamed per block from pinned host memory (stream_params), state in host RAM."""
    from offload_adam import AdamW, stream_params
    from .model import _Block
    stream_params(model, _Block, prefetch=2)
    return AdamW(model.parameters(), **hp.adam_kwargs())


class NoOptimizer:
    """Forward+backward only: the iteration an optimizer's exposed time is measured against."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


class MasterWeights:
    """fp32 master copies of low-precision params, stepped by an fp32 optimizer, the params rewritten from
    the masters after each step.

    With the masters on the params' device this is the exact reference for offload_adam on bf16 params
    (what the engine must compute: AdamW on fp32 masters, params = masters rounded). With the masters in
    pinned host memory and DeepSpeedCPUAdam as the inner optimizer it is ZeRO-Offload's loop: grads copied
    to host fp32 after backward, the CPU step, the params copied back. Nothing overlaps: that is the point
    of comparison."""

    def __init__(self, model: nn.Module, make_inner: Callable[[list], Any], master_device: str) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        pin = master_device == "cpu" and self.params[0].is_cuda
        self.masters = []
        for p in self.params:
            m = torch.empty(p.shape, dtype=torch.float32, device=master_device, pin_memory=pin)
            m.copy_(p.detach())
            m.grad = torch.zeros(p.shape, dtype=torch.float32, device=master_device, pin_memory=pin)
            self.masters.append(m)
        self.inner = make_inner(self.masters)
        self._cuda_to_host = pin

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad.zero_()
            else:
                m.grad.copy_(p.grad, non_blocking=self._cuda_to_host)
        if self._cuda_to_host:
            torch.cuda.current_stream().synchronize()  # the CPU step reads the grads: they must be there
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            # H2D from pinned memory is asynchronous; the masters are next written by the following
            # step(), after its own synchronize, so the copy has finished by then.
            p.copy_(m, non_blocking=self._cuda_to_host)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def host_bytes(self) -> int:
        if not self._cuda_to_host:
            return 0
        state = sum(t.numel() * t.element_size() for s in self.inner.state.values()
                    for t in s.values() if torch.is_tensor(t))
        return state + sum(2 * m.numel() * 4 for m in self.masters)  # + masters and their grads


def _master_weights_torch(model: nn.Module, hp: HParams):
    device = str(next(model.parameters()).device)
    return MasterWeights(model, lambda ms: torch.optim.AdamW(ms, fused=True, **hp.adam_kwargs()), device)


def _deepspeed_zero_offload(model: nn.Module, hp: HParams):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def inner(masters):
        return DeepSpeedCPUAdam(masters, adamw_mode=True, **hp.adam_kwargs())
    return MasterWeights(model, inner, "cpu")


def _torchao_offload(offload_gradients: bool):
    def build(model: nn.Module, hp: HParams):
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError:  # torchao < 0.11 kept it under prototype
            from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
        return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW,
                                   offload_gradients=offload_gradients, fused=True, **hp.adam_kwargs())
    return build


_GPU_ONLY = "offloads to the host from a GPU: nothing to offload on a CPU-only run"

CONTENDERS: dict[str, Contender] = {c.name: c for c in [
    Contender("torch_adamw_fp32", "torch AdamW fused, fp32 params (reference)", torch.float32,
              _torch_adamw),
    Contender("torch_adamw_amp", "torch AdamW fused, fp32 master + bf16 autocast (GPU baseline)",
              torch.float32, _torch_adamw, autocast=torch.bfloat16, devices=("cuda",),
              why_not_cpu="GPU baseline; on CPU the fp32 reference plays its role (bf16 GEMMs are slow there)"),
    Contender("torch_adamw_bf16", "torch AdamW fused, pure bf16 (no master)", torch.bfloat16, _torch_adamw,
              expected_drift="pure bf16 weights drop updates smaller than half a bf16 ulp (no fp32 master)"),
    Contender("torch_master_bf16", "torch AdamW on fp32 master copies of bf16 params (exact twin)",
              torch.bfloat16, _master_weights_torch),
    Contender("offload_adam_fp32", "offload_adam.AdamW, fp32 params stepped in place", torch.float32,
              _offload_adam(), devices=("cpu",),
              why_not_cpu="CPU variant: fp32 CPU params"),
    Contender("offload_adam", "offload_adam.AdamW, bf16 params, defaults", torch.bfloat16,
              _offload_adam(), host_bytes_per_param=16),
    Contender("offload_adam_bf16_state", "offload_adam.AdamW, bf16, bf16 moments (state_dtype)",
              torch.bfloat16, _offload_adam(state_dtype=torch.bfloat16), needs_option="state_dtype",
              host_bytes_per_param=12, relative_to="offload_adam"),
    Contender("offload_adam_8bit_state", "offload_adam.AdamW, bf16, 8-bit moments (state_dtype)",
              torch.bfloat16, _offload_adam(state_dtype="8bit"), needs_option="state_dtype",
              host_bytes_per_param=10.1, relative_to="offload_adam"),
    Contender("offload_adam_no_overlap", "offload_adam.AdamW, bf16, overlap=False", torch.bfloat16,
              _offload_adam(overlap=False), needs_option="overlap", host_bytes_per_param=16),
    Contender("offload_adam_free_grads", "offload_adam.AdamW, bf16, grads freed once on the host",
              torch.bfloat16, _offload_adam(free_grads_after_copy=True), devices=("cuda",),
              why_not_cpu="saves GPU memory only", needs_option="free_grads_after_copy",
              host_bytes_per_param=16,
              no_accumulation="free_grads_after_copy drops each grad once copied: nothing to accumulate into"),
    Contender("offload_adam_streamed", "offload_adam.AdamW, bf16, blocks' params streamed from the host",
              torch.bfloat16, _offload_adam_streamed, devices=("cuda",),
              why_not_cpu="streams params to a GPU: nothing to stream on a CPU-only run",
              host_bytes_per_param=18),
    Contender("torchao_offload", "torchao CPUOffloadOptimizer(AdamW), bf16", torch.bfloat16,
              _torchao_offload(False), devices=("cuda",), why_not_cpu=_GPU_ONLY, needs_module="torchao",
              host_bytes_per_param=8),
    Contender("torchao_offload_grads", "torchao CPUOffloadOptimizer(AdamW), bf16, offload_gradients",
              torch.bfloat16, _torchao_offload(True), devices=("cuda",), why_not_cpu=_GPU_ONLY,
              needs_module="torchao", host_bytes_per_param=8,
              no_accumulation="torchao documents offload_gradients as incompatible with grad accumulation"),
    Contender("deepspeed_cpu_adam", "DeepSpeedCPUAdam, ZeRO-Offload loop, bf16", torch.bfloat16,
              _deepspeed_zero_offload, devices=("cuda",), why_not_cpu=_GPU_ONLY, needs_module="deepspeed",
              host_bytes_per_param=16),
]}

REFERENCE = "torch_adamw_fp32"   # the loss curve every other contender is compared with
TWIN = "torch_master_bf16"       # what rounding the weights to bf16 alone does to that curve

DEFAULTS = {
    "cpu": ["torch_adamw_fp32", "offload_adam_fp32", "torch_adamw_bf16", "torch_master_bf16",
            "offload_adam", "offload_adam_bf16_state", "offload_adam_8bit_state",
            "offload_adam_no_overlap", "torchao_offload", "deepspeed_cpu_adam"],
    "cuda": ["torch_adamw_fp32", "torch_adamw_amp", "torch_adamw_bf16", "torch_master_bf16", "offload_adam",
             "offload_adam_bf16_state", "offload_adam_8bit_state",
             "offload_adam_no_overlap", "offload_adam_free_grads", "offload_adam_streamed", "torchao_offload",
             "torchao_offload_grads", "deepspeed_cpu_adam"],
}

# The size sweep: the GPU baseline, pure bf16 and the offloading optimizers.
SWEEP = ["torch_adamw_amp", "torch_adamw_bf16", "offload_adam", "offload_adam_free_grads", "offload_adam_streamed",
         "torchao_offload_grads", "deepspeed_cpu_adam"]


def drifts() -> dict[str, str]:
    return {c.name: c.expected_drift for c in CONTENDERS.values() if c.expected_drift}


def relatives() -> dict[str, str]:
    """Contender -> the contender its loss curve is also compared with."""
    return {c.name: c.relative_to for c in CONTENDERS.values() if c.relative_to}


def no_optimizer(param_dtype: torch.dtype, autocast: Optional[torch.dtype]) -> Contender:
    """The timing baseline for contenders with this param dtype and autocast."""
    tag = str(param_dtype).replace("torch.", "") + ("+autocast" if autocast else "")
    return Contender(f"no_optimizer[{tag}]", f"forward+backward only ({tag})", param_dtype,
                     lambda model, hp: NoOptimizer(model), autocast=autocast, baseline=True)


def resolve(names: list[str]) -> list[Contender]:
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {sorted(CONTENDERS)}")
    return [CONTENDERS[n] for n in names]


def host_bytes(opt) -> Optional[int]:
    """Host memory the optimizer holds for offloading: its own count when it keeps one, else None."""
    fn = getattr(opt, "host_bytes", None)
    if callable(fn):
        try:
            return int(fn())
        except Exception:
            return None
    return None


def state_bytes(opt) -> int:
    """Bytes of tensors in the optimizer's state, wherever they live."""
    state = getattr(opt, "state", None)
    if state is None:
        state = getattr(getattr(opt, "inner", None), "state", {})
    total = 0
    for s in state.values():
        if isinstance(s, dict):
            total += sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t))
    return total

"""offload_adam: Adam/AdamW with fused C++ CPU kernels.

Importing the package compiles nothing; the kernels are built (or the prebuilt
extension is loaded) on the first optimizer step or the first call below.
"""
from .optimizer import Adam, AdamW
from .param_stream import ParamStreamer, stream_params

__all__ = ["Adam", "AdamW", "ParamStreamer", "kernel_isa", "stream_params", "supported_isas"]


def kernel_isa() -> str:
    """The active kernel variant: "avx512", "avx2", "neon" or "scalar"."""
    from ._build import load_kernels

    return load_kernels().isa()


def supported_isas() -> list[str]:
    """The kernel variants this CPU can run, best first."""
    from ._build import load_kernels

    return list(load_kernels().supported_isas())

"""The machine a benchmark ran on, described once for every benchmark of the project.

The end-to-end benchmark (python -m bench.e2e) writes `machine_info()` into its JSON, and
the microbenchmarks in bench/ (step, transfer, early start) print `one_line()` of it and store it the
same way, so numbers from any of them say where they come from in the same words: CPU model, cores
usable, memory, ISA flags, the kernel variant, torch, the GPU, and how busy the machine was.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
from typing import Optional

import torch

_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "asimd", "sve")


def load_average() -> list | None:
    """The 1, 5 and 15 minute load averages (other work on the machine skews timings: the
    benchmarks keep this as evidence), or None where the OS has none."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(query_kernels: bool = True) -> dict:
    """The machine and software the numbers come from. `query_kernels` asks offload_adam for its ISA,
    which loads the kernels (compiling them on a cold cache): skipped when no run uses them."""
    model, flags = _cpuinfo()
    info = {
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": model,
        "cpu_cores": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_flags": {f: f in flags for f in _FLAGS},
        "torch_threads": torch.get_num_threads(),
        "host_ram_bytes": _meminfo("MemTotal"),
        "host_ram_available_bytes": _meminfo("MemAvailable"),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "gpu_memory_bytes": None,
        "offload_adam_isa": None,
        "offload_adam_supported_isas": None,
        "load_average": load_average(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
    if not query_kernels:
        info["offload_adam_isa"] = "not loaded (no offload_adam optimizer in this run)"
        return info
    try:
        import offload_adam
        info["offload_adam_isa"] = offload_adam.kernel_isa()
        info["offload_adam_supported_isas"] = offload_adam.supported_isas()
    except Exception as e:  # not built / not importable: say so rather than guess
        info["offload_adam_isa"] = f"unavailable: {type(e).__name__}: {e}"
    return info


def one_line(info: dict) -> str:
    """The machine in one line, for the head of a benchmark's table."""
    ram = info["host_ram_bytes"]
    isas = info["offload_adam_supported_isas"]
    parts = [f"{info['cpu_model']}, {info['cpus_usable'] or info['cpu_cores']} CPUs usable "
             f"({info['cpu_cores']} logical), {info['torch_threads']} torch threads",
             f"{ram / 2**30:.1f} GiB" if ram else "memory unknown",
             f"ISA {info['offload_adam_isa']}" + (f" of {isas}" if isas else ""),
             f"torch {info['torch']}"]
    if info["gpu"]:
        parts.append(f"{info['gpu']} (CUDA {info['cuda']})")
    parts.append(f"{info['date']}, load average {info['load_average']}")
    return "; ".join(parts)


def _cpuinfo():
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def _meminfo(key: str) -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None

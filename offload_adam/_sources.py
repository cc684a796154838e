"""The C++ sources of offload_adam and the compiler flags of each: the one table.

Both builds read it: the JIT loader (offload_adam/_build.py) and the ahead-of-time
build (setup.py, which executes this file by path before torch or the package can
be imported). So it imports nothing beyond the standard library.

Why per-file flags: every ISA variant lives in its own translation unit compiled
with exactly the instructions it may use, and the dispatcher picks one at run time
from what the CPU reports. Nothing is compiled with -march=native, so a build made
on one machine runs correctly on any other x86-64 machine.
"""

from __future__ import annotations

import platform
from pathlib import Path

# Flags of every kernel file. -ffp-contract=off keeps the compiler from fusing
# a*b+c on its own, so the scalar path (the reference) rounds exactly as written;
# the vector paths fuse only where their source says so. -fno-math-errno lets
# sqrt become one instruction.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-pthread"]

# Kernel translation units and the extra instruction-set flags of each. On
# non-x86 machines the ISA flags are dropped; the ISA files then compile to
# nothing (their code sits behind #if guards) and only the scalar path remains.
KERNEL_SOURCES: dict[str, list[str]] = {
    "isa_scalar.cpp": [],
    "isa_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "isa_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "adam_driver.cpp": [],
    "isa_dispatch.cpp": [],
    "thread_pool.cpp": [],
}

# The torch binding: compiled by torch.utils.cpp_extension with torch's own flags.
BINDING_SOURCE = "binding.cpp"

# Extra flags for the binding file (torch adds its include paths and -std itself).
BINDING_FLAGS = ["-O3"]

# File patterns shipped in the wheel (as offload_adam/csrc) and hashed for the JIT cache.
SHIPPED_PATTERNS = ["*.cpp", "*.h"]

_X86_MACHINES = {"x86_64", "amd64", "i386", "i686", "x86"}


def is_x86(machine: str | None = None) -> bool:
    """True on x86 machines, where the AVX2/AVX-512 translation units are built."""
    return (machine or platform.machine()).lower() in _X86_MACHINES


def kernel_flags(source: str, machine: str | None = None) -> list[str]:
    """The full compiler flags of one kernel file (a key of KERNEL_SOURCES)."""
    isa = KERNEL_SOURCES[source] if is_x86(machine) else []
    return COMMON_FLAGS + isa


def find_csrc(package_dir: str | Path) -> Path:
    """The folder holding the C++ sources.

    An installed wheel carries them inside the package (offload_adam/csrc); a
    source checkout or an editable install keeps them beside it (../csrc).
    """
    package_dir = Path(package_dir).resolve()
    for candidate in (package_dir / "csrc", package_dir.parent / "csrc"):
        if (candidate / BINDING_SOURCE).is_file():
            return candidate
    raise RuntimeError(
        f"offload_adam: C++ sources not found: neither {package_dir / 'csrc'} nor "
        f"{package_dir.parent / 'csrc'} contains {BINDING_SOURCE}; reinstall the package"
    )


def hashed_files(csrc: str | Path) -> list[Path]:
    """Every file whose content decides the compiled module, in a stable order."""
    csrc = Path(csrc)
    files = {csrc / name for name in KERNEL_SOURCES} | {csrc / BINDING_SOURCE}
    files |= set(csrc.glob("*.h"))
    return sorted(files)

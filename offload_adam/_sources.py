"""The C++ sources of offload_adam and the compiler flags of each.

The kernel files and their flags are not listed here: they come from the one
table csrc/kernel_sources.txt, which CMakeLists.txt reads too, so the three
builds (the JIT loader offload_adam/_build.py, the ahead-of-time build in
setup.py, and CMake) cannot drift apart. setup.py executes this file by path
before torch or the package can be imported, so it imports nothing beyond the
standard library.

Why per-file flags: every ISA variant lives in its own translation unit compiled
with exactly the instructions it may use, and the dispatcher picks one at run time
from what the CPU reports. Nothing is compiled with -march=native, so a build made
on one machine runs correctly on any other machine of its architecture.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

# The table of kernel files and flags, in the csrc folder (see its header).
TABLE_FILE = "kernel_sources.txt"

# What CMake adds by itself (CMAKE_CXX_STANDARD, POSITION_INDEPENDENT_CODE,
# Threads) and the Python builds must say: added to every kernel file's flags.
BUILD_FLAGS = ["-std=c++17", "-fPIC", "-pthread"]

# The torch binding: compiled by torch.utils.cpp_extension with torch's own flags.
BINDING_SOURCE = "binding.cpp"

# Extra flags for the binding file (torch adds its include paths and -std itself).
BINDING_FLAGS = ["-O3"]

# File patterns shipped in the wheel (as offload_adam/csrc) and hashed for the JIT cache.
SHIPPED_PATTERNS = ["*.cpp", "*.h", TABLE_FILE]

# The table's machine names and what platform.machine() calls them.
_MACHINE_ALIASES = {
    "x86_64": {"x86_64", "amd64", "i386", "i686", "x86"},
    "aarch64": {"aarch64", "arm64"},
}


def machine_name(machine: str | None = None) -> str:
    """The table's name for `machine` (default: this one): x86_64, aarch64, or itself lowercased."""
    machine = (machine or platform.machine()).lower()
    return next((name for name, aliases in _MACHINE_ALIASES.items() if machine in aliases), machine)


class KernelTable:
    """csrc/kernel_sources.txt, parsed: the kernel files in order and the flags of each."""

    def __init__(self, text: str, origin: str = TABLE_FILE):
        self._common: list[tuple[str, list[str]]] = []      # (machine, flags) of the * rows
        self._rows: dict[str, tuple[str, list[str]]] = {}   # file -> (machine, flags)
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) < 2:
                raise ValueError(f"{origin}:{number}: expected 'file machine [flags...]', got {line!r}")
            name, machine, flags = fields[0], fields[1], fields[2:]
            if name == "*":
                self._common.append((machine, flags))
            elif name in self._rows:
                raise ValueError(f"{origin}:{number}: {name} is listed twice")
            else:
                self._rows[name] = (machine, flags)

    @classmethod
    def read(cls, csrc: str | Path) -> "KernelTable":
        path = Path(csrc) / TABLE_FILE
        return cls(path.read_text(), str(path))

    @property
    def sources(self) -> list[str]:
        """The kernel files, in the table's order."""
        return list(self._rows)

    def flags(self, source: str, machine: str | None = None) -> list[str]:
        """The full compiler flags of one kernel file when building for `machine` (default: this one)."""
        target = machine_name(machine)
        row_machine, row_flags = self._rows[source]
        common = [f for m, flags in self._common if m in ("any", target) for f in flags]
        return common + BUILD_FLAGS + (row_flags if row_machine in ("any", target) else [])


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


def hashed_files(csrc: str | Path, table: KernelTable | None = None) -> list[Path]:
    """Every file whose content decides the compiled module, in a stable order
    (`table`: csrc's kernel table, when the caller has read it already)."""
    csrc = Path(csrc)
    files = {csrc / name for name in (table or KernelTable.read(csrc)).sources}
    files |= {csrc / BINDING_SOURCE, csrc / TABLE_FILE}
    files |= set(csrc.glob("*.h"))
    return sorted(files)


# Beside an ahead-of-time build (offload_adam/_C...so): the digest of the sources it
# was built from, so that a checkout whose sources changed since is not served a
# stale binary (_build._import_ahead_of_time).
AOT_DIGEST_FILE = "_C.sources"


def hash_sources(h, csrc: str | Path, table: KernelTable | None = None) -> None:
    """Feeds hash `h` the name and contents of every file hashed_files names."""
    for path in hashed_files(csrc, table):
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"<missing>")
        h.update(b"\0")


def sources_digest(csrc: str | Path) -> str:
    """A digest of the contents of every file hashed_files names."""
    h = hashlib.sha256()
    hash_sources(h, csrc)
    return h.hexdigest()

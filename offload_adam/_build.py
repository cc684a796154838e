"""Finds or builds the compiled kernels: load_kernels() returns the module.

Order: an ahead-of-time build (offload_adam._C, made by `OFFLOAD_ADAM_BUILD_EXT=1
pip install --no-build-isolation .`) if it imports; otherwise a JIT build on
first use, cached on disk.

The JIT build has two steps. The kernel files are compiled to object files by a
small build.ninja written here, because each ISA file needs its own flags and
torch.utils.cpp_extension.load() gives every source the same flags. Then load()
compiles the one binding file and links it with those objects. Both land in one
folder named after a hash of every source, header and flag, the sources'
location, and what the binary is built against: the compiler (path and
version), torch (version, build, C++ ABI and install location: the build files
name its headers and libraries by path) and Python (version, ABI, headers). So
any change builds into a fresh folder and nothing stale is ever linked or
imported, and two environments with the same torch version (two venvs) keep a
build each instead of rebuilding on every switch. A finished build is stamped and
then imported directly (its name already says what it was built from; ninja would
go by file times). Whenever ninja has anything to compile or link, one line on
stderr says so first.

Failures surface here, from load_kernels(), as RuntimeError with what to do,
never later as a missing attribute.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

from . import _sources

_lock = threading.Lock()
_module: ModuleType | None = None


def _unlock_in_child() -> None:
    """A child forked while another thread of its parent loaded the kernels inherits the
    lock held by a thread it does not have: its first step waited for good (found from
    outside). It loads them itself, under a lock of its own."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unlock_in_child)

# Shown in the one line printed when a compile actually happens (2 cores: ~1 min).
_EXPECTED_COMPILE_CPU_SECONDS = 120


def load_kernels() -> ModuleType:
    """The compiled kernel module (see csrc/binding.cpp), built on first use.

    Thread-safe; the first successful call is cached for the process. The
    environment variable OFFLOAD_ADAM_ISA (avx512|avx2|neon|scalar|auto) selects the
    kernel variant; a bad value raises ValueError or RuntimeError here.
    """
    global _module
    with _lock:
        if _module is None:
            module = _import_ahead_of_time() or _jit_build()
            # Applied here rather than at import, so a bad value raises
            # ValueError/RuntimeError naming it, not ImportError.
            isa = os.environ.get("OFFLOAD_ADAM_ISA", "").strip().lower()
            if isa:
                try:
                    module.set_isa(isa)
                except RuntimeError as e:   # (a variant this CPU or build lacks)
                    raise RuntimeError(f"{e} (asked for by OFFLOAD_ADAM_ISA={isa!r})") from None
            _module = module
        return _module


def _import_ahead_of_time() -> ModuleType | None:
    import torch  # noqa: F401  (loads libtorch before the extension needs its symbols)

    if _stale_ahead_of_time():
        return None
    try:
        return importlib.import_module("offload_adam._C")
    except ModuleNotFoundError as e:
        if e.name != "offload_adam._C":
            raise
        return None
    except ImportError as e:
        # Typically an AOT build made against another torch (undefined symbols).
        from .warn import warn
        warn(f"offload_adam: the prebuilt extension offload_adam._C does not load ({e}); "
             "building the kernels just in time instead", RuntimeWarning)
        return None


def _stale_ahead_of_time() -> bool:
    """Whether an ahead-of-time build is there but was built from other sources than
    the ones beside the package now (an editable install whose C++ was edited since):
    then it is not used, with a warning, and the kernels are built just in time. A
    build without its digest (made before it was written) is used as it is."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("offload_adam._C")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin:
        return False
    digest = Path(spec.origin).with_name(_sources.AOT_DIGEST_FILE)
    try:
        built_from = digest.read_text().strip()
        csrc = _sources.find_csrc(Path(__file__).parent)
    except (OSError, RuntimeError):
        return False
    if built_from == _sources.sources_digest(csrc):
        return False
    from .warn import warn
    warn(f"offload_adam: the prebuilt extension {spec.origin} was built from other C++ sources "
         f"than those in {csrc} now (edited since?); building the kernels just in time "
         "instead (build it again with OFFLOAD_ADAM_BUILD_EXT=1 pip install "
         "--no-build-isolation -e ., or delete it)", RuntimeWarning)
    return True


def _jit_build() -> ModuleType:
    import torch
    from torch.utils import cpp_extension

    csrc = _sources.find_csrc(Path(__file__).parent)
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    table = _sources.KernelTable.read(csrc)
    # What a finished build's stamp says (`key`): the folder's hash without the
    # compiler, so that a machine without one (a compute node sharing the cache of a
    # login node) loads the build made where there was one.
    folder, key = _build_hashes(csrc, table, cxx, _built_against(cxx))
    name = f"offload_adam_C_{folder}"
    # Absolute: torch links in the build folder, so a relative root ("ext", or "~/ext"
    # quoted) named objects that were not there, and every run failed to link.
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    root = root.expanduser().absolute()
    build_dir = root / name
    # A finished build of these very inputs (all in its name, the sources' contents
    # included) is imported as it is: asking ninja would compare file times, and a
    # reinstall that rewrote the same sources would rebuild for a minute.
    finished = _finished(build_dir, name, key)
    if finished is None and (not cxx or shutil.which(cxx[0]) is None):
        finished = next(filter(None, (_finished(d, d.name, key)
                                      for d in sorted(root.glob("offload_adam_C_*")))), None)
    if finished is not None:
        return _import_built(finished)
    _require_compiler(cxx)
    ninja = _find_ninja()
    obj_dir = build_dir / "kernels"
    # One process builds, the others wait and then find everything cached.
    with _FileLock(build_dir / "offload_adam.lock", obj_dir):
        # torch's own build lock is a plain file that a build killed midway (Ctrl-C
        # during the first compile) leaves behind, and torch then waits on it
        # forever. Holding our lock, which dies with its process, no other build
        # of this folder is running: any such file is stale.
        (build_dir / "lock").unlink(missing_ok=True)
        (build_dir / _STAMP).unlink(missing_ok=True)   # written again once built
        objects = [obj_dir / (Path(src).stem + ".o") for src in table.sources]
        _write_kernel_build_file(cxx, csrc, table, obj_dir)
        built = any(build_dir.glob(name + ".*"))
        if not (built and _up_to_date(ninja, obj_dir) and _up_to_date(ninja, build_dir)):
            seconds = max(10, _EXPECTED_COMPILE_CPU_SECONDS // max(1, os.cpu_count() or 1))
            what = "first use" if not built else "out of date"
            print(f"offload_adam: compiling CPU kernels ({what}, ~{seconds} s) into {build_dir}",
                  file=sys.stderr, flush=True)
        _compile_kernel_objects(ninja, obj_dir)
        # A failed compile raises RuntimeError from torch, carrying the compiler output.
        module = cpp_extension.load(
            name=name,
            sources=[str(csrc / _sources.BINDING_SOURCE)],
            extra_cflags=_sources.BINDING_FLAGS,
            # relative to the build folder, where torch's ninja links: torch writes these
            # flags as they are, and a folder with a space split each into two
            extra_ldflags=[str(o.relative_to(build_dir)) for o in objects] + ["-pthread"],
            extra_include_paths=[str(csrc)],
            build_directory=str(build_dir),
            verbose=False,
        )
        stamp = build_dir / (_STAMP + ".tmp")
        stamp.write_text(key)
        stamp.replace(build_dir / _STAMP)   # (atomic: a reader sees all of it or none)
        return module


_STAMP = "offload_adam.finished"   # in a build folder: its module is built; holds `key`


def _finished(build_dir: Path, name: str, key: str) -> Path | None:
    """The module of a finished build in `build_dir` (named `name`) whose stamp says
    `key`, or None."""
    try:
        if (build_dir / _STAMP).read_text() != key:
            return None
    except OSError:
        return None
    module = build_dir / f"{name}.so"
    return module if module.is_file() else None


def _import_built(path: Path) -> ModuleType:
    """Imports the extension module at `path` (named as its file: its init function's
    name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built_against(cxx: list[str]) -> dict:
    """What the compiled binary depends on besides our sources and flags."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    return {
        "compiler": [shutil.which(cxx[0]) if cxx else None, _compiler_version(cxx)],
        "torch": [torch.__version__, getattr(torch.version, "git_version", None),
                  bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
                  cpp_extension.include_paths(), cpp_extension.library_paths()],
        "python": [list(sys.version_info[:2]), getattr(sys, "abiflags", ""),
                   sysconfig.get_paths().get("include")],
    }


def _compiler_version(cxx: list[str]) -> str:
    """The first line of `$CXX --version` ("" when it cannot run: the build
    then raises its own clear error)."""
    try:
        out = subprocess.run(cxx + ["--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return _text(out).splitlines()[0] if out else ""


def _build_hashes(csrc: Path, table: _sources.KernelTable, cxx: list[str],
                  built_against: dict) -> tuple[str, str]:
    """The build folder's hash, and the same without the compiler (a finished build's
    stamp), from one read of the sources."""
    h = hashlib.sha256()
    # The location is part of the key too: the build files name the sources by
    # path, and a cache shared by two checkouts would rebuild silently on each switch.
    h.update(str(csrc).encode() + b"\0")
    _sources.hash_sources(h, csrc, table)
    flags = {src: table.flags(src) for src in table.sources}
    hashes = []
    for against in (built_against, {k: v for k, v in built_against.items() if k != "compiler"}):
        each = h.copy()
        each.update(repr((flags, _sources.BINDING_FLAGS, cxx, sorted(against.items()))).encode())
        hashes.append(each.hexdigest()[:8])
    return hashes[0], hashes[1]


def _find_ninja() -> str:
    """The ninja binary, also made visible on PATH (torch runs plain `ninja`)."""
    found = shutil.which("ninja")
    if found:
        return found
    try:  # the pip package keeps its binary in the venv's bin/, not on PATH unless activated
        import ninja as ninja_pkg

        candidate = Path(ninja_pkg.BIN_DIR) / "ninja"
        if candidate.is_file():
            os.environ["PATH"] = str(candidate.parent) + os.pathsep + os.environ.get("PATH", "")
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    raise RuntimeError(
        "offload_adam: the ninja build tool is needed to compile the CPU kernels on first use "
        "and was not found. Install it with `pip install ninja` (or your system's package, e.g. "
        "`apt-get install ninja-build`), or install a prebuilt extension with "
        "`OFFLOAD_ADAM_BUILD_EXT=1 pip install --no-build-isolation .`"
    )


def _require_compiler(cxx: list[str]) -> None:
    if not cxx or shutil.which(cxx[0]) is None:
        raise RuntimeError(
            f"offload_adam: the C++ compiler {' '.join(cxx) or '(empty $CXX)'!r} was not found; it "
            "is needed to compile the CPU kernels on first use. Install one (e.g. "
            "`apt-get install g++`) or point the CXX environment variable at it."
        )


def _up_to_date(ninja: str, folder: Path) -> bool:
    """Whether ninja has nothing to do in `folder` (a dry run; False when the
    folder has no build file yet). torch rewrites the binding's build file with
    the same content, since everything it holds is in the folder's name."""
    if not (folder / "build.ninja").is_file():
        return False
    result = subprocess.run([ninja, "-C", str(folder), "-n"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    return result.returncode == 0 and b"no work to do" in result.stdout


def _write_kernel_build_file(cxx: list[str], csrc: Path, table: _sources.KernelTable,
                             obj_dir: Path) -> None:
    """obj_dir/build.ninja: one object per kernel file, with its own flags."""
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {' '.join(shlex.quote(c) for c in cxx)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = CXX $out",
    ]
    include = "-I" + shlex.quote(str(csrc))
    for src in table.sources:
        obj = Path(src).stem + ".o"
        lines.append(f"build {obj}: cxx {_ninja_path(csrc / src)}")
        flags = " ".join(shlex.quote(f) for f in table.flags(src))
        lines.append(f"  flags = {include} {flags}".replace("$", "$$"))
    text = "\n".join(lines) + "\n"
    build_file = obj_dir / "build.ninja"
    if not build_file.is_file() or build_file.read_text() != text:
        build_file.write_text(text)


def _compile_kernel_objects(ninja: str, obj_dir: Path) -> None:
    """Runs obj_dir/build.ninja."""
    command = [ninja, "-C", str(obj_dir)]
    jobs = os.environ.get("MAX_JOBS", "")
    if jobs.isdigit():
        command += ["-j", jobs]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"offload_adam: compiling the CPU kernels failed "
                           f"(build folder {obj_dir}):\n{_text(result.stdout)}")


def _ninja_path(path: Path) -> str:
    """A path escaped for a ninja build line ($, space and colon are special there)."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _text(output: bytes) -> str:
    return output.decode(errors="replace")


class _FileLock:
    """An exclusive lock on a file, held across processes (no-op where fcntl is missing).
    Its folder and `make` are created first: a folder that cannot be written is a
    RuntimeError naming it (a read-only cache fails at the lock's open). A wait on
    another process's build says so on stderr: a first compile takes a minute, and a
    second process would otherwise sit silent for it."""

    def __init__(self, path: Path, make: Path):
        self._path, self._make = path, make
        self._file = None

    def __enter__(self):
        try:
            self._make.mkdir(parents=True, exist_ok=True)
            self._file = open(self._path, "a+")
        except OSError as e:
            raise RuntimeError(
                f"offload_adam: cannot write the kernels' build folder {self._path.parent} "
                f"({e.strerror or e}): they compile there on first use. Set "
                "TORCH_EXTENSIONS_DIR to a writable folder, or build them ahead of time "
                "(OFFLOAD_ADAM_BUILD_EXT=1 pip install --no-build-isolation .)") from e
        try:
            import fcntl
        except ImportError:  # Windows: concurrent first builds are left to torch's own lock
            return self
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"offload_adam: waiting for another process's build of the kernels in "
                  f"{self._path.parent}", file=sys.stderr, flush=True)
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self._file.close()  # closing releases the lock
        return False


__all__ = ["load_kernels"]

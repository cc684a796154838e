"""Packaging for offload_adam (metadata lives in pyproject.toml).

Default: `pip install .` (or `pip install -e .`) installs pure Python plus the C++
sources (as offload_adam/csrc); no compiler and no torch are needed to install,
and the kernels are compiled on first use by offload_adam/_build.py.

Opt-in ahead-of-time build: `OFFLOAD_ADAM_BUILD_EXT=1 pip install --no-build-isolation .`
compiles offload_adam._C now. It needs the torch you will run with at build time,
hence --no-build-isolation (pip would otherwise build against a fresh torch
downloaded into a throwaway environment).
"""

import os
import runpy
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
# The reader of csrc/kernel_sources.txt (the kernel files and their flags, shared
# with the JIT loader and CMake); run by path because importing the package would
# import torch.
SOURCES = runpy.run_path(str(ROOT / "offload_adam" / "_sources.py"))
CSRC = "csrc"


def aot_extension():
    """ext_modules and cmdclass for the ahead-of-time build of offload_adam._C."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as e:
        raise RuntimeError(
            "OFFLOAD_ADAM_BUILD_EXT=1 builds the kernels against the installed torch, which "
            f"this build environment cannot import ({e}). Install torch first, then run "
            "`OFFLOAD_ADAM_BUILD_EXT=1 pip install --no-build-isolation .`"
        ) from None

    class BuildWithKernelObjects(BuildExtension):
        """Compiles each kernel file with its own flags, then links them into the binding.

        BuildExtension gives every source of an extension the same flags, but each
        ISA file needs its own; so the kernel files become extra_objects here.
        """

        def build_extensions(self):
            objects = self._compile_kernels(Path(self.build_temp) / "offload_adam_kernels")
            for ext in self.extensions:
                ext.extra_objects = [str(o) for o in objects]
            super().build_extensions()

        def run(self):
            super().run()
            # What the binary was built from, beside it (where it was put, in the
            # source tree too for an in-place or editable build): the loader does not
            # use it for sources that changed since (an editable install's edits).
            for ext in self.extensions:
                built = Path(self.get_ext_fullpath(ext.name))
                (built.parent / SOURCES["AOT_DIGEST_FILE"]).write_text(
                    SOURCES["sources_digest"](ROOT / CSRC))

        def _compile_kernels(self, out_dir):
            out_dir.mkdir(parents=True, exist_ok=True)
            cxx = shlex.split(os.environ.get("CXX", "c++"))
            jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
            table = SOURCES["KernelTable"].read(ROOT / CSRC)

            def compile_one(src):
                obj = out_dir / (Path(src).stem + ".o")
                cmd = cxx + table.flags(src) + [
                    "-I" + str(ROOT / CSRC), "-c", str(ROOT / CSRC / src), "-o", str(obj)]
                print(" ".join(shlex.quote(c) for c in cmd), flush=True)
                result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                if result.returncode != 0:
                    raise RuntimeError(f"compiling {src} failed:\n"
                                       f"{result.stdout.decode(errors='replace')}")
                return obj

            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                return list(pool.map(compile_one, table.sources))

    ext = CppExtension(
        name="offload_adam._C",
        sources=[f"{CSRC}/{SOURCES['BINDING_SOURCE']}"],
        include_dirs=[str(ROOT / CSRC)],
        extra_compile_args=list(SOURCES["BINDING_FLAGS"]),
        extra_link_args=["-pthread"],
    )
    return [ext], {"build_ext": BuildWithKernelObjects}


if os.environ.get("OFFLOAD_ADAM_BUILD_EXT", "0") not in ("", "0"):
    ext_modules, cmdclass = aot_extension()
else:
    ext_modules, cmdclass = [], {}

setup(
    # The C++ sources ship inside the package as offload_adam/csrc, so an
    # installed wheel can compile them on first use.
    packages=find_packages(include=["offload_adam", "offload_adam.*"]) + ["offload_adam.csrc"],
    package_dir={"offload_adam.csrc": CSRC},
    package_data={"offload_adam.csrc": SOURCES["SHIPPED_PATTERNS"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

#!/usr/bin/env python3
"""Where the step's arithmetic goes: kernel_cost (kernel_cost.cpp: one thread, buffers in L2, every
moment format and ISA) of copies of the tree with one piece of the kernels removed or replaced,
alternating with the unmodified tree. The copies are not correct builds (most compute wrong values):
they are timed only, and each variant's cost is its difference to "base" in the same round.

    python bench/kernel_ablation.py [--rounds 2] [--only REGEX] > results/kernel_cost_<tag>.log

Each variant is a list of exact text replacements in csrc/; one that no longer applies (the code
changed) stops the run and names itself. Builds go to a temporary folder (CMake + ninja, Release);
the runs are pinned to CPU 0 when taskset exists. Take the bench lock around it on a shared machine
(flock /tmp/offload_bench.lock ...): kernel_cost is short but any other work on its core shows.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MATH, AVX512, AVX2 = "csrc/adam_math.h", "csrc/simd_avx512.h", "csrc/simd_avx2.h"
# name -> [(file, text, replacement)]
VARIANTS = {
    "base": [],
    # ---- the part every format shares (the fp32-moment step's own work)
    "lp copy truncated (its round to nearest even and NaN blend removed)": [
        (MATH, "if constexpr (LP == 1) x.template store_bf16<NT>(",
         "if constexpr (LP == 1) x.template store_bf16_truncated<NT>(")],
    "no grad_scale multiply": [
        (MATH, "  return g * V::set1(s.grad_scale);\n}", "  return g;\n}")],
    "sqrt and division replaced by multiplies": [
        (AVX512, "return {_mm512_div_ps(a.v, b.v)};", "return {_mm512_mul_ps(a.v, b.v)};"),
        (AVX512, "return {_mm512_sqrt_ps(a.v)};", "return {_mm512_mul_ps(a.v, a.v)};"),
        (AVX2, "return {_mm256_div_ps(a.v, b.v)};", "return {_mm256_mul_ps(a.v, b.v)};"),
        (AVX2, "return {_mm256_sqrt_ps(a.v)};", "return {_mm256_mul_ps(a.v, a.v)};")],
    # ---- the 8-bit codes
    "q8: no decode (moments read as a constant)": [
        (MATH, "{ return V::template load_q8<true>(s.m + i); }", "{ return V::set1(0.5f); }"),
        (MATH, "{ return V::template load_q8<false>(s.v + i); }", "{ return V::set1(0.25f); }")],
    "q8: m's codes not written (its scale only)": [
        (MATH, "encode_block<V, true, true>(s.m_new, n, st.m.v, s.m + b0, s.m_scale + block, dm);",
         "s.m_scale[block] = q8_block<true>(st.m.v).scale;")],
    "q8: m rounded to nearest (as until 2026-12-03)": [
        (MATH, "encode_block<V, true, true>(s.m_new, n, st.m.v, s.m + b0, s.m_scale + block, dm);",
         "encode_block<V, true, false>(s.m_new, n, st.m.v, s.m + b0, s.m_scale + block, Dither{});")],
    "bf16: m rounded to nearest even (as until 2026-12-03)": [
        (MATH, "m.store_bf16_random(s.m + i, V::mix_bits(rounding_bits<V, true>(s.m_dither, i)));",
         "m.store_bf16(s.m + i);")],
    "q8: v's codes not written (its scale only)": [
        (MATH, "encode_block<V, false, true>(s.v_new, n, st.v.v, s.v + b0, s.v_scale + block, d);",
         "s.v_scale[block] = q8_block<false>(st.v.v).scale;")],
    "q8: m's and v's rounding bits not mixed (the lattice bits as they are)": [
        (MATH, "if constexpr (DITHER) return V::mix_bits(lattice);", "if constexpr (DITHER) return lattice;"),
        (AVX512, "(DITHER ? mix_bits(random) : random)", "random"),
        (AVX2, "DITHER ? mix_bits(random) : random", "random")],
    "q8: new m, v not stored to the block's scratch (codes from a stale one)": [
        (MATH, "  m.store(s.m_new + (i - s.base));\n  v.store(s.v_new + (i - s.base));\n", "")],
    # ---- a replacement tried (bit-exact, kept only if it pays from DRAM too)
    "AVX-512: store_bf16 by vcvtneps2bf16 where vfpclassps finds no NaN or denormal lane": [
        (AVX512, "  OA_INLINE void store_bf16(uint16_t* p) const {\n    const __m512i u",
         "  OA_INLINE void store_bf16(uint16_t* p) const {\n"
         "    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0xA1) == 0, 1)) {\n"
         "      store_256<NT>(p, (__m256i)_mm512_cvtneps_pbh(v));\n"
         "      return;\n"
         "    }\n"
         "    const __m512i u"),
        ("csrc/kernel_sources.txt", "isa_avx512.cpp    x86_64    -mavx512f",
         "isa_avx512.cpp    x86_64    -mavx512bf16 -mavx512f")],
}


def patched(root: Path, patches) -> dict:
    """{file: its text with `patches` applied} of the tree at `root`; a ValueError names a
    patch whose text is not in its file exactly once (the code changed: update the patch)."""
    texts = {}
    for rel, old, new in patches:
        text = texts.get(rel) or (root / rel).read_text()
        if text.count(old) != 1:
            raise ValueError(f"kernel_ablation: a patch no longer applies to {rel}: {old[:60]!r}")
        texts[rel] = text.replace(old, new)
    return texts


def build(root: Path, patches) -> Path:
    """kernel_cost built from a copy of the tree under `root` with `patches` applied."""
    texts = patched(REPO, patches)
    for name in ("CMakeLists.txt", "csrc", "bench", "tests"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
    for rel, text in texts.items():
        (root / rel).write_text(text)
    subprocess.run(["cmake", "-S", root, "-B", root / "b", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", root / "b", "--target", "kernel_cost"], check=True, capture_output=True)
    return root / "b" / "kernel_cost"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs of every build, alternating (default 2)")
    ap.add_argument("--only", default="", help="regex: the variants to build besides base")
    a = ap.parse_args()
    chosen = {k: v for k, v in VARIANTS.items() if k == "base" or re.search(a.only, k)}
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU") if os.path.exists("/proc/cpuinfo") else "unknown CPU"
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kernel_ablation_") as tmp:
        bins = {}
        for i, (name, patches) in enumerate(chosen.items()):
            (Path(tmp) / str(i)).mkdir()
            bins[name] = build(Path(tmp) / str(i), patches)
        print(f"# kernel_ablation.py --rounds {a.rounds}: tree {commit}, {cpu}, {os.cpu_count()} cores, "
              f"runs pinned to CPU 0: {bool(pin)}")
        for _ in range(a.rounds):
            for name, exe in bins.items():
                out = subprocess.run(pin + [str(exe)], capture_output=True, text=True, check=True).stdout
                print(f"== {name}   loadavg {open('/proc/loadavg').read().split()[:3]}")
                print("\n".join(line for line in out.splitlines() if "ns/element" in line), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""The planner: where every byte of a training run would live, and what bounds its step.

    python -m offload_adam.plan llama-3-70b                       # the 24 GB desktop
    python -m offload_adam.plan path/to/config.json --machine here --batch 8
    python -m offload_adam.plan --layers 32 --hidden 4096 --intermediate 14336 --vocab 128256 \
        --heads 32 --kv-heads 8

A model is a Llama-shaped decoder (a preset, a Hugging Face config.json of a model type in
MODEL_TYPES or, with transformers installed, a config name; or its shape given as flags):
streamed blocks (the decoder layers) and resident params (embeddings, final norm, head). For
each layout

    params   gpu    every param resident on the GPU in bf16 (the optimizer's default)
             ram    blocks streamed from pinned host copies (stream_params)
             files  blocks streamed from param files (stream_params(param_dirs=)), a cache of
                    host buffers in front: what host RAM has left, in whole blocks
    state    ram    master + moments in the engine's host arenas
             files  in the NVMe tier's files (state_dirs=), two generations, through its
                    ring of buffers, stepped in backward (its grads through the grad ring)
             compact  the same files with state_footprint="compact": one copy in a ring
                    with 4 spare buckets and the redo log of the grads, written in backward
                    (through the grad ring) and read back by the pass at step(); a new
                    state's first step is stepped in backward in place, with no log (the
                    log's room reserved once it committed)
    state_dtype     float32, bfloat16 or "8bit" moments (state_format.py)

it counts the bytes on the GPU, in host RAM and on disk, says whether they fit the machine,
gives the per-step lower bounds (GPU compute at peak, PCIe per direction, the CPU step at the
DRAM bandwidth, the SSD) with the one that binds, an estimate of the step as the code
schedules its phases (`schedule`), and the largest model of the same width (more or fewer
blocks) that fits.

Host and disk bytes are counted the way the code allocates them (engine/layout.py: grad and
staging per piece, master and moments per param, each rounded to a cache line; the NVMe
tier's buckets laid out by nvme/layout.py itself; the streamer's host copies): the tests
check them against `host_bytes()`, the files written and the simulated device's peak. GPU
activations and the step times are estimates from formulas stated below, not measurements.
The recipe assumed for every layout: bf16 params, free_grads_after_copy=True (a grad leaves
the GPU once copied), with one micro-batch a step step_in_backward (the grads through the
bounded grad ring, in host RAM or files alike), with more none (a grad buffer per piece,
accumulated on the host), prefetch k blocks ahead.

With params in files (param_files.py) each block's file extent is its host copy rounded to
4 KiB, the cache holds as many blocks as RAM has left (at least prefetch + 3; the report
says the param_cache_mb to pass, stream_params' own default being prefetch + 5 blocks),
forward and backward each read what the cache does not hold (with the state's heads, a block
over several buckets through buffers of its own beside the cache: param_files.HEAD_READS
blocks' worth at most, counted in host RAM), and the step's new values of
a block reach its file when the cache gives the block away (a block the cache keeps is not
written; at step(), as the compact state's pass does after the log, a block the cache does
not hold is not read first: the step writes every byte of it, the model's blocks having
no frozen params).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import itertools
import json
import math
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .options import positive_number as _positive


GB = 1e9
_LINE = 64        # engine/host_memory.py: every per-param host buffer starts on a cache line
_QUANT = 256      # state_format.QUANT_BLOCK: one fp32 scale per 256 8-bit codes per moment
_HOME_ALIGN = 64  # param_stream.py: each streamed param's host copy starts on a cache line
_FILE_ALIGN = 4096  # param_files.py: each block's extent in its file (O_DIRECT); the redo log's reads
_MB = 2 ** 20

# What one step of the fused kernel moves through DRAM per param with bf16 params
# (state_format.py's table: master, moments, grad, bf16 update, read and written).
_STEP_TRAFFIC = {"float32": 28.0, "bfloat16": 20.0, "8bit": 16.0}
STATE_DTYPES = ("float32", "bfloat16", "8bit")


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


# ---- the model ---------------------------------------------------------------------------

MAX_LAYERS = 4096   # the planner plans models of up to this many blocks (ModelShape)
# ... and of up to this width in each dimension (the widest published: a vocab of ~262 K,
# an MLP of ~100 K): past it the counts of a step overflow a float
MAX_WIDTH = 2 ** 20


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped decoder: `layers` blocks (attention with `kv_heads` key/value heads
    of `head_dim` each, a SwiGLU MLP, two RMSNorms), embeddings of `vocab` x `hidden`, a
    final norm and an output head (the embedding's, when `tied`). `head_dim` 0: hidden /
    heads (Qwen3-4B, Gemma-7B and Mistral-NeMo have heads x head_dim != hidden)."""
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool = False
    head_dim: int = 0

    def __post_init__(self):
        for key in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model {self.name!r}: {key} must be a positive int, got {v!r}")
        hd = self.head_dim
        if not isinstance(hd, int) or isinstance(hd, bool) or hd < 0:
            raise ValueError(f"model {self.name!r}: head_dim must be an int >= 0 (0: hidden / "
                             f"heads), got {hd!r}")
        if not hd and self.hidden % self.heads:
            raise ValueError(f"model {self.name!r}: hidden ({self.hidden}, a config's "
                             f"hidden_size) must be a multiple of heads ({self.heads}, "
                             "num_attention_heads) unless head_dim is given")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads ({self.heads}, a config's "
                             "num_attention_heads) must be a multiple of kv_heads "
                             f"({self.kv_heads}, num_key_value_heads)")
        if hd > MAX_WIDTH:
            raise ValueError(f"model {self.name!r}: head_dim {hd}; the planner plans head_dim "
                             f"up to {MAX_WIDTH}")
        if self.layers > MAX_LAYERS:   # (each layout walks every tensor: minutes, not a plan)
            raise ValueError(f"model {self.name!r}: {self.layers} layers; the planner plans "
                             f"models of up to {MAX_LAYERS} (the largest trained have ~130)")
        for key in ("vocab", "hidden", "intermediate"):   # (heads, kv_heads: at most hidden)
            if getattr(self, key) > MAX_WIDTH:
                raise ValueError(f"model {self.name!r}: {key} {getattr(self, key)}; the planner "
                                 f"plans {key} up to {MAX_WIDTH}")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.head_size * self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_size * self.kv_heads

    def block_tensors(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """One decoder layer's params, in registration order (transformers' Llama)."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        return [("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)),
                ("o_proj", (h, q)), ("gate_proj", (i, h)), ("up_proj", (i, h)),
                ("down_proj", (h, i)), ("input_layernorm", (h,)),
                ("post_attention_layernorm", (h,))]

    def resident_tensors(self) -> List[Tuple[str, Tuple[int, ...]]]:
        out = [("embed_tokens", (self.vocab, self.hidden)), ("norm", (self.hidden,))]
        return out + ([] if self.tied else [("lm_head", (self.vocab, self.hidden))])

    def tensors(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """Every param, in registration order: embeddings, the blocks, the norm, the head."""
        res = self.resident_tensors()
        blocks = [(f"layers.{k}.{n}", s) for k in range(self.layers)
                  for n, s in self.block_tensors()]
        return res[:1] + blocks + res[1:]

    @property
    def block_params(self) -> int:
        return sum(math.prod(s) for _, s in self.block_tensors())

    @property
    def resident_params(self) -> int:
        return sum(math.prod(s) for _, s in self.resident_tensors())

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.resident_params

    def with_layers(self, layers: int) -> "ModelShape":
        return replace(self, layers=layers)

    @classmethod
    def from_config(cls, cfg: dict, name: str = "config") -> "ModelShape":
        """From a Hugging Face config (its dict): one of MODEL_TYPES (Llama, Mistral, Qwen2
        and the like; a config without a model_type is taken as a Llama's), its keys left
        out taken as its config class does. A multimodal config's `text_config` is its
        decoder's. Anything else is refused by name: another model_type, a mixture of
        experts (its blocks are not this shape), a field of the wrong type (a count given
        as a string or a float is not guessed at)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"model config {name!r}: a JSON object expected, got "
                             f"{type(cfg).__name__}")
        if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
            # (transformers ties the head when the outer config or the decoder's says so)
            outer_tie = cfg.get("tie_word_embeddings")
            if outer_tie is not None and not isinstance(outer_tie, bool):
                raise ValueError(f"model config {name!r}: tie_word_embeddings must be true "
                                 f"or false, got {outer_tie!r}")
            cfg = cfg["text_config"]
            if outer_tie:
                cfg = {**cfg, "tie_word_embeddings": True}
        kind = cfg.get("model_type")
        if kind not in (None, ""):   # (none: a hand-written config, taken as a Llama's)
            if not isinstance(kind, str) or kind not in MODEL_TYPES:
                raise ValueError(
                    f"model config {name!r}: model_type {kind!r} is not one whose params the "
                    f"planner counts ({', '.join(sorted(MODEL_TYPES))}): its count would be "
                    "wrong. To plan it as a Llama of the same widths anyway (an "
                    "approximation), give the shape as flags instead of the config: --layers "
                    "--hidden --intermediate --vocab --heads --kv-heads (--head-dim, --tied)")
            # a key left out is what the type's config class takes for it, not the Llama's
            cfg = {**cfg, **{k: v for k, v in MODEL_TYPES[kind].items() if cfg.get(k) is None}}
        need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"model config {name!r} lacks {', '.join(missing)}: the planner "
                             "knows Llama-shaped decoders (give the shape as flags instead)")
        for key in _MOE_KEYS:
            experts = cfg.get(key)
            if experts not in (None, 0, 1, False):
                raise ValueError(f"model config {name!r}: {key}={experts!r}, a mixture of "
                                 "experts; the planner knows dense Llama-shaped decoders only")

        def count(key, default=None):
            v = cfg.get(key)
            if v is None and default is not None:
                return default
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model config {name!r}: {key} must be a positive int, got "
                                 f"{v!r}")
            return v

        hidden, heads = count("hidden_size"), count("num_attention_heads")
        head_dim = count("head_dim", max(1, hidden // heads))
        tied = cfg.get("tie_word_embeddings")
        if tied is not None and not isinstance(tied, bool):
            raise ValueError(f"model config {name!r}: tie_word_embeddings must be true or "
                             f"false, got {tied!r}")
        return cls(name, count("vocab_size"), hidden, count("intermediate_size"),
                   count("num_hidden_layers"), heads, count("num_key_value_heads", heads),
                   bool(tied), head_dim if head_dim * heads != hidden else 0)


# A config's count of experts per block (Mixtral, Qwen-MoE, DeepSeek, the
# switch-style ones): more than one is a mixture of experts.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


# The Hugging Face model types (a config's model_type) whose params ModelShape counts: each
# has exactly its matrices (attention q, k, v, o; a gated MLP's gate, up, down; the
# embedding and head) and its RMSNorms of `hidden` (two a block, one at the end). Not
# counted are the few vectors a block of some adds: Qwen2's q/k/v biases (hidden + 2
# kv_dim), the q/k norms of Qwen3 (2 head_dim) and OLMo-2 (hidden + kv_dim), the biases of
# attention_bias / mlp_bias: under 1/hidden of the block where intermediate >= hidden
# (5.6e-5 of Qwen2-0.5B's params, 1.7e-5 of Qwen2-7B's, 1.1e-6 of Qwen3-8B's).
# tests/test_plan.py builds each type with transformers and checks the count. Other types
# have other matrices (GPT-NeoX, StarCoder2 and Phi-2 an ungated MLP, Bamba mamba layers,
# BERT is an encoder) and are refused. With each type, its config class's defaults that
# are not the Llama's (head_dim hidden / heads, kv_heads = heads, untied), for a key a
# config.json leaves out (tie_word_embeddings left out of a Gemma's is true).
MODEL_TYPES: Dict[str, Dict[str, object]] = {
    "llama": {}, "mistral": {"num_key_value_heads": 8}, "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
    "gemma": {"tie_word_embeddings": True, "num_key_value_heads": 16, "head_dim": 256},
    "granite": {}, "olmo2": {}, "smollm3": {"tie_word_embeddings": True, "num_key_value_heads": 4},
}


# Published shapes (the models' config.json).
PRESETS: Dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-2-7b", 32000, 4096, 11008, 32, 32, 32),
    ModelShape("llama-3-8b", 128256, 4096, 14336, 32, 32, 8),
    ModelShape("llama-2-13b", 32000, 5120, 13824, 40, 40, 40),
    ModelShape("codellama-34b", 32000, 8192, 22016, 48, 64, 8),
    ModelShape("llama-3-70b", 128256, 8192, 28672, 80, 64, 8),
)}


def _size_of(name: str) -> Optional[str]:
    """The size a model's name gives ("13b" in llama-2-13b), lower case; None if none."""
    sizes = re.findall(r"(?<![a-z0-9.])(\d+(?:\.\d+)?[bm])(?![a-z0-9])", name.lower())
    return sizes[-1] if sizes else None


def load_model(spec: str) -> ModelShape:
    """A preset name, a config.json (or a directory holding one), or a Hugging Face
    config name (needs transformers, and the hub or its cache)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        with open(path, "rb") as f:
            try:
                cfg = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"model {spec!r}: {path} is not JSON ({e})") from None
            except RecursionError:   # (nested past Python's stack: found from outside)
                raise ValueError(f"model {spec!r}: {path} is not a config (JSON nested "
                                 "too deep to read)") from None
        return ModelShape.from_config(cfg, spec)
    if (spec.endswith(".json") or os.path.isdir(spec) or spec.startswith((".", "~"))
            or os.path.isabs(spec) or spec.count("/") > 1
            or ("/" in spec and os.path.isdir(spec.split("/")[0]))):   # a path, not a hub name
        # (a hub name is org/name: one slash; one whose org is a directory here is a path
        # mistyped, which the hub was asked for, half a minute offline: found from outside)
        raise ValueError(f"model {spec!r}: a directory without a config.json"
                         if os.path.isdir(spec) else f"model {spec!r}: not a regular file"
                         if os.path.exists(spec) else f"model {spec!r}: no such file or "
                         "directory" + ("" if spec == os.path.expanduser(spec) else
                                        " (~ is not expanded here: give the path)"))
    near = difflib.get_close_matches(spec.lower(), PRESETS, n=len(PRESETS), cutoff=0.75)
    if near and "/" not in spec:   # (a preset mistyped: the hub's Llama configs are org/name,
        # and asking it offline retries for half a minute)
        # A name spelled near one of another size is not that one: llama-3-7b is not
        # llama-3-70b, 10x larger (found from outside)
        near = [n for n in near if _size_of(n) == _size_of(spec)]
        raise ValueError(f"model {spec!r}: not a preset" + (
            f"; did you mean {near[0]!r}? (presets: " if near else " (presets: ") +
            f"{', '.join(PRESETS)}; or a config.json, or a Hugging Face config name such "
            "as meta-llama/Llama-3.1-8B)")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"model {spec!r}: not a preset ({', '.join(PRESETS)}) nor a "
                         "config.json; config names need transformers installed") from None
    try:
        cfg = AutoConfig.from_pretrained(spec)
    except Exception as e:   # noqa: BLE001 -- hub, cache and parse errors alike
        raise ValueError(f"model {spec!r}: not a preset ({', '.join(PRESETS)}) nor a "
                         f"config.json (no such file or directory here), and transformers "
                         f"could not load it as a Hugging Face config name: {e}") from None
    return ModelShape.from_config(cfg.to_dict(), spec)   # (a text_config taken there)


# ---- the machine and the run ---------------------------------------------------------------

@dataclass(frozen=True)
class Machine:
    """Capacities in bytes, speeds in GB/s (1e9 B/s) and TFLOPS. `pcie_gbps`: one
    direction (host-to-device and device-to-host copies run at once); the reserves are
    what the CUDA context and allocator, and the OS and the process, keep for themselves."""
    name: str
    gpu_bytes: float
    gpu_tflops: float
    pcie_gbps: float
    host_bytes: float
    dram_gbps: float
    ssd_bytes: float
    ssd_read_gbps: float
    ssd_write_gbps: float
    gpu_reserve_bytes: float = 1.5 * GB
    host_reserve_bytes: float = 8 * GB
    measured: Tuple[str, ...] = ()
    assumed: Tuple[str, ...] = ()   # ('here') fields neither measured nor given: the base's


# The reference desktop: a 24 GB GPU (an RTX 4090: 165 dense bf16 TFLOPS with fp32
# accumulation, PCIe 4.0 x16 ~25 GB/s a direction), 32 cores with 128 GB of DDR5 (~80 GB/s
# measured by a copy), one 1 TB PCIe 4.0 NVMe SSD (~6.5 GB/s reads, ~5 GB/s writes).
# The GPU machine this project is lent (an H100, 989 dense bf16 TFLOPS; 16 cores, 128 GiB,
# a 64 GiB disk): PCIe 55 GB/s and DRAM ~137 GB/s as measured on its H200 sibling
# (bench/results/NVIDIA_H200: transfer_bench, step_bench at 0.97 of the limit); its disk's
# speeds were never measured (1 and 2 GB/s here are placeholders: give them).
# The desktop's GPU and RAM are counted in GB as sold (24e9, 128e9 bytes), though a 24 GB
# card and 128 GB of DIMMs hold GiB (25.8e9, 137.4e9): a margin of 7 % that the published
# plans keep; the SSD is sold in 1e9 bytes. The lent machine's figures are as measured.
MACHINES: Dict[str, Machine] = {m.name: m for m in (
    Machine("desktop-24gb", 24 * GB, 165.0, 25.0, 128 * GB, 80.0, 1000 * GB, 6.5, 5.0),
    Machine("lent-h100", 80 * GB, 989.0, 55.0, 128 * 2**30, 137.0, 64 * 2**30, 2.0, 1.0),
)}


def machine_here(base: Machine, state_dir: str = ".", measure: bool = False,
                 probe_bytes: int = 1 << 30) -> Machine:
    """`base` with what this machine says of itself: its RAM (/proc/meminfo, or its
    memory cgroup's limit in a container), the free
    space where the files would go, its GPU's memory (torch.cuda); with `measure`, also
    its speeds (probe_speeds, `probe_bytes` each). Otherwise speeds stay `base`'s (give
    them as flags; bench/transfer_bench.py, step_bench.py and nvme_bench.py measure them
    more carefully)."""
    got = probe_speeds(state_dir, probe_bytes) if measure else {}
    from .engine.host_memory import total_host_bytes
    ram = total_host_bytes()
    if ram is not None:
        got["host_bytes"] = ram
    try:
        got["ssd_bytes"] = shutil.disk_usage(state_dir).free
    except OSError:
        pass
    try:
        import torch
        if torch.cuda.is_available():
            got["gpu_bytes"] = torch.cuda.get_device_properties(0).total_memory
    except Exception:   # noqa: BLE001 -- no torch or no driver: keep the base's
        pass
    return replace(base, name="here", measured=tuple(sorted(got)), **got)


def probe_speeds(state_dir: str, nbytes: int) -> Dict[str, float]:
    """Quick probes, the median of 3 passes each (GB/s): DRAM as a torch copy of `nbytes`
    (read + written: what the step's kernel streams is bound by the same), the disk as a
    sequential O_DIRECT write then read of a file of `nbytes` in `state_dir` (removed
    after; skipped where the filesystem refuses O_DIRECT, whose reads the page cache would
    serve), PCIe as pinned copies each way when CUDA is there."""
    import time

    import torch

    from .nvme.direct_io import AlignedBuffer, open_direct

    def best(fn) -> float:   # (the median pass's seconds)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[1]

    got: Dict[str, float] = {}
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    got["dram_gbps"] = 2 * nbytes / best(lambda: dst.copy_(src)) / GB
    src = dst = None   # (freed before the disk's probe)
    path = os.path.join(state_dir, "offload_adam_plan_probe.bin")
    chunk = 8 << 20
    buf = AlignedBuffer(chunk, pin=False)
    fd, direct = open_direct(path, create=True, size=nbytes)
    try:
        if direct:
            n = nbytes // chunk * chunk

            def write():
                for at in range(0, n, chunk):
                    os.pwrite(fd, buf.view, at)
                os.fsync(fd)

            def read():
                for at in range(0, n, chunk):
                    os.preadv(fd, [buf.view], at)
            got["ssd_write_gbps"] = n / best(write) / GB
            got["ssd_read_gbps"] = n / best(read) / GB
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()
    if torch.cuda.is_available():
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def copy(a, b):
            a.copy_(b, non_blocking=True)
            torch.cuda.synchronize()
        got["pcie_gbps"] = nbytes / max(best(lambda: copy(dev, host)),
                                        best(lambda: copy(host, dev))) / GB
    return got


# The most a run's counts (batch, seq, micro, prefetch) and sizes in MiB may be (past them
# a step's bytes and flops overflow a float), and the most state directories: state_files
# deals every bucket to the emptiest directory, a pass over them each (one a drive: a
# machine has a few dozen at most).
MAX_COUNT = 2 ** 31
MAX_MIB = 2.0 ** 40
MAX_STATE_DIRS = 64


@dataclass(frozen=True)
class Run:
    batch: int = 4
    seq: int = 2048
    micro: int = 1                 # micro-batches accumulated per optimizer step
    checkpointing: bool = True     # activation checkpointing of every block
    prefetch: int = 2              # blocks fetched ahead (stream_params' k)
    bucket_mb: float = 32.0        # the optimizer's bucket_mb
    state_budget_mb: Optional[float] = None   # the NVMe tier's ring (default 4 buckets)
    logit_bytes: float = 6.0       # per logit held at once: bf16 logits + the fp32 loss input
    param_cache_mb: Optional[float] = None   # stream_params' (None: what the host has left)
    state_dirs: int = 1            # the directories (drives) the state files are striped over

    def __post_init__(self):
        for key in ("batch", "seq", "micro", "prefetch", "state_dirs"):
            v = getattr(self, key)
            least = 0 if key == "prefetch" else 1
            most = MAX_STATE_DIRS if key == "state_dirs" else MAX_COUNT
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"{key} must be a whole number >= {least}, got {v!r}")
            if v > most:
                raise ValueError(f"{key} {v}: the planner plans up to {most}")
        for key in ("bucket_mb", "state_budget_mb", "logit_bytes", "param_cache_mb"):
            v = getattr(self, key)
            if v is not None and not _positive(v):
                raise ValueError(f"{key} must be a positive number, got {v!r}")
            if v is not None and v > MAX_MIB:
                raise ValueError(f"{key} {v:g}: the planner plans up to {MAX_MIB:g}")

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.batch * self.seq


@dataclass(frozen=True)
class Layout:
    params: str        # "gpu", "ram", "files"
    state: str         # "ram", "files", "compact" (STATES)
    state_dtype: str   # STATE_DTYPES

    def __post_init__(self):
        if self.params not in ("gpu", "ram", "files"):
            raise ValueError(f"params must be 'gpu', 'ram' or 'files', got {self.params!r}")
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got "
                             f"{self.state_dtype!r}")

    @property
    def streamed(self) -> bool:
        return self.params != "gpu"

    @property
    def in_files(self) -> bool:
        return self.state != "ram"

    def __str__(self) -> str:
        return f"params {self.params}, state {self.state} {self.state_dtype}"


STATES = ("ram", "files", "compact")


def all_layouts(state_dtypes: Sequence[str] = STATE_DTYPES) -> List[Layout]:
    return [Layout(p, s, d) for p in ("gpu", "ram", "files") for s in STATES
            for d in state_dtypes]


# ---- the bytes ------------------------------------------------------------------------------

def engine_pieces(numel: int, bucket_mb: float, itemsize: int = 2) -> List[int]:
    """The element counts of a param's pieces (engine/layout.py `cut`)."""
    from .engine.layout import piece_length
    per = piece_length(numel, itemsize, int(bucket_mb * _MB))
    return [min(per, numel - a) for a in range(0, numel, per)]


# The most engine pieces a plan cuts the model into: the plan walks every piece and every
# state bucket (about one a piece), ~20 us each, and a report makes some 500 plans (the
# largest that fits); a bucket_mb far below the default, or a model far wider than any
# trained, would take hours. Llama-3-70B at the default bucket_mb has ~4,400.
MAX_PIECES = 2 ** 16


def piece_count(model: "ModelShape", bucket_mb: float) -> int:
    """The engine pieces of the model's params (engine_pieces), counted without cutting."""
    from .engine.layout import piece_length
    bucket = int(bucket_mb * _MB)

    def count(tensors):
        return sum(-(-n // piece_length(n, 2, bucket)) for n in (math.prod(s) for _, s in tensors))
    return model.layers * count(model.block_tensors()) + count(model.resident_tensors())


def check_size(model: "ModelShape", run: "Run") -> None:
    """A ValueError when the plan would cut the model into more than MAX_PIECES pieces."""
    n = piece_count(model, run.bucket_mb)
    if n > MAX_PIECES:
        raise ValueError(f"bucket_mb {run.bucket_mb:g} cuts model {model.name!r} "
                         f"({model.params / 1e9:.3g} B params) into {n} pieces; the planner "
                         f"plans up to {MAX_PIECES} (its time grows with them): give a larger "
                         "bucket_mb (the optimizer's default is 32) or a smaller model")


def transfer_bytes(shapes: Sequence[Tuple[int, ...]], bucket_mb: float,
                   grads: bool = True, staged: bool = True) -> int:
    """The engine's grad buffers of bf16 params and their staging, per piece, a cache line
    each (packed pieces share their bucket's run, counted here each rounded up: an upper
    bound by under a line per small param)."""
    per = int(grads) + int(staged)
    return sum(per * _round(n * 2, _LINE) for s in shapes
               for n in engine_pieces(math.prod(s), bucket_mb))


def state_arena_bytes(shapes: Sequence[Tuple[int, ...]], state_dtype: str) -> int:
    """The engine's state arenas (engine/layout.py `allocate_state`): fp32 master, two
    moments, 8-bit block scales, per param a cache line each."""
    moment = {"float32": 4, "bfloat16": 2, "8bit": 1}[state_dtype]
    total = 0
    for s in shapes:
        n = math.prod(s)
        total += _round(4 * n, _LINE) + 2 * _round(moment * n, _LINE)
        if state_dtype == "8bit":
            total += 2 * _round(4 * -(-n // _QUANT), _LINE)
    return total


def state_files(shapes: Sequence[Tuple[int, ...]], state_dtype: str, bucket_mb: float,
                budget_mb: Optional[float], dirs: int = 1,
                blocks: Optional[Sequence[Optional[int]]] = None) -> dict:
    """The NVMe tier's layout for these params (one group, in order): the buckets as
    nvme_tier.FileStore cuts them, their data files (two slots each, nvme/layout.py) and
    the pipeline's ring of buffers; and the compact layout's (nvme/circular.py: one copy
    and 4 spare buckets; the redo log reserved for the bf16 grads, nvme/redo.py).
    `blocks` (the heads layout, nvme_heads.py): each shape's streamed block, or None for a
    param whose master stays whole; a block's params have split masters, their values the
    heads of buckets that hold that block's params alone (nvme_tier._lay_out)."""
    from .engine.grad_ring import ring_bytes
    from .nvme.circular import Circular
    from .nvme.layout import StateSpec, place
    from .nvme.pipeline import AHEAD, ring_size
    from .nvme.redo import log_sizes, record_reserve
    from .param_state import adam_bucket
    from .nvme_tier import deal, runs_within
    limit = bucket_mb * _MB

    # an entry: (name, shape, part, split); its state's bytes are its shape's (a model
    # repeats few shapes)
    @functools.lru_cache(maxsize=None)
    def one(shape, part, split):
        return adam_bucket([("x", shape, part)], state_dtype, split=split).nbytes

    def nbytes(entry):
        return one(tuple(entry[1]), entry[2], entry[3])

    runs: List[Tuple[Optional[int], list]] = []   # runs of one block's params, or of others'
    for i, s in enumerate(shapes):
        block = blocks[i] if blocks is not None else None
        split = block is not None
        whole = (f"0:{i}", s, False, split)
        pieces = engine_pieces(math.prod(s), bucket_mb)
        if len(pieces) > 1 and nbytes(whole) > limit:   # in parts (nvme_tier._lay_out)
            starts = [0, *itertools.accumulate(pieces[:-1])]
            entries = [(f"0:{i}#{run[0][0]}", (sum(n for _, n in run),), True, split)
                       for run in runs_within(list(zip(starts, pieces)), lambda run: nbytes(
                           ("x", (sum(n for _, n in run),), True, split)), limit)]
        else:
            entries = [whole]
        if not runs or runs[-1][0] != block:
            runs.append((block, []))
        runs[-1][1].extend(entries)
    dealt = [b for _, entries in runs for b in deal(entries, nbytes, limit)]

    @functools.lru_cache(maxsize=None)
    def layout(kinds):   # a bucket's layout by its entries' shapes (the names change nothing)
        return adam_bucket([("x", shape, part) for shape, part, _ in kinds], state_dtype,
                           split=kinds[0][2])
    buckets = [layout(tuple((tuple(e[1]), e[2], e[3]) for e in b)) for b in dealt]
    grads = [[2 * math.prod(e[1]) for e in b] for b in dealt]   # their bf16 grads
    spec = StateSpec(tuple(buckets), state_dtype)
    largest = max((b.nbytes for b in spec.buckets), default=0)
    budget = int(budget_mb * _MB) if budget_mb is not None else 4 * largest
    try:   # (the code's rule: it refuses a ring under 3 buckets)
        ring, refused = ring_size(spec, budget), None
    except ValueError as e:
        ring, refused = budget // max(largest, 1), str(e)
    extents, sizes = place(spec, dirs)
    compact = Circular(spec, [e.file for e in extents], dirs).file_sizes()
    records = [record_reserve(g) for g in grads]
    log = sum(log_sizes([e.file for e in extents], records,
                        dirs))   # each bucket's redo record's reserve, in whole blocks
    # each bucket's params, by index in `shapes` (the names: "0:<index>[#<start>]")
    params = [sorted({int(e[0].split(":")[1].split("#")[0]) for e in b}) for b in dealt]
    heads: Dict[int, int] = {}   # a block's buckets' heads, read to load it (nvme_heads.py)
    for b, spec_b, mine in zip(dealt, buckets, params):
        if b[0][3]:   # (split: one block's params)
            heads[blocks[mine[0]]] = heads.get(blocks[mine[0]], 0) + spec_b.head_bytes
    return {"generation_bytes": spec.nbytes, "data_file_bytes": sum(sizes),
            "compact_file_bytes": sum(compact), "redo_log_bytes": log,
            "block_head_bytes": heads,
            "ring_bytes": ring * largest, "ring": ring, "largest_bucket_bytes": largest,
            "ring_refused": refused,   # why the code would refuse this budget (None: it takes it)
            "buckets": len(buckets),
            "bucket_params": params,   # (the pass steps them in this order)
            # the compact pass's redo records in RAM: the one stepped, AHEAD read ahead
            "records_read_bytes": (AHEAD + 1) * max(records, default=0),
            "grad_ring_bytes": ring_bytes(max((sum(g) for g in grads), default=0),
                                         int(bucket_mb * _MB), trainable=sum(
                                             _round(b, _LINE) for g in grads for b in g))}


def home_bytes(shapes: Sequence[Tuple[int, ...]]) -> int:
    """The streamer's host copies of these bf16 params (param_stream.py `_take`)."""
    return sum(_round(2 * math.prod(s), _HOME_ALIGN) for s in shapes)


def block_host_bytes(model: "ModelShape") -> int:
    """One streamed block's host copy (param_stream.py's layout; ParamFiles.sizes)."""
    return home_bytes([s for _, s in model.block_tensors()])


def param_slot_bytes(model: "ModelShape") -> int:
    """One block's extent in the param files, and one slot of their cache (param_files.py)."""
    return _round(block_host_bytes(model), _FILE_ALIGN)


def param_file_bytes(model: "ModelShape") -> int:
    return model.layers * param_slot_bytes(model)


def activation_bytes(model: ModelShape, run: Run) -> Dict[str, float]:
    """GPU activations of one micro-batch, bf16, with flash attention (an estimate). Per
    token a block keeps for its backward its two norms' inputs and outputs (4h), q, k and v
    after RoPE (h + 2 kv, and RoPE's inputs h + kv), the attention output (h), the MLP's
    gate, up, SiLU(gate) and product (4i): 4h + 3q + 3kv + 4i elements (q: heads x
    head_dim, h where they are equal). With checkpointing only
    each block's input (h) is kept, plus one block's full set while it is recomputed. The
    logits of the micro-batch are held once (run.logit_bytes each)."""
    t = run.tokens
    per_block = 2 * t * (4 * model.hidden + 3 * model.q_dim + 3 * model.kv_dim
                         + 4 * model.intermediate)
    if run.checkpointing:
        kept = model.layers * 2 * t * model.hidden + per_block
    else:
        kept = model.layers * per_block
    return {"blocks": float(kept), "logits": float(t * model.vocab * run.logit_bytes)}


def _gpu(model: ModelShape, run: Run, layout: Layout) -> Dict[str, float]:
    block = 2 * model.block_params
    resident = 2 * model.resident_params
    largest_resident = 2 * max(math.prod(s) for _, s in model.resident_tensors())
    if layout.streamed:
        # (k + 2) x the largest block at most: k prefetched, one computing, one whose
        # buffers wait for the compute that read them (the design's bound, checked on the
        # simulated device), and never more blocks than the model has; the resident
        # params stay
        out = {"streamed block buffers": float(min(run.prefetch + 2, model.layers) * block),
               "resident params": float(resident)}
    else:
        out = {"params": 2.0 * model.params}
    # grads are freed once copied: a block's worth being produced and one being copied,
    # or a resident param's (the head's) grad
    out["grads in flight"] = float(2 * max(block, largest_resident))
    out.update({f"activations ({k})": v for k, v in activation_bytes(model, run).items()})
    return out


def _host(model: ModelShape, run: Run, layout: Layout, files: dict) -> Dict[str, float]:
    """Host RAM in steady state. With one micro-batch a step (the step in backward) the
    grads wait in a bounded ring (engine/grad_ring.py: with the state in files sized by
    the file buckets, in RAM 4 engine buckets or two streamed blocks' grads); otherwise
    each piece has a grad buffer. A streamed param's update goes to its host copy: only
    resident params have a staging buffer."""
    from .engine.grad_ring import ring_bytes
    shapes = [s for _, s in model.tensors()]
    streamed = [s for _, s in model.block_tensors()] * model.layers
    resident = [s for _, s in model.resident_tensors()]
    out: Dict[str, float] = {}
    staged = shapes if layout.params == "gpu" else resident
    out["staging"] = float(transfer_bytes(staged, run.bucket_mb, grads=False))
    if run.micro == 1:
        bucket = int(run.bucket_mb * _MB)
        block = (sum(_round(2 * math.prod(s), _LINE) for _, s in model.block_tensors())
                 if layout.params != "gpu" else 0)   # (grad_ring.block_grad_bytes)
        trainable = sum(_round(2 * math.prod(s), _LINE) for s in shapes)
        out["grad ring"] = float(files["grad_ring_bytes"] if layout.in_files
                                 else ring_bytes(bucket, bucket, block, trainable=trainable))
    else:
        out["grads"] = float(transfer_bytes(shapes, run.bucket_mb, staged=False))
    if run.micro > 1:
        # free_grads_after_copy accumulates on the host through a ring
        largest = max(max(engine_pieces(math.prod(s), run.bucket_mb)) for s in shapes)
        out["accumulation ring"] = float(4 * _round(largest * 4, _LINE))
    if layout.params == "ram":
        out["param host copies"] = float(home_bytes(streamed))
    if layout.state == "ram":
        out["master + moments"] = float(state_arena_bytes(shapes, layout.state_dtype))
    else:
        out["state file ring"] = float(files["ring_bytes"])
    if layout.state == "compact":
        out["redo records read"] = float(files["records_read_bytes"])
    return out


def _ring(layout: Layout, run: Run) -> bool:
    """Whether the grads go through the ring: the state in files, stepped (compact:
    logged) in backward, which accumulates no micro-batches (with more than one, each
    piece has its buffer)."""
    return layout.in_files and run.micro == 1


def _disk(model: ModelShape, layout: Layout, files: dict, dirs: int = 1) -> Dict[str, float]:
    out: Dict[str, float] = {}
    if layout.state == "compact":
        spares = "4 spare buckets" + (f" in each of {dirs} directories" if dirs > 1 else "")
        out[f"state (1 copy + {spares})"] = float(files["compact_file_bytes"])
        out["grad redo log"] = float(files["redo_log_bytes"])
    elif layout.state == "files":
        out["state (2 generations)"] = float(files["data_file_bytes"])
    if layout.params == "files":
        out["param files"] = float(param_file_bytes(model))
    return out


@dataclass
class Plan:
    model: ModelShape
    machine: Machine
    run: Run
    layout: Layout
    gpu: Dict[str, float] = field(default_factory=dict)
    host: Dict[str, float] = field(default_factory=dict)
    disk: Dict[str, float] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)   # per-step lower bounds
    traffic: Dict[str, float] = field(default_factory=dict)   # bytes per step per link
    expected_s: float = 0.0   # the step as the code schedules it (`schedule`)
    # disk bytes of `disk` given back once the first step commits (the heads: the param
    # files' extents, holes from then on), and those reserved only then (two generations:
    # the slots the second step writes; compact: the redo log); the peak is the larger
    # of before and after
    freed: Dict[str, float] = field(default_factory=dict)
    later: Dict[str, float] = field(default_factory=dict)
    refused: List[str] = field(default_factory=list)   # what the code would refuse to build

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def disk_before_first(self) -> float:
        """Disk bytes until the first step commits."""
        return sum(self.disk.values()) - sum(self.later.values())

    @property
    def disk_after_first(self) -> float:
        return sum(self.disk.values()) - sum(self.freed.values())

    @property
    def disk_total(self) -> float:
        """The disk's peak."""
        return max(self.disk_before_first, self.disk_after_first)

    def short_of(self) -> List[Tuple[str, float, float]]:
        """The tiers whose bytes do not fit: (tier, bytes used, bytes it has room for)."""
        m = self.machine
        return [(what, used, room) for what, used, room in (
            ("GPU", self.gpu_total, m.gpu_bytes - m.gpu_reserve_bytes),
            ("host RAM", self.host_total, m.host_bytes - m.host_reserve_bytes),
            ("SSD", self.disk_total, m.ssd_bytes)) if used > room]

    def misfits(self) -> List[str]:
        """What does not fit, named ([] when everything does)."""
        return [f"{what} {used / GB:.1f} GB > {room / GB:.1f} GB"
                for what, used, room in self.short_of()] + self.refused

    @property
    def fits(self) -> bool:
        return not self.misfits()

    @property
    def bound(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    @property
    def step_s(self) -> float:
        return max(self.seconds.values())

    def as_dict(self) -> dict:
        return {"model": asdict(self.model), "params": self.model.params,
                "layout": asdict(self.layout),
                "gpu_bytes": self.gpu, "host_bytes": self.host, "disk_bytes": self.disk,
                "gpu_total": self.gpu_total, "host_total": self.host_total,
                "disk_total": self.disk_total, "fits": self.fits, "misfits": self.misfits(),
                "seconds": self.seconds, "bound": self.bound, "step_s": self.step_s,
                "expected_s": self.expected_s, "traffic_bytes": self.traffic,
                "disk_freed_bytes": self.freed, "disk_later_bytes": self.later,
                "disk_before_first": self.disk_before_first,
                "disk_after_first": self.disk_after_first}


@functools.lru_cache(maxsize=64)
def _model_files(model: ModelShape, state_dtype: str, bucket_mb: float,
                 budget_mb: Optional[float], dirs: int, heads: bool = False) -> dict:
    """state_files of the model's params, kept: a report asks the same for each layout of a
    state_dtype, and its searches for the same models again (their cost is in these).
    `heads`: the streamed blocks' values kept as the heads of their buckets."""
    per = len(model.block_tensors())
    blocks = ([None] + [k // per for k in range(model.layers * per)]
              + [None] * (len(model.resident_tensors()) - 1)) if heads else None
    return state_files([s for _, s in model.tensors()], state_dtype, bucket_mb, budget_mb,
                       dirs, blocks)


def heads_layout(layout: Layout) -> bool:
    """Whether the code lays this layout's state out with heads (nvme_tier.HEADS, the
    default; OFFLOAD_ADAM_HEADS=0 plans whole masters): the blocks streamed from param
    files, their state in files."""
    from . import nvme_tier
    return nvme_tier.HEADS and layout.params == "files" and layout.in_files


def _heads_direct(model: ModelShape, files: dict) -> bool:
    """Whether every streamed block is read from the heads straight into its cache slot
    (nvme_heads: its params the start of one bucket, in its order: counted so where
    that holds of the block alone in its bucket); else its reads go through buffers
    beside the cache, param_files.HEAD_READS of the largest blocks at most."""
    per, first = len(model.block_tensors()), 1
    for k in range(model.layers):
        own = range(first + k * per, first + (k + 1) * per)
        holders = [b for b in files["bucket_params"] if any(i in own for i in b)]
        if len(holders) != 1 or list(holders[0][:per]) != list(own):
            return False
    return True


def _seams(model: ModelShape, files: dict) -> bool:
    """Whether a file bucket holds params of two streamed blocks (model.tensors() order:
    the embedding, then the blocks' params)."""
    per, first = len(model.block_tensors()), 1
    end = first + model.layers * per
    return any(len({(i - first) // per for i in b if first <= i < end}) > 1
               for b in files["bucket_params"])


def plan(model: ModelShape, machine: Machine, run: Run, layout: Layout) -> Plan:
    from .param_files import HEAD_READS, cache_slots, min_slots
    check_size(model, run)
    heads = heads_layout(layout)
    files = _model_files(replace(model, name=""), layout.state_dtype, run.bucket_mb,
                         run.state_budget_mb, run.state_dirs, heads)
    p = Plan(model, machine, run, layout, _gpu(model, run, layout),
             _host(model, run, layout, files), _disk(model, layout, files, run.state_dirs))
    if heads:
        p.freed["param files"] = p.disk["param files"]
    if layout.state == "files":   # (NvmeState: the first pass writes one slot of each)
        p.later["state (2 generations)"] = float(files["generation_bytes"])
    elif layout.state == "compact":   # (a new state's first pass writes no redo record)
        p.later["grad redo log"] = p.disk["grad redo log"]
    if layout.in_files and files["ring_refused"]:
        p.refused.append(f"state_budget_mb {run.state_budget_mb:g}: {files['ring_refused']}")
    n, streamed = model.params, model.layers * model.block_params
    if heads and not _heads_direct(model, files):
        # (beside the cache while they fly; host_bytes() does not hold them for good)
        p.host["head reads (at most)"] = float(HEAD_READS * block_host_bytes(model))
    cache = 0.0
    if layout.params == "files":   # what the host has left caches the param files, in blocks
        slot = param_slot_bytes(model)
        free = machine.host_bytes - machine.host_reserve_bytes - p.host_total
        slots = max(min(min_slots(run.prefetch), model.layers),
                    min(int(max(free, 0) // slot), model.layers))
        if run.param_cache_mb is not None:   # as stream_params(param_cache_mb=) sizes it
            slots = cache_slots(run.param_cache_mb * 2**20, slot, run.prefetch, model.layers)
        cache = float(slots * slot)
        p.host["param cache"] = cache
    m, micro = machine, run.micro
    # PCIe, per direction: streamed params fetched for forward and again for backward per
    # micro-batch, the resident params' updates at step(); every grad once per micro-batch
    h2d = micro * 2 * 2.0 * streamed if layout.streamed else 0.0
    h2d += 2.0 * (n - streamed if layout.streamed else n)
    d2h = micro * 2.0 * n
    # CPU step: the fused kernel's traffic (a streamed param's update written into its
    # host copy); an accumulated micro-batch adds a read of its slot and a
    # read-modify-write of the host grad; the files' bytes cross DRAM once each way by DMA
    state_gen = files["generation_bytes"]
    dram = _STEP_TRAFFIC[layout.state_dtype] * n + (micro - 1) * 6.0 * n
    if layout.in_files:
        dram += 2 * state_gen
    # SSD: the state read and written once per step; param files miss the cache in forward
    # and backward (each micro-batch), and a block the step wrote is written to its file
    # when the cache gives it away (the step writes each block whole, reading none:
    # param_files.hold_to_write; a block with a frozen param would be read): the blocks
    # that circulate through the cache, 2 x the misses of a pass, all at most (the blocks
    # at the turn of forward and backward stay; micro-batches after the first give away
    # blocks read, already written). A pass of the state files at step() (compact, or
    # micro-batches) writes one more: forward's first read ahead writes back the block in
    # use, which the pass left in the cache with its new values, before it takes a slot
    # (two more where a file bucket holds the end of one block and the start of the next:
    # the pass holds both at that seam, and gives away the block before the one it is
    # finishing). The state in RAM stepped at step() does not, since backward's read-ahead
    # takes the slots of the blocks it used (ParamStreamer._rank): 2 x the misses, counted
    # in tests/test_plan.py for 8-12 blocks, 5-8 slots, prefetch 1-2, 2-3 micro-batches
    ssd_read = ssd_write = forward_read = 0.0
    if layout.in_files:
        ssd_read, ssd_write = state_gen, state_gen
        if layout.state == "compact":
            ssd_write += files["redo_log_bytes"]   # the step's grads, logged first
            if _ring(layout, run):   # logged in backward: read back by the pass, each
                # record in the whole 4 KiB blocks around it (direct I/O): a block more
                # each at most, as records share the blocks at their ends
                ssd_read += files["redo_log_bytes"] + _FILE_ALIGN * files["buckets"]
    if layout.params == "files" and heads:
        # with the heads (nvme_heads.py) a block is read from its buckets' heads, whole
        # heads each, and its new values are the state's, written with it: the compact
        # pass commits what it wrote before the cache gives a block away
        # (StepPipeline.settle), so no param file is written; the two generations commit
        # at the pass's end, and the blocks it gave away before go to their files (a
        # pass's misses), back in the heads at the commit
        missed = max(0, model.layers - int(cache // slot))   # blocks a pass reads
        forward_read = micro * missed * float(max(files["block_head_bytes"].values()))
        params_read = 2 * forward_read
        params_written = float(missed * slot) if layout.state == "files" else 0.0
    elif layout.params == "files":
        extent = float(param_file_bytes(model))
        misses = max(0.0, extent - cache)   # a pass's reads
        forward_read = micro * misses
        at_step = layout.state == "compact" or (micro > 1 and layout.in_files)
        held = 2 if layout.in_files and _seams(model, files) else 1
        params_read = 2 * forward_read
        params_written = min(extent, 2 * misses + (held * slot if at_step and misses else 0.0))
    else:
        params_read = params_written = 0.0
    ssd_read += params_read
    ssd_write += params_written
    # GPU: 6 flops per param per token (+2 to recompute with checkpointing), and the
    # attention's score and value products, causal (6 s q per token per layer, q = heads x
    # head_dim, +2 likewise)
    k = 8 if run.checkpointing else 6
    flops = micro * run.tokens * (k * n + k * model.layers * run.seq * model.q_dim)
    p.traffic = {"h2d": h2d, "d2h": d2h, "dram": dram, "ssd_read": ssd_read,
                 "ssd_write": ssd_write, "flops": float(flops),
                 # (of ssd_read and ssd_write: the params' share, from the param files or
                 # the heads)
                 "ssd_read_params": params_read, "ssd_write_params": params_written}
    p.seconds = {"gpu": flops / (m.gpu_tflops * 1e12),
                 "pcie": max(h2d, d2h) / (m.pcie_gbps * GB),
                 "cpu": dram / (m.dram_gbps * GB),
                 "ssd": ssd_read / (m.ssd_read_gbps * GB) + ssd_write / (m.ssd_write_gbps * GB)}
    p.expected_s = schedule(p, k, streamed, forward_read / (m.ssd_read_gbps * GB))
    return p


def schedule(p: Plan, k: int, streamed: int, ssd_forward: float) -> float:
    """The step as the code runs it, each phase at its slowest link (an estimate: the
    bounds are what no schedule beats; this is what this one gives).

    - Forward: the GPU's forward share of the flops (2 of the k per param and token), the
      streamed params' copies in, or the param files' reads (`ssd_forward` seconds),
      whichever is slowest. The CPU waits: the next forward reads what the step writes,
      so no step runs in it; so does the state's pass over its files, which starts at
      backward's first grad (engine/disk_early.py).
    - Backward: the rest of the flops (recompute and backward), the params fetched again
      and the grads copied out, or, with one micro-batch, the CPU step, which runs inside
      backward (step_in_backward) and shares the DRAM with those copies, whose bytes
      (2 B per grad, 2 B per streamed param) it adds. With several micro-batches the
      grads accumulate on the host and the CPU step runs after the last one, alone.
    - step(): the resident params' updates go back to the device.
    - The SSD's other bytes (the state read and written, the redo log, the param files'
      reads in backward and writes) fall in backward and step(): that part takes at
      least their time.
    On an H200 (2026-11-28: bench/results/NVIDIA_H200/2026-11-28b/NOTES.md) a 12.9 B
    model streamed from RAM with its state in RAM took 2.98-3.34 s: 1.3-1.4 x this
    estimate (2.35 s there), 2.0-2.2 x the largest bound (1.51 s, the CPU step)."""
    m, run, t = p.machine, p.run, p.traffic
    pcie, dram = m.pcie_gbps * GB, m.dram_gbps * GB
    micro = run.micro
    fetch = micro * 2.0 * streamed if p.layout.streamed else 0.0   # one pass of fetches
    gpu_fwd = p.seconds["gpu"] * 2 / k
    forward = max(gpu_fwd, fetch / pcie, ssd_forward)
    backward = max(p.seconds["gpu"] - gpu_fwd, max(fetch, t["d2h"]) / pcie)
    ssd = p.seconds["ssd"] - ssd_forward
    tail = (t["h2d"] - 2 * fetch) / pcie
    if micro == 1:   # in backward, beside the copies
        return forward + max(backward, (t["dram"] + t["d2h"] + fetch) / dram, ssd) + tail
    return forward + max(backward + t["dram"] / dram, ssd) + tail


# The most blocks largest_fitting tries (a plan's cost grows with the blocks; the deepest
# published decoders have ~130): past it a width is reported as fitting at least this many.
MAX_BLOCKS = 1024


def most_blocks(model: ModelShape, run: Run) -> int:
    """Where largest_fitting stops: MAX_BLOCKS, or fewer where more would cut the model
    into more than MAX_PIECES pieces (check_size)."""
    one = piece_count(model.with_layers(1), run.bucket_mb)
    block = piece_count(model.with_layers(2), run.bucket_mb) - one
    return max(1, min(MAX_BLOCKS, (MAX_PIECES - one) // block + 1))


def largest_fitting(model: ModelShape, machine: Machine, run: Run,
                    layout: Layout) -> Optional[ModelShape]:
    """The model of the same width with the most blocks that fits (None: not even one;
    most_blocks: at least that many). Bytes grow with the blocks in every tier, so a
    bisection finds it."""
    most = most_blocks(model, run)
    if not plan(model.with_layers(1), machine, run, layout).fits:
        return None
    lo, hi = 1, min(2, most)
    while plan(model.with_layers(hi), machine, run, layout).fits:
        lo, hi = hi, min(hi * 2, most)
        if lo == most:
            return model.with_layers(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if plan(model.with_layers(mid), machine, run, layout).fits:
            lo = mid
        else:
            hi = mid
    return model.with_layers(lo)


# ---- the report ------------------------------------------------------------------------------

def _gb(x: float) -> str:
    return f"{x / GB:8.1f}"


def _count(n: float, width: int = 0) -> str:
    """A count of params in B (billions), or M / K where that would print 0."""
    scale, unit = next(((s, u) for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if n >= s),
                       (1.0, ""))
    digits = 2 if unit == "B" and not width else 1
    return f"{n / scale:{width}.{digits}f} {unit}".rstrip()


def report(model: ModelShape, machine: Machine, run: Run, layouts: Sequence[Layout],
           detail: bool = False) -> Tuple[str, List[dict]]:
    m = machine
    wide = max([34] + [len(str(layout)) for layout in layouts])   # (the names' column)
    lines = [
        f"model {model.name}: {_count(model.params)} params ({model.layers} blocks of "
        f"{_count(model.block_params)}, {_count(model.resident_params)} resident), "
        f"batch {run.batch} x {run.seq}, {run.micro} micro-batch(es) per step, "
        f"checkpointing {'on' if run.checkpointing else 'off'}, prefetch {run.prefetch}",
        f"machine {m.name}: GPU {m.gpu_bytes / GB:.1f} GB at {m.gpu_tflops:.3g} TFLOPS, PCIe "
        f"{m.pcie_gbps:.3g} GB/s a direction, RAM {m.host_bytes / GB:.1f} GB at {m.dram_gbps:.3g} "
        f"GB/s, SSD {m.ssd_bytes / GB:.0f} GB at {m.ssd_read_gbps:.3g}/{m.ssd_write_gbps:.3g} GB/s "
        f"read/write; reserved: GPU {m.gpu_reserve_bytes / GB:.1f} GB, host "
        f"{m.host_reserve_bytes / GB:.1f} GB"
        + (f" (measured here: {', '.join(m.measured)})" if m.measured else "")
        + (f" (not measured, the preset's: {', '.join(m.assumed)})" if m.assumed else ""),
        "",
        f"{'layout':{wide}s} {'GPU GB':>8s} {'host GB':>8s} {'disk GB':>8s} {'fits':>4s} "
        f"{'GPU s':>7s} {'PCIe s':>7s} {'CPU s':>7s} {'SSD s':>7s} {'bound':>5s} "
        f"{'est s':>7s} {'largest that fits':>18s}",
    ]
    out, why, caches = [], [], []
    most = most_blocks(model, run)
    for layout in layouts:
        p = plan(model, machine, run, layout)
        big = largest_fitting(model, machine, run, layout)
        name = str(layout)
        s = p.seconds
        lines.append(
            f"{name:{wide}s} {_gb(p.gpu_total)} {_gb(p.host_total)} {_gb(p.disk_total)} "
            f"{'yes' if p.fits else 'no':>4s} {s['gpu']:7.2f} {s['pcie']:7.2f} {s['cpu']:7.2f} "
            f"{s['ssd']:7.2f} {p.bound:>5s} {p.expected_s:7.2f} "
            + (f"{'>=' if big.layers == most else '':>2s}{_count(big.params, 9):>11s} "
               f"({big.layers})" if big else f"{'none':>18s}"))
        if detail:
            for tier, parts in (("GPU", p.gpu), ("host", p.host), ("disk", p.disk)):
                for what, b in parts.items():
                    lines.append(f"    {tier:5s} {what:42s} {b / GB:10.3f} GB")
            for what, b in p.later.items():
                lines.append(f"    disk  {what + ' before the first step':42s} "
                             f"{(p.disk[what] - b) / GB:10.3f} GB (the rest reserved then)")
            for what, b in p.freed.items():
                lines.append(f"    disk  {what + ' after the first step':42s} "
                             f"{(p.disk[what] - b) / GB:10.3f} GB (holes)")
            if not p.fits:
                lines.append(f"    does not fit: {'; '.join(p.misfits())}")
        elif not p.fits:   # (said below the table: what a "no" is short of)
            why.append(f"  {name}: {'; '.join(p.misfits())}")
        if "param cache" in p.host and run.param_cache_mb is None and not any(
                what == "host RAM" for what, *_ in p.short_of()):
            # (host RAM short: none left for a cache, the least stream_params takes planned)
            # (rounded up: the cache of that many MiB holds the slots planned, not one fewer)
            caches.append(f"  {name}: param_cache_mb={math.ceil(p.host['param cache'] / 2**20)}")
        d = p.as_dict()
        d["largest_fitting"] = None if big is None else {
            "layers": big.layers, "params": big.params,
            "at_least": big.layers == most}   # (the search stops there)
        out.append(d)
    if why:
        lines += ["", "Does not fit:"] + why
    if caches:   # (stream_params' own default is prefetch + 5 blocks: more misses)
        from .param_files import cache_slots, default_cache_slots
        slot = param_slot_bytes(model)
        default = cache_slots(default_cache_slots(run.prefetch) * slot, slot, run.prefetch,
                              model.layers) * slot / 2**20
        lines += ["", "Params in files: the cache planned is what host RAM has left; pass it "
                  "to stream_params (its default, prefetch + 5 blocks, is "
                  f"{default:.0f} MiB here; --param-cache-mb plans another):"] + caches
    lines += ["", "Bounds are per optimizer step, each at the stated speed; the step is at "
              "least the largest. est: the step as the code schedules it (forward with the "
              "CPU idle, then backward with the CPU step inside, then step()'s copies).",
              "Host and disk bytes are the code's own layouts; GPU activations and times are "
              "estimates (offload_adam/plan.py says how). Disk bytes are the data files: the "
              "small files beside the state's (its spec, manifest and lock, ~0.25 KB per "
              "tensor or part) are not counted."]
    return "\n".join(lines), out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m offload_adam.plan",
        description="Where every byte of a training run would live (GPU, host RAM, SSD) for "
                    "each layout, the per-step lower bounds, and the largest model that fits. "
                    "It plans bf16 (or fp16) params, every one trained, one state_dtype for "
                    "all: fp32 params, or a state in two formats, take more than planned; "
                    "frozen blocks less.")
    ap.add_argument("model", nargs="?", help=f"a preset ({', '.join(PRESETS)}), a config.json "
                    "or its directory, or a Hugging Face config name; or leave it out and give "
                    "the shape with the flags below (with a model, they change its shape)")
    for flag, what in (("layers", "decoder blocks"), ("hidden", "hidden size"),
                       ("intermediate", "the MLP's intermediate size"), ("vocab", "vocabulary"),
                       ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (default: as many as --heads)"),
                       ("head-dim", "each head's size (default: hidden / heads)")):
        ap.add_argument(f"--{flag}", type=int, help=what)
    ap.add_argument("--tied", action="store_true", help="tied input and output embeddings")
    ap.add_argument("--machine", default="desktop-24gb",
                    help=f"{', '.join(MACHINES)}, or 'here' (the desktop's speeds, this "
                         "machine's RAM, free disk and GPU memory); default desktop-24gb")
    ap.add_argument("--state-dir", help="where the files would go (with 'here'; default .)")
    ap.add_argument("--measure", action="store_true",
                    help="with --machine here: probe DRAM, disk (in --state-dir) and PCIe "
                         "speeds too (a few seconds; --probe-gb each)")
    ap.add_argument("--probe-gb", type=float, help="with --measure: each probe's size "
                    "(default 1)")
    for flag, unit in (("gpu-gb", "GB"), ("gpu-tflops", "TFLOPS"), ("pcie-gbps", "GB/s"),
                       ("ram-gb", "GB"), ("dram-gbps", "GB/s"), ("ssd-gb", "GB"),
                       ("ssd-read-gbps", "GB/s"), ("ssd-write-gbps", "GB/s"),
                       ("gpu-reserve-gb", "GB"), ("host-reserve-gb", "GB")):
        ap.add_argument(f"--{flag}", type=float, help=f"override ({unit}" + (
            ", 1e9 bytes: a card sold as 24 GB has 24 GiB, --gpu-gb 25.8)" if flag == "gpu-gb"
            else ", 1e9 bytes)" if unit == "GB" else ")"))
    ap.add_argument("--batch", type=int, default=4,
                    help="sequences per micro-batch (default 4)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    ap.add_argument("--micro", type=int, default=1,
                    help="micro-batches per step (gradient accumulation; default 1)")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="no activation checkpointing (planned on by default)")
    ap.add_argument("--prefetch", type=int, default=2,
                    help="stream_params' prefetch: blocks fetched ahead (default 2)")
    ap.add_argument("--bucket-mb", type=float, default=32.0,
                    help="the optimizer's bucket_mb (default 32)")
    ap.add_argument("--state-budget-mb", type=float,
                    help="the optimizer's state_budget_mb (default: 4 file buckets)")
    ap.add_argument("--state-dirs", type=int, default=1,
                    help="the directories (drives) state_dirs= stripes the state over "
                         "(the compact layout keeps 4 spare buckets in each); the --ssd-* "
                         "figures are all the drives' together (--machine here measures "
                         "--state-dir's alone)")
    ap.add_argument("--param-cache-mb", type=float,
                    help="the param files' cache (stream_params' param_cache_mb; default: "
                         "what host RAM has left)")
    ap.add_argument("--state-dtype", action="append", choices=STATE_DTYPES,
                    help="only these (repeatable; default all)")
    ap.add_argument("--detail", action="store_true", help="every tier's bytes, itemized")
    ap.add_argument("--json", help="also write the plans here")
    return ap


# The flags that override a machine's fields, and the fields --machine here measures.
_MACHINE_FLAGS = {"gpu-gb": "gpu_bytes", "gpu-tflops": "gpu_tflops", "pcie-gbps": "pcie_gbps",
                  "ram-gb": "host_bytes", "dram-gbps": "dram_gbps", "ssd-gb": "ssd_bytes",
                  "ssd-read-gbps": "ssd_read_gbps", "ssd-write-gbps": "ssd_write_gbps",
                  "gpu-reserve-gb": "gpu_reserve_bytes", "host-reserve-gb": "host_reserve_bytes"}
# The most a machine flag may be (GB, GB/s or TFLOPS: an exabyte), and the least a speed
# may be (a MB/s, a GFLOPS): past them a step's seconds or a tier's bytes overflow a float.
MAX_FIGURE = 1e9
MIN_SPEED = 1e-3
_SHAPE_FLAGS = {"layers": "layers", "hidden": "hidden", "intermediate": "intermediate",
                "vocab": "vocab", "heads": "heads", "kv-heads": "kv_heads",
                "head-dim": "head_dim"}


def _model(args) -> ModelShape:
    """The model given, with every shape flag applied over it (a preset's or a config's
    heads, say, replaced; ModelShape checks the result)."""
    shape = {k: getattr(args, k.replace("-", "_")) for k in _SHAPE_FLAGS}
    if args.model is None:
        missing = [f"--{k}" for k, v in shape.items()
                   if v is None and k not in ("kv-heads", "head-dim")]
        if missing:
            raise ValueError("give a model (a preset, a config.json or a config name) or "
                             f"its shape: {', '.join(missing)} missing")
        kv = shape["kv-heads"]   # (left out: as many as heads; 0 is refused, as with a preset)
        return ModelShape("custom", shape["vocab"], shape["hidden"], shape["intermediate"],
                          shape["layers"], shape["heads"], shape["heads"] if kv is None else kv,
                          args.tied, shape["head-dim"] or 0)
    model = load_model(args.model)
    given = {_SHAPE_FLAGS[k]: v for k, v in shape.items() if v is not None}
    if args.tied:
        given["tied"] = True
    changed = [f"--{k} {v}" for k, v in shape.items()
               if v is not None and v != getattr(model, _SHAPE_FLAGS[k])]
    if args.tied and not model.tied:
        changed.append("--tied")
    if changed:   # (named so: the preset's name alone said its shape, found from outside)
        given["name"] = f"{model.name} with {' '.join(changed)}"
    return replace(model, **given) if given else model


def _check_probe_fits(probe_gb: float, state_dir: str) -> None:
    """A ValueError when --measure's probes would not fit: the DRAM probe holds two
    buffers of --probe-gb (at most half the RAM available: a larger one swapped, or the
    kernel killed the planner), the disk's a file of it (at most half the free space)."""
    from .engine.host_memory import available_host_bytes
    available = available_host_bytes()
    if available is not None and 2 * probe_gb * GB > available / 2:
        raise ValueError(f"--probe-gb {probe_gb:g}: the memory probe holds 2 x {probe_gb:g} GB, "
                         f"more than half of the {available / GB:.1f} GB of RAM available; at "
                         f"most {available / 4 / GB:.3g}")
    free = shutil.disk_usage(state_dir).free
    if probe_gb * GB > free / 2:
        raise ValueError(f"--probe-gb {probe_gb:g}: the disk probe writes a file of {probe_gb:g} GB, "
                         f"more than half of the {free / GB:.1f} GB free in {state_dir!r}; at "
                         f"most {free / 2 / GB:.3g}")


def _machine(args) -> Machine:
    here = args.machine == "here"
    if not here:
        for flag, value in (("--measure", args.measure or None),
                            ("--state-dir", args.state_dir), ("--probe-gb", args.probe_gb)):
            if value is not None:
                raise ValueError(f"{flag} is about this machine: give --machine here")
        if args.machine not in MACHINES:
            raise ValueError(f"--machine {args.machine!r}: one of {', '.join(MACHINES)} or "
                             "'here'")
        machine = MACHINES[args.machine]
    else:
        state_dir = args.state_dir or "."
        if not os.path.isdir(state_dir):
            raise ValueError(f"--state-dir {state_dir!r}: no such directory")
        if args.probe_gb is not None and not args.measure:
            raise ValueError("--probe-gb sizes --measure's probes: give --measure")
        probe_gb = 1.0 if args.probe_gb is None else args.probe_gb
        if not _positive(probe_gb) or probe_gb * GB < 16 * _MB:
            raise ValueError(f"--probe-gb: at least 0.017 (16 MiB), got {probe_gb:g}")
        if args.measure:
            _check_probe_fits(probe_gb, state_dir)
        try:
            machine = machine_here(MACHINES["desktop-24gb"], state_dir, args.measure,
                                   int(probe_gb * GB))
        except OSError as e:   # (the disk's probe: a read-only or full directory)
            raise ValueError(f"--measure: the probe in {state_dir!r} failed: {e}") from None
    for flag, key in _MACHINE_FLAGS.items():
        v = getattr(args, flag.replace("-", "_"))
        if v is not None:
            reserve = key.endswith("reserve_bytes")
            if not (_positive(v) or (reserve and v == 0)):
                want = "finite number >= 0" if reserve else "positive number"
                raise ValueError(f"--{flag}: must be a {want}, got {v:g}")
            unit = "GB" if key.endswith("bytes") else "TFLOPS" if key == "gpu_tflops" else "GB/s"
            if v > MAX_FIGURE:
                raise ValueError(f"--{flag}: at most {MAX_FIGURE:g} ({unit}), got {v:g}")
            if unit != "GB" and v < MIN_SPEED:
                raise ValueError(f"--{flag}: at least {MIN_SPEED:g} ({unit}), got {v:g}")
            v = v + 0.0   # (-0 given: 0)
            machine = replace(machine, **{key: v * GB if key.endswith("bytes") else v})
    for have, keep in (("gpu-gb", "gpu-reserve-gb"), ("ram-gb", "host-reserve-gb")):
        cap, res = (getattr(machine, _MACHINE_FLAGS[f]) / GB for f in (have, keep))
        if res >= cap:   # (nothing left to plan for: every tier's room would be negative)
            how = ("given" if getattr(args, have.replace("-", "_")) is not None else
                   "measured here" if _MACHINE_FLAGS[have] in machine.measured else
                   f"{machine.name}'s")
            raise ValueError(f"--{keep} {res:g} is not below --{have} {cap:g} ({how}): the "
                             "reserve must leave some of it to the run")
    if here:   # what is still the preset's, by the flag that gives it
        given = set(machine.measured) | {k for f, k in _MACHINE_FLAGS.items()
                                         if getattr(args, f.replace("-", "_")) is not None}
        machine = replace(machine, assumed=tuple(
            f"--{f}" for f, k in _MACHINE_FLAGS.items()
            if k not in given and not k.endswith("reserve_bytes")))
        if "gpu_bytes" not in given:
            print("offload_adam.plan: no CUDA GPU here: the GPU planned for is "
                  f"desktop-24gb's {machine.gpu_bytes / GB:.0f} GB (give --gpu-gb)",
                  file=sys.stderr)
    return machine


_RUN_FLAGS = ("batch", "seq", "micro", "prefetch", "bucket_mb", "state_budget_mb",
              "param_cache_mb", "state_dirs")


def _as_flags(message: str) -> str:
    """An error of Run, check_size or param_files.cache_slots, which name the keywords
    (`bucket_mb must be ...`, `prefetch=2 needs ...`), with the command line's flags
    (`--bucket-mb must be ...`, `--prefetch 2 needs ...`)."""
    for key in _RUN_FLAGS:
        message = re.sub(rf"(?<![\w-]){key}(?![\w-])(=(?=\S))?",
                         lambda m, k=key: f"--{k.replace('_', '-')}" + (" " if m.group(1) else ""),
                         message)
    return message


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    out = tmp = None
    try:
        model = _model(args)
        machine = _machine(args)
        try:   # (the API's errors, which name its keywords, told with the flags)
            run = Run(args.batch, args.seq, args.micro, not args.no_checkpointing,
                      args.prefetch, args.bucket_mb, args.state_budget_mb,
                      param_cache_mb=args.param_cache_mb, state_dirs=args.state_dirs)
            check_size(model, run)
            if args.param_cache_mb is not None:   # (refused here, as stream_params would)
                from .param_files import cache_slots
                cache_slots(args.param_cache_mb * 2**20, param_slot_bytes(model),
                            args.prefetch, model.layers)
        except ValueError as e:
            raise ValueError(_as_flags(str(e))) from None
        if args.json is not None:   # opened first: a path that cannot be written is said
            if not args.json:       # before the work
                raise ValueError("--json '': give a path (or /dev/stdout)")
            if os.path.isdir(args.json):
                raise ValueError(f"--json {args.json!r}: a directory")
            # A file: written beside it, then put in its place (a failure leaves no truncated
            # file), through a symlink beside its target (the link stays). Anything else (a
            # FIFO, a device) is written into: put in its place, a regular file replaced
            # it, and as root even a device node (found from outside). So is a stream of
            # this process (/dev/stdout, /dev/fd/N, /proc/self/fd/N), appended to after the
            # report: a shell's `> out.txt` behind it is a regular file, which was replaced
            # by the JSON alone, the report and what the file held before lost (found from
            # outside)
            final = os.path.realpath(args.json)
            stream = os.path.abspath(args.json).startswith(("/dev/", "/proc/"))
            direct = os.path.exists(args.json) and (stream or not os.path.isfile(args.json))
            tmp = None if direct else f"{final}.{os.getpid()}.tmp"
            try:
                out = open(args.json if direct else tmp, "a" if direct else "w")
            except OSError as e:
                raise ValueError(f"--json {args.json!r}: {e.strerror}") from None
    except ValueError as e:
        print(f"offload_adam.plan: {e}", file=sys.stderr)
        return 2
    try:
        layouts = all_layouts(list(dict.fromkeys(args.state_dtype or STATE_DTYPES)))
        text, plans = report(model, machine, run, layouts, args.detail)
        print(text, flush=True)   # (before the JSON: --json may be this stream)
        if out is not None:
            try:
                with out:
                    json.dump({"machine": asdict(machine), "run": asdict(run), "plans": plans},
                              out, indent=1)
                    out.write("\n")
                if tmp is not None:
                    os.replace(tmp, final)
            except OSError as e:   # (the disk filled, say)
                print(f"offload_adam.plan: --json {args.json!r}: {e}", file=sys.stderr)
                return 2
            tmp = None
    finally:   # (an error or an interrupt midway: the --json path as it was, no temporary)
        if out is not None:
            out.close()
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())

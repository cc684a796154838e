"""How the Adam moments are stored: state_dtype = float32, bfloat16 or "8bit".

The CPU step moves every byte of the state once per step and is bound by memory
bandwidth, so fewer bytes per param is a faster step and a larger model in the
same host RAM. The master stays fp32 in every format (DeepSeek-V3's recipe for
bf16 moments); only exp_avg and exp_avg_sq (and amsgrad's max) shrink:

  format    state per param (master + moments)   step traffic   csrc/adam_kernels.h
  float32   4 + 8 = 12 B                          28 B           torch's format
  bfloat16  4 + 4 =  8 B                          20 B           m and v rounded stochastically
  "8bit"    4 + 2 + 8/256 = ~6 B                  ~16 B          blockwise: uint8 codes and one fp32
                                                                 scale per 256 elements per moment

In optimizer.state[p] a moment is kept in its stored form: a bfloat16 tensor, or
uint8 codes shaped like the param plus "exp_avg_scale"/"exp_avg_sq_scale" (fp32,
ceil(numel / 256)). state_dict() saves that form (a checkpoint resumes bit for
bit), 8-bit codes under their own keys, "exp_avg_codes"/"exp_avg_sq_codes":
torch.optim.AdamW would take codes saved as "exp_avg" for moments (values up
to 255) and step garbage; without an "exp_avg" it fails at its first step
instead (KeyError: 'exp_avg'). state_dict(fp32_moments=True) gives fp32
moments, loadable into torch.optim.AdamW. A loaded moment in any form (fp32
from torch, bf16, 8-bit codes with scales) is converted to the optimizer's
format at the next step.
The 8-bit format has no amsgrad (its running max has no code).

The 8-bit codes have a format number, Q8_FORMAT, saved beside them in a state dict
("q8_format") and in the name of the format the NVMe tier's files record:
  1  (until issue 16's second part) exp_avg_sq stored sqrt(v) as e4m4 codes;
  2  exp_avg_sq stores v itself as e5m3 codes (its unbiased rounding is then a cheap
     dither of the bits; csrc/adam_math.h). exp_avg is e4m3 with a sign in both.
A state dict with codes and no "q8_format" is format 1: its exp_avg_sq is decoded
here (legacy_sqrt_codes_to_v) and loads as fp32, converted at the next step like any
fp32 moment. NVMe files of format 1 are refused (the tier names both formats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .kernel_step import kernels

QUANT_BLOCK = 256  # csrc/adam_kernels.h kQuantBlock; checked against the kernels in the tests
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MASTER_KEY = "master_param"  # the fp32 master of a low-precision param, in its state
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
CODE_KEYS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}  # in a state dict
Q8_FORMAT = 2               # what the 8-bit codes mean (see above)
Q8_FORMAT_KEY = "q8_format"  # in a state dict, beside the codes (a 0-dim int64 tensor)
# Every key of a param's state, as stored and in a state dict (a key not among them is the
# user's own: kept as torch's optimizers keep it)
STATE_KEYS = frozenset(("step", MASTER_KEY, Q8_FORMAT_KEY) + MOMENT_KEYS
                       + tuple(SCALE_KEYS.values()) + tuple(CODE_KEYS.values()))


def scale_len(numel: int) -> int:
    """The length of an 8-bit moment's scale array: one per block, the last one partial."""
    return -(-numel // QUANT_BLOCK)


@dataclass(frozen=True)
class StateFormat:
    name: str                  # "float32", "bfloat16", "8bit"
    moment_dtype: torch.dtype  # how one moment element is stored

    @property
    def blockwise(self) -> bool:
        return self.moment_dtype is torch.uint8

    @property
    def files_name(self) -> str:
        """The format as the NVMe tier's files record it: with the 8-bit codes' format
        number, so that files of another one are refused rather than misread."""
        return f"{self.name} (codes format {Q8_FORMAT})" if self.blockwise else self.name

    def check_amsgrad(self, amsgrad: bool, where: str) -> None:
        """amsgrad's running max of exp_avg_sq has no 8-bit code: a ValueError naming
        `where` (a group, or a param)."""
        if amsgrad and self.blockwise:
            raise ValueError(f"amsgrad=True cannot be used with state_dtype=\"8bit\" ({where}): "
                             "the running max of exp_avg_sq has no 8-bit code; use "
                             "state_dtype=torch.bfloat16 or torch.float32 with amsgrad")

    def drop_scales(self, st: dict) -> None:
        """Removes block scales from a state in a format without them (a loaded
        8-bit state converted to this one)."""
        if not self.blockwise:
            for scale in SCALE_KEYS.values():
                st.pop(scale, None)

    def zeros(self, key: str, numel: int, shape) -> Dict[str, torch.Tensor]:
        """A zero moment in this format (all-zero codes and scales are zero)."""
        out = {key: torch.zeros(shape, dtype=self.moment_dtype)}
        if self.blockwise:
            out[SCALE_KEYS[key]] = torch.zeros(scale_len(numel), dtype=torch.float32)
        return out

    def convert(self, st: dict, key: str, shape, numel: int,
                where: str = "", zeros: bool = True) -> Dict[str, torch.Tensor]:
        """st[key] (and its scale) in this format, from whatever form it holds:
        the same objects when it already is, else new CPU tensors; when st has
        none, zeros (`zeros=False`: nothing). `where` names the param in errors."""
        value = st.get(key)
        if value is None:
            return self.zeros(key, numel, shape) if zeros else {}
        value = value.detach()
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"optimizer state {key!r}{where} has shape {tuple(value.shape)}, "
                             f"expected {tuple(shape)}")
        scale = st.get(SCALE_KEYS.get(key, ""))
        if self._is_native(value, scale, numel):
            return {key: value, **({SCALE_KEYS[key]: scale} if self.blockwise else {})}
        fp32 = float32_moment(value, scale, key)
        if not self.blockwise:
            return {key: fp32.to(self.moment_dtype).contiguous()}
        return encode_8bit(key, fp32, scale_len(numel))

    def _is_native(self, value, scale, numel) -> bool:
        if value.dtype is not self.moment_dtype or value.device.type != "cpu":
            return False
        if not value.is_contiguous():
            return False
        if not self.blockwise:
            return True
        return (scale is not None and scale.dtype is torch.float32 and scale.device.type == "cpu"
                and scale.is_contiguous() and scale.numel() == scale_len(numel))


FLOAT32 = StateFormat("float32", torch.float32)
BFLOAT16 = StateFormat("bfloat16", torch.bfloat16)
EIGHT_BIT = StateFormat("8bit", torch.uint8)
_NAMES = {"float32": FLOAT32, "fp32": FLOAT32, "bfloat16": BFLOAT16, "bf16": BFLOAT16,
          "8bit": EIGHT_BIT, "int8": EIGHT_BIT}


def state_format(value) -> StateFormat:
    """state_dtype= as given by the user: torch.float32, torch.bfloat16 or "8bit"
    (or their names: "float32"/"fp32", "bfloat16"/"bf16")."""
    if isinstance(value, StateFormat):
        return value
    if value is torch.float32 or value is torch.bfloat16:
        return FLOAT32 if value is torch.float32 else BFLOAT16
    if isinstance(value, str) and value in _NAMES:
        return _NAMES[value]
    raise ValueError(f"Invalid state_dtype: {value!r}; expected torch.float32, torch.bfloat16 "
                     "or \"8bit\" (blockwise 8-bit moments)")


def float32_moment(value: torch.Tensor, scale: Optional[torch.Tensor], key: str) -> torch.Tensor:
    """A moment in any stored form as a new fp32 CPU tensor of its shape."""
    value = value.detach()
    if value.dtype is not torch.uint8:
        return value.to("cpu", torch.float32, copy=True).contiguous()
    if key not in SCALE_KEYS:
        raise ValueError(f"optimizer state {key!r} holds 8-bit codes, which only exp_avg "
                         "and exp_avg_sq can have")
    blocks = scale_len(value.numel())
    if scale is None or scale.numel() != blocks:
        raise ValueError(f"optimizer state {key!r} holds 8-bit codes but "
                         f"{SCALE_KEYS[key]!r} is missing or not {blocks} long")
    out = torch.empty(value.shape, dtype=torch.float32)
    kernels().q8_decode(value.to("cpu").contiguous(), scale.to("cpu", torch.float32).contiguous(),
                        out, key == "exp_avg_sq")
    return out


def encode_8bit(key: str, fp32: torch.Tensor, blocks: int) -> Dict[str, torch.Tensor]:
    codes = torch.empty(fp32.shape, dtype=torch.uint8)
    scale = torch.empty(blocks, dtype=torch.float32)
    kernels().q8_encode(fp32.contiguous(), codes, scale, key == "exp_avg_sq")
    return {key: codes, SCALE_KEYS[key]: scale}


def _holds_codes(k, v) -> bool:
    return k in CODE_KEYS and isinstance(v, torch.Tensor) and v.dtype is torch.uint8


def with_code_keys(st: dict) -> dict:
    """A param's state as a state dict saves it: 8-bit codes under CODE_KEYS, and
    their format number."""
    out = {CODE_KEYS[k] if _holds_codes(k, v) else k: v for k, v in st.items()}
    if any(_holds_codes(k, v) for k, v in st.items()):
        out[Q8_FORMAT_KEY] = torch.tensor(Q8_FORMAT)
    return out


def stored_key(key: str) -> str:
    """The state key of a state dict's key (CODE_KEYS back to the moments')."""
    return next((k for k, c in CODE_KEYS.items() if c == key), key)


def stored_state(saved: dict, where: str = "") -> dict:
    """A param's state from a state dict, under the state's keys (stored_key), its
    8-bit codes in the current format: format 1's exp_avg_sq (no "q8_format" beside
    the codes) becomes fp32 v. A format this version does not know is refused.
    `where` names the param in errors."""
    out = {stored_key(k): v for k, v in saved.items() if k != Q8_FORMAT_KEY}
    version = int(saved.get(Q8_FORMAT_KEY, 1))
    codes = saved.get(CODE_KEYS["exp_avg_sq"])
    if not isinstance(codes, torch.Tensor) or codes.dtype is not torch.uint8 or version == Q8_FORMAT:
        return out
    if version != 1:
        raise ValueError(f"optimizer state{where} holds 8-bit codes of format {version!r} "
                         f"(q8_format); this version of offload_adam reads formats 1 and "
                         f"{Q8_FORMAT}: save the state with state_dict(fp32_moments=True) "
                         "where it was made, and load that")
    scale = out.pop(SCALE_KEYS["exp_avg_sq"], None)
    blocks = scale_len(codes.numel())
    if scale is None or scale.numel() != blocks:
        raise ValueError(f"optimizer state 'exp_avg_sq'{where} holds 8-bit codes but "
                         f"'exp_avg_sq_scale' is missing or not {blocks} long")
    out["exp_avg_sq"] = legacy_sqrt_codes_to_v(codes, scale)
    return out


def legacy_sqrt_codes_to_v(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """exp_avg_sq from 8-bit codes of format 1 (sqrt(v) as e4m4, relative to its block's
    scale: code c > 0 is the float with bits (c << 19) + bits(2^-16)), as fp32 v."""
    c = codes.detach().to("cpu").reshape(-1).to(torch.int32)
    root = torch.where(c > 0, ((c << 19) + (111 << 23)).view(torch.float32), torch.zeros(()))
    blocks = scale.detach().to("cpu", torch.float64).repeat_interleave(QUANT_BLOCK)[: c.numel()]
    root = root.double() * blocks
    return (root * root).float().reshape(codes.shape)


def with_float32_moments(st: dict) -> dict:
    """A param's state with every moment as fp32 and no scales (torch's format)."""
    out = {k: v for k, v in st.items() if k not in SCALE_KEYS.values()}
    for key in MOMENT_KEYS:
        value = st.get(key)
        if isinstance(value, torch.Tensor) and value.dtype is not torch.float32:
            out[key] = float32_moment(value, st.get(SCALE_KEYS.get(key, "")), key)
    return out

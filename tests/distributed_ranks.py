"""One rank of the FSDP2 tests (tests/test_distributed.py starts two, gloo on CPU).

    python tests/distributed_ranks.py RANK WORLD PORT OUT_DIR SCENARIO...

Runs each named scenario on this rank and writes OUT_DIR/rank{RANK}.json after
each one: {scenario: {"ok": true, ...measurements} or {"ok": false, "error": ...}}.
The test file asserts on the measurements. Every scenario trains a small
FSDP2 model (fully_shard per Linear, then the root) on data that differs per
rank; its dims are uneven on purpose (15 rows over 2 ranks: 8 and 7; a head
of one row: rank 1 holds an empty shard). A scenario whose name ends in
"_engine" builds offload_adam's optimizer inside offload_adam.testing.simulated(), so
its params go through the offload engine on the asynchronous simulated device
(the GPU's path), checked for ordering violations; the others step in place.
"""

import copy
import json
import math
import os
import shutil
import signal
import sys
import time
import traceback
import warnings
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import offload_adam
from engine_watch import hooked   # (tests/ is sys.path[0]: this script runs from there)

BF16 = torch.bfloat16
LR, WD, CLIP = 1e-2, 0.1, 0.5
SCENARIOS = {}


def scenario(*variants):
    """Registers fn as scenario NAME, or as NAME_VARIANT for each variant
    (fn receives the variant)."""
    def register(fn):
        if not variants:
            SCENARIOS[fn.__name__] = fn
        for v in variants:
            SCENARIOS[f"{fn.__name__}_{v}"] = lambda v=v: fn(v)
        return fn
    return register


# ---- models, data, training -------------------------------------------------

def build(dtype=torch.float32, seed=0, mixed=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(), torch.nn.Linear(15, 6),
                                torch.nn.Tanh(), torch.nn.Linear(6, 1)).to(dtype)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)} if mixed else {}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(6, 8, generator=g) * 3


def backward(model, step, micro=0):
    dtype = next(model.parameters()).dtype
    model(batch(step, micro).to(dtype)).float().pow(2).mean().backward()


def train(model, opt, steps, start=0, micro=1, torch_clip=None, before_step=None):
    for it in range(start, start + steps):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            backward(model, it, m)
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()


class Engine:
    """Builds offload_adam optimizers on the simulated device ("engine") or in
    place, and runs training under the device's watch."""

    def __init__(self, engine):
        self.sim = None
        if engine:
            from offload_adam.testing import AsyncSimDevice
            self.sim = AsyncSimDevice(seed=dist.get_rank(), latency="random")

    def optimizer(self, params, **kw):
        kw = {"lr": LR, "weight_decay": WD, **kw}
        if self.sim is None:
            return offload_adam.AdamW(params, **kw)
        from offload_adam.testing import simulated
        with simulated(self.sim):
            opt = offload_adam.AdamW(params, **kw)
        # the engine took every param: it holds host memory before any step (in
        # place nothing is held until then) and, with overlap, hooks each
        # trainable param (to copy its grad in backward)
        params = [p for g in opt.param_groups for p in g["params"]]
        assert opt.host_bytes() > 0
        assert not kw.get("overlap", True) or all(hooked(p) for p in params if p.requires_grad)
        return opt

    def watch(self):
        return self.sim.watch() if self.sim is not None else nullcontext()

    def close(self):
        if self.sim is not None:
            self.sim.check()
            self.sim.close()


def shard(t):
    return t.to_local() if isinstance(t, DTensor) else t


def diff(xs, ys):
    """Max abs and max relative (to max |y|) difference of two lists of tensors."""
    abs_, ref = 0.0, 0.0
    for x, y in zip(xs, ys):
        x, y = shard(x).double(), shard(y).double()
        if x.numel():
            abs_ = max(abs_, (x - y).abs().max().item())
            ref = max(ref, y.abs().max().item())
    return {"max_abs": abs_, "max_rel": abs_ / ref if ref else 0.0}


def state_list(opt, model, keys=("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale",
                                  "master_param", "step")):
    return [shard(opt.state[p][k]) for p in model.parameters() for k in keys
            if k in opt.state.get(p, {})]


def bitwise(a, b):
    (m1, o1), (m2, o2) = a, b
    params = all(torch.equal(shard(p), shard(q)) for p, q in zip(m1.parameters(), m2.parameters()))
    s1, s2 = state_list(o1, m1), state_list(o2, m2)
    state = len(s1) == len(s2) and all(torch.equal(x, y) for x, y in zip(s1, s2))
    return {"params_bitwise": params, "state_bitwise": state, "state_entries": len(s1),
            "params_diff": diff(list(m1.parameters()), list(m2.parameters()))}


# ---- fp32 params and mixed precision: against torch.optim.AdamW under FSDP2 ------

@scenario("inplace", "engine", "mixed", "accumulate", "accumulate_engine")
def against_torch(variant):
    """offload_adam (max_grad_norm=) and torch AdamW (clip_grad_norm_ on the DTensor
    grads) on twin FSDP2 models, same data."""
    mixed, engine = variant == "mixed", variant.endswith("engine")
    micro = 3 if variant.startswith("accumulate") else 1
    ours, theirs = build(mixed=mixed), build(mixed=mixed)
    dev = Engine(engine)
    opt = dev.optimizer(ours.parameters(), max_grad_norm=CLIP)
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=WD)
    norms = []
    with dev.watch():
        for it in range(4):
            for mm, o in ((ours, opt), (theirs, ref)):
                for m in range(micro):
                    mm.set_requires_gradient_sync(m == micro - 1)
                    backward(mm, it, m)
            norms.append(float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), CLIP)))
            opt.step(), ref.step()
            opt.zero_grad(), ref.zero_grad()
    dev.close()
    keys = ("exp_avg", "exp_avg_sq")
    return {"params": diff(list(ours.parameters()), list(theirs.parameters())),
            "moments": diff(state_list(opt, ours, keys), state_list(ref, theirs, keys)),
            "torch_norms": norms,
            "local_shapes": [list(shard(p).shape) for p in ours.parameters()]}


# ---- bf16 params: against an fp32-master reference --------------------------------

# Engine options that change where a grad lives between backward and step().
GRAD_PLACES = {"engine": {}, "engine_freed": {"free_grads_after_copy": True},
               "engine_no_overlap": {"overlap": False}}


class GradTwin:
    """For free_grads_after_copy (p.grad is None after backward): a twin of the
    model given the same params before each backward, whose grads the
    reference reads. Without it, the model's own grads."""

    def __init__(self, model, freed):
        self.model = model
        self.twin = build(next(model.parameters()).dtype) if freed else None

    def backward(self, step):
        if self.twin is not None:
            with torch.no_grad():
                for p, q in zip(self.model.parameters(), self.twin.parameters()):
                    shard(q).copy_(shard(p))
            self.twin.zero_grad()
            backward(self.twin, step)

    def grads(self):
        return [shard(p.grad) for p in (self.twin or self.model).parameters()]


@scenario("inplace", *GRAD_PLACES)
def bf16_master(variant):
    """A bf16 FSDP2 model stepped by offload_adam (max_grad_norm=) against torch
    AdamW on fp32 copies of each rank's shards fed the same grads, clipped by
    the global norm computed here."""
    model = build(BF16)
    dev = Engine(variant != "inplace")
    opt = dev.optimizer(model.parameters(), max_grad_norm=CLIP, **GRAD_PLACES.get(variant, {}))
    twin = GradTwin(model, variant == "engine_freed")
    masters = [shard(p).detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=LR, weight_decay=WD)
    step = [0]

    def reference_step():
        twin.backward(step[0])
        step[0] += 1
        grads = [g.float() for g in twin.grads()]
        sq = torch.tensor([sum(g.double().pow(2).sum().item() for g in grads)], dtype=torch.float64)
        dist.all_reduce(sq)
        coef = min(1.0, CLIP / (math.sqrt(sq.item()) + 1e-6))
        for m, g in zip(masters, grads):
            m.grad = g * coef
        ref.step()

    with dev.watch():
        train(model, opt, 4, before_step=reference_step)
    dev.close()
    ours = [opt.state[p]["master_param"] for p in model.parameters()]
    rounded = [m.detach().to(BF16) for m in masters]
    mismatch = sum(int((shard(p) != r).sum()) for p, r in zip(model.parameters(), rounded))
    return {"master": diff(ours, masters),
            "params": diff(list(model.parameters()), rounded),
            "bf16_elements_differing": mismatch,
            "elements": sum(shard(p).numel() for p in model.parameters())}


# ---- clipping: the global norm ---------------------------------------------------

@scenario("inplace", *GRAD_PLACES)
def clip_norm(variant):
    """opt.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the same
    DTensor grads, and each rank's local norm."""
    model = build(BF16 if variant != "inplace" else torch.float32)
    dev = Engine(variant != "inplace")
    opt = dev.optimizer(model.parameters(), **GRAD_PLACES.get(variant, {}))
    twin = GradTwin(model, variant == "engine_freed")
    with dev.watch():
        twin.backward(0)
        backward(model, 0)
        grads = twin.grads()
        sq = torch.tensor([sum(g.double().pow(2).sum().item() for g in grads)],
                          dtype=torch.float64)
        local = math.sqrt(sq.item())
        dist.all_reduce(sq)
        # torch's first: its clip multiplies the grads in place (by 1 here: max_norm 1e9),
        # which after ours is a change of the grads ours was taken of (refused at step(),
        # on a GPU; and on the simulated device since its watch bumps foreach versions)
        theirs = torch.nn.utils.clip_grad_norm_((twin.twin or model).parameters(), 1e9)
        ours = opt.clip_grad_norm_(1e9)
        opt.step()
    dev.close()
    return {"ours": float(ours), "theirs": float(theirs), "local": local,
            "float64": math.sqrt(sq.item()),
            "ours_type": type(ours).__name__, "theirs_type": type(theirs).__name__,
            "ours_placements": str(getattr(ours, "placements", None)),
            "theirs_placements": str(getattr(theirs, "placements", None))}


@scenario("inplace", "engine")
def ddp(variant):
    """DistributedDataParallel (each rank a replica, plain params): the grads are copied
    at step(), after DDP averaged them (overlap off: no param hooked), so the ranks stay
    bitwise equal and follow torch; step_in_backward and free_grads_after_copy, which
    took each rank's own grads in backward (the ranks drifted apart; DDP read a freed
    grad), are refused when built."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    eng = Engine(variant == "engine")

    def make():
        torch.manual_seed(0)
        return DDP(torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(),
                                       torch.nn.Linear(15, 1)))
    ours, ref = make(), make()
    if eng.sim is not None:
        from offload_adam.testing import simulated
        with simulated(eng.sim):
            opt = offload_adam.AdamW(ours.parameters(), lr=LR, weight_decay=WD)
    else:
        opt = offload_adam.AdamW(ours.parameters(), lr=LR, weight_decay=WD)
    theirs = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    with eng.watch():
        for it in range(3):
            for model, o in ((ours, opt), (ref, theirs)):
                model(batch(it)).float().pow(2).mean().backward()
                o.step()
                o.zero_grad()
    refused = {}
    for name in ("step_in_backward", "free_grads_after_copy"):
        try:
            offload_adam.AdamW(ours.parameters(), **{name: True})
        except ValueError as e:
            refused[name] = str(e)
    # The same state_dirs on both ranks: one rank holds them, the other is refused at
    # their lock, saying each rank needs its own (no collective when built: a replica's
    # optimizer may be one rank's own); a folder of each rank's is taken.
    shared = os.path.join(OUT_DIR, f"ddp_shared_{variant}")
    os.makedirs(shared, exist_ok=True)
    held = None
    try:
        held = offload_adam.AdamW(ours.parameters(), state_dirs=shared)
    except RuntimeError as e:
        refused["state_dirs"] = str(e)
    dist.barrier()   # (both tried while the first held them)
    if held is not None:
        held.close()
    own = os.path.join(shared, f"rank{dist.get_rank()}")
    os.makedirs(own, exist_ok=True)
    offload_adam.AdamW(ours.parameters(), state_dirs=own).close()
    if eng.sim is not None:   # built before the process group (seen as one process):
        from unittest import mock   # refused at step(), saying so
        from offload_adam.testing import simulated
        late_model = make()
        with simulated(eng.sim), mock.patch.object(dist, "is_initialized", lambda: False):
            late = offload_adam.AdamW(late_model.parameters(), lr=LR, step_in_backward=True)
        late_model(batch(0)).float().pow(2).mean().backward()
        try:
            late.step()
        except ValueError as e:
            refused["built before the process group"] = str(e)
        try:   # (says what stays of the steps begun in backward)
            late.zero_grad()
        except RuntimeError:
            pass
        late.close()
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(both, flat)
    out = {"ranks_equal": all(torch.equal(both[0], b) for b in both),
           "hooked": any(hooked(p) for p in ours.parameters()), "refused": refused,
           **diff(list(ours.parameters()), list(ref.parameters()))}
    opt.close()
    eng.close()
    return out


@scenario("two_generations", "compact")
def ddp_resume(footprint):
    """DistributedDataParallel, each rank its own state_dirs: with two generations, ranks
    whose files are at different steps (rank 0 stepped once more alone: a kill between
    the ranks' commits) resume from one step, as FSDP2's ranks do, rank 0 going back (rank
    1 refused DDP's broadcast params as changed, rank 0 died in gloo: found from outside);
    compact ranks resume together. And an optimizer state of another step loaded after
    the resume is refused on every rank although DDP's broadcast wrote the params (it was
    taken: two steps mixed)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    folder = os.path.join(OUT_DIR, f"ddp_resume_{footprint}", f"rank{rank}")
    os.makedirs(folder, exist_ok=True)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(),
                                   torch.nn.Linear(15, 1)).to(BF16)
    kw = dict(lr=LR, weight_decay=WD, bucket_mb=0.0005, state_footprint=footprint)
    model = make()
    opt = offload_adam.AdamW(model.parameters(), state_dirs=folder, **kw)
    net = DDP(model)
    saved = None
    for it in range(3):
        net(batch(it).to(BF16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if it == 0:
            saved = copy.deepcopy(opt.state_dict())
    at_three = [p.detach().clone() for p in model.parameters()]
    if rank == 0 and footprint == "two_generations":   # one step more, alone (no DDP):
        model(batch(3).to(BF16)).float().pow(2).mean().backward()   # its files at step 4
        opt.step()   # (compact steps in step with the other ranks: a collective each step)
    opt.close()
    out = {}
    again = make()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ropt = offload_adam.AdamW(again.parameters(), state_dirs=folder, state_resume=True,
                                      **kw)
        out["warned"] = [str(w.message) for w in seen if "resume from step" in str(w.message)]
    except ValueError as e:
        out["refused_resume"] = str(e)
        dist.barrier()
        return out
    out["step_count"] = ropt.step_count
    DDP(again)   # (its broadcast writes rank 0's params into every rank's)
    out["at_three"] = all(torch.equal(p, q) for p, q in zip(again.parameters(), at_three))
    try:
        ropt.load_state_dict(saved)
        out["mixed_loaded"] = True
    except ValueError as e:
        out["mixed_loaded"] = str(e)
    ropt.close()
    return out


@scenario()
def clip_process_group():
    """Plain params a user sharded by hand: process_group= sums over the ranks."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    ps = [torch.randn(5, 3, generator=g).requires_grad_() for _ in range(2)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * (rank + 1)
    sq = torch.tensor([sum(p.grad.double().pow(2).sum().item() for p in ps)], dtype=torch.float64)
    local = math.sqrt(sq.item())
    dist.all_reduce(sq)
    ours = offload_adam.AdamW(ps, process_group=dist.group.WORLD).clip_grad_norm_(1.0)
    alone = offload_adam.AdamW(ps).clip_grad_norm_(1.0)
    return {"ours": float(ours), "expected": math.sqrt(sq.item()), "local": local,
            "without_group": float(alone)}


# ---- checkpoints: saved, resumed, bitwise ------------------------------------------

@scenario()
def state_layout():
    """opt.state_dict() shows a DTensor param's state as DTensors of its layout,
    over the optimizer's own state tensors."""
    model = build(BF16)
    opt = offload_adam.AdamW(model.parameters())
    train(model, opt, 1)
    p = next(model.parameters())
    st = opt.state_dict()["state"][0]
    dts = [v for k, v in st.items() if k != "step"]
    return {"types": {k: type(v).__name__ for k, v in st.items()},
            "same_layout_as_param": all(
                (v.device_mesh, v.placements, v.shape) == (p.device_mesh, p.placements, p.shape)
                for v in dts),
            "local_is_the_state": all(st[k].to_local().data_ptr() == opt.state[p][k].data_ptr()
                                      for k in st if k != "step")}


def roundtrip_bytes(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def make_resume(how):
    """The resume scenario for one way of saving and loading."""
    def run(variant):
        dtype = BF16 if variant.startswith("bf16") else torch.float32
        engine = variant.endswith("engine")
        kw = {"max_grad_norm": CLIP}
        for name, state_dtype in (("bf16moments", BF16), ("8bit", "8bit")):
            if name in variant:
                kw["state_dtype"] = state_dtype
        dev = Engine(engine)
        model = build(dtype)
        opt = dev.optimizer(model.parameters(), **kw)
        out = {}
        with dev.watch():
            train(model, opt, 3)
            saved = save(how, model, opt, out)
            fresh = build(dtype, seed=7)
            fopt = dev.optimizer(fresh.parameters(), **kw)
            load(how, fresh, fopt, saved)
            train(model, opt, 3, start=3)
            train(fresh, fopt, 3, start=3)
        dev.close()
        out.update(bitwise((model, opt), (fresh, fopt)))
        return out
    return run


def save(how, model, opt, out):
    if how == "plain":
        # The params are cloned first: torch.save reads a tensor's bytes outside
        # torch's dispatch, where the simulated device cannot order the read
        # after the step's last copies into the params (on a GPU, saving copies
        # them to the host on the current stream, after those copies).
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return roundtrip_bytes({"model": params, "optim": opt.state_dict()})
    if how == "dcp":
        msd, osd = get_state_dict(model, opt)
        out["saved_state_types"] = sorted({type(v).__name__ for st in osd["state"].values()
                                           for k, v in st.items() if k != "step"})
        path = os.path.join(OUT_DIR, f"dcp_{id(model)}_{dist.get_rank()}")
        obj = [path]
        dist.broadcast_object_list(obj, src=0)   # one folder for both ranks
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=obj[0])
        return obj[0]
    if how == "full":
        options = StateDictOptions(full_state_dict=True)
        msd, osd = get_state_dict(model, opt, options=options)
        return copy.deepcopy({"model": msd, "optim": osd})
    if how == "broadcast":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(model, opt, options=options)
        out["rank_holds_full_state"] = bool(osd)
        return copy.deepcopy({"model": msd, "optim": osd})
    raise ValueError(how)


def load(how, model, opt, saved):
    if how == "plain":
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    elif how == "dcp":
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=saved)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    elif how == "full":
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                       options=StateDictOptions(full_state_dict=True))
    elif how == "broadcast":
        # One call each: set_state_dict would skip the model on the ranks that
        # pass an empty model state dict (optim_only), while rank 0 broadcasts.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, saved["model"], options=options)
        set_optimizer_state_dict(model, opt, saved["optim"], options=options)


# resume_HOW_VARIANT: train 3 steps, save (HOW), train 3 more; a fresh model and
# optimizer load the checkpoint and train the same 3: bitwise equal.
for _how, _variants in (("plain", ("fp32", "bf16", "bf16_engine")),
                        ("dcp", ("fp32", "bf16", "bf16_engine", "bf16_bf16moments",
                                 "bf16_bf16moments_engine", "bf16_8bit", "bf16_8bit_engine")),
                        ("full", ("bf16", "bf16_engine")),
                        ("broadcast", ("fp32", "bf16", "bf16_engine"))):
    for _v in _variants:
        SCENARIOS[f"resume_{_how}_{_v}"] = (lambda run, v: lambda: run(v))(make_resume(_how), _v)


# ---- the NVMe tier under FSDP2: each rank its own files ----------------------------

def state_shards(opt):
    """Every tensor of opt's state dict as this rank's shard, in a fixed order (a tier's
    state is in its files, not in opt.state)."""
    st = opt.state_dict()["state"]
    return [shard(v) for i in sorted(st) for _, v in sorted(st[i].items())]


def same_run(a, b):
    (m1, o1), (m2, o2) = a, b
    s1, s2 = state_shards(o1), state_shards(o2)
    return (all(torch.equal(shard(p), shard(q)) for p, q in zip(m1.parameters(), m2.parameters()))
            and len(s1) == len(s2) > 0 and all(torch.equal(x, y) for x, y in zip(s1, s2)))


@scenario("fp32", "bf16", "bf16_engine", "bf16_8bit")
def nvme(variant):
    """state_dirs= under FSDP2, both ranks given the same directories: each rank's files in
    its own folder; bitwise the RAM optimizer; a DCP checkpoint of the disk state loaded into
    a fresh model on new directories trains on bitwise; a state dict without masters (as
    from torch's AdamW) loaded before the model gives the masters of the params loaded after
    it, as in RAM; a resumed tier restores the shards."""
    dtype = BF16 if variant.startswith("bf16") else torch.float32
    kw = {"max_grad_norm": CLIP, "bucket_mb": 0.0005}
    if variant.endswith("8bit"):
        kw["state_dtype"] = "8bit"
    dev = Engine(variant.endswith("engine"))
    base = [os.path.join(OUT_DIR, f"nvme_{variant}")]
    dist.broadcast_object_list(base, src=0)
    folders = {k: os.path.join(base[0], k) for k in ("a", "b", "c")}
    for f in folders.values():
        os.makedirs(f, exist_ok=True)
    ram_model, disk_model = build(dtype), build(dtype)
    ram = dev.optimizer(ram_model.parameters(), **kw)
    disk = dev.optimizer(disk_model.parameters(), state_dirs=folders["a"], **kw)
    out = {}
    with dev.watch():
        train(ram_model, ram, 3)
        train(disk_model, disk, 3)
        msd, osd = get_state_dict(disk_model, disk)
        path = os.path.join(base[0], "dcp")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        no_masters = {**osd, "state": {k: {key: v for key, v in st.items() if key != "master_param"}
                                       for k, st in osd["state"].items()}}
        late = []   # in RAM and on disk
        for dirs in (None, folders["c"]):
            model = build(dtype, seed=11)
            opt = dev.optimizer(model.parameters(), **({"state_dirs": dirs} if dirs else {}), **kw)
            set_optimizer_state_dict(model, opt, optim_state_dict=no_masters)   # first,
            set_model_state_dict(model, msd)   # then the params the masters start from
            late.append((model, opt))
        fresh = build(dtype, seed=7)
        fopt = dev.optimizer(fresh.parameters(), state_dirs=folders["b"], **kw)
        msd, osd = get_state_dict(fresh, fopt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for m, o in ((ram_model, ram), (disk_model, disk), (fresh, fopt), *late):
            train(m, o, 3, start=3)
        out["disk_bitwise"] = same_run((ram_model, ram), (disk_model, disk))
        out["dcp_bitwise"] = same_run((ram_model, ram), (fresh, fopt))
        out["optimizer_first_bitwise"] = same_run(*late)
        disk.close()   # its files and lock: the resumed optimizer opens them
        again_model = build(dtype, seed=9)
        again = dev.optimizer(again_model.parameters(), state_dirs=folders["a"],
                              state_resume=True, **kw)
        out["resume_bitwise"] = same_run((ram_model, ram), (again_model, again))
        train(ram_model, ram, 1, start=6)
        train(again_model, again, 1, start=6)
        out["resumed_steps_bitwise"] = same_run((ram_model, ram), (again_model, again))
    dev.close()
    dist.barrier()
    out["rank_folders"] = sorted(os.listdir(folders["a"]))
    return out


def step_counts(opt) -> list:
    """Every rank's opt.step_count, in rank order."""
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, opt.step_count)
    return counts


def _files_of_a_run(name: str, steps: int) -> list:
    """[the directory] every rank's state files are in after `steps` steps of build()'s
    model (each rank's in its rank<R> folder), the optimizer closed."""
    base = [os.path.join(OUT_DIR, name)]
    dist.broadcast_object_list(base, src=0)
    os.makedirs(base[0], exist_ok=True)
    model = build()
    opt = offload_adam.AdamW(model.parameters(), lr=LR, bucket_mb=0.0005, state_dirs=base[0])
    train(model, opt, steps)
    opt.close()
    dist.barrier()
    return base


@scenario()
def nvme_one_rank_refused():
    """Rank 0's folder holds a state of another layout (without amsgrad), rank 1's none
    (as when resuming with more ranks than made the files): rank 0 refuses its files,
    and rank 1 raises too, naming rank 0's refusal, instead of waiting in a collective
    that rank 0 never joins."""
    base = _files_of_a_run("nvme_one_rank_refused", 1)
    if dist.get_rank() == 1:
        mine = os.path.join(base[0], "rank1")
        for name in os.listdir(mine):
            os.remove(os.path.join(mine, name))
    dist.barrier()
    out = {}
    try:
        offload_adam.AdamW(build().parameters(), lr=LR, bucket_mb=0.0005, state_dirs=base[0],
                           state_resume=True, amsgrad=True)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    dist.barrier()   # (both ranks here: the next scenario's collectives line up)
    return out


@scenario()
def nvme_damaged_on_one_rank():
    """Rank 1's data file is damaged after the run (every byte past its header flipped):
    the resume's restore, which runs after the ranks agreed on the step, finds it there.
    Rank 1 raises, and rank 0 too, naming rank 1's refusal, instead of going on into its
    first step's collectives (found from outside: gloo's timeout, naming nothing)."""
    base = _files_of_a_run("nvme_damaged_on_one_rank", 2)
    if dist.get_rank() == 1:
        with open(os.path.join(base[0], "rank1", "offload_adam_state.bin"), "r+b") as f:
            f.seek(4096)
            data = f.read()
            f.seek(4096)
            f.write(bytes(b ^ 0xFF for b in data))
    dist.barrier()
    out = {}
    try:
        offload_adam.AdamW(build().parameters(), lr=LR, bucket_mb=0.0005, state_dirs=base[0],
                           state_resume=True)
        out["error"] = None
    except Exception as e:   # noqa: BLE001 -- reported
        out["error"] = f"{type(e).__name__}: {e}"
    dist.barrier()   # (both ranks here: the next scenario's collectives line up)
    return out


@scenario()
def resume_refused_before_the_files():
    """Refusals on rank 1 before its state files were opened, where rank 0 goes on to open
    its own and waits there: DDP replicas resuming (plain params) with rank 1's directory
    missing, and params sharded by hand (process_group=) whose engine rank 1 cannot make
    after the ranks compared their options. Rank 0 raises naming rank 1's refusal
    (found from outside: it waited for the process group's timeout, or got gloo's
    'Connection closed by peer')."""
    base = [os.path.join(OUT_DIR, "resume_refused_before_the_files")]
    dist.broadcast_object_list(base, src=0)
    rank = dist.get_rank()
    out = {}
    mine = os.path.join(base[0], f"replica{rank}")
    if rank == 0:
        os.makedirs(mine, exist_ok=True)
    plain = lambda dtype=torch.float32: torch.nn.Linear(8, 3).to(dtype)   # noqa: E731
    try:   # (plain params under several ranks, no process_group=: replicas)
        offload_adam.AdamW(plain().parameters(), lr=LR, state_dirs=mine, state_resume=True)
        out["ddp"] = None
    except (ValueError, RuntimeError) as e:
        out["ddp"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    os.makedirs(base[0], exist_ok=True)
    real = offload_adam.optimizer.OffloadEngine

    def refused(*args, **kw):
        raise RuntimeError("no page-locked memory left (as cudaHostAlloc says)")
    if rank == 1:
        offload_adam.optimizer.OffloadEngine = refused
    try:
        offload_adam.AdamW(plain(BF16).parameters(), lr=LR, state_dirs=base[0],
                           process_group=dist.group.WORLD,
                           step_in_backward=True)   # (bf16 on the CPU, early: the engine)
        out["engine"] = None
    except (ValueError, RuntimeError) as e:
        out["engine"] = f"{type(e).__name__}: {e}"
    finally:
        offload_adam.optimizer.OffloadEngine = real
    dist.barrier()
    return out


@scenario("two_generations", "compact")
def step_failed_on_one_rank(footprint):
    """Rank 1's lock file removed between steps (its files refuse to commit the next): its
    step() raises, and rank 0's too, naming it, instead of going on to the next forward's
    collectives, where it waited for rank 1 (found from outside). Both build again with
    state_resume=True and resume from one step."""
    base = [os.path.join(OUT_DIR, f"step_failed_on_one_rank_{footprint}")]
    dist.broadcast_object_list(base, src=0)
    os.makedirs(base[0], exist_ok=True)
    kw = dict(lr=LR, bucket_mb=0.0005, state_dirs=base[0], process_group=dist.group.WORLD,
              state_footprint=footprint)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = offload_adam.AdamW(model.parameters(), **kw)

    def steps(start, n):   # (a plain model: train() syncs FSDP2's grads)
        for it in range(start, start + n):
            backward(model, it)
            opt.step()
            opt.zero_grad()
    steps(0, 2)
    dist.barrier()
    if dist.get_rank() == 1:
        os.remove(os.path.join(base[0], "rank1", "offload_adam_state.lock"))
    dist.barrier()
    out = {}
    try:
        steps(2, 1)
        out["error"] = None
    except Exception as e:   # noqa: BLE001 -- reported
        out["error"] = f"{type(e).__name__}: {e}"
    opt.close()
    dist.barrier()
    opt = offload_adam.AdamW(model.parameters(), state_resume=True, **kw)
    out["resumed"] = step_counts(opt)
    opt.close()
    dist.barrier()
    return out


@scenario("ram", "two_generations", "compact")
def found_inf_on_one_rank(footprint):
    """GradScaler found inf/NaN in rank 1's grads only (its shards'): every rank skips the
    step, as torch's ShardedGradScaler makes them (a rank stepping alone waited in its
    state files' collectives for the others), and the next step steps on every rank."""
    base = [os.path.join(OUT_DIR, f"found_inf_on_one_rank_{footprint}")]
    dist.broadcast_object_list(base, src=0)
    os.makedirs(base[0], exist_ok=True)
    kw = ({} if footprint == "ram" else
          dict(state_dirs=base[0], state_footprint=footprint))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = offload_adam.AdamW(model.parameters(), lr=LR, bucket_mb=0.0005,
                             process_group=dist.group.WORLD, **kw)
    out = {}
    for step, inf in enumerate((dist.get_rank() == 1, False)):
        backward(model, step)
        opt.found_inf = torch.tensor(float(inf))   # (as GradScaler.step sets it)
        opt.step()
        del opt.found_inf
        opt.zero_grad()
        out[f"after_{step}"] = step_counts(opt)
    opt.close()
    dist.barrier()
    return out


@scenario("two_generations", "compact")
def files_of_two_runs(footprint):
    """Two runs at the same step, rank 1's folder of the first put back from the second:
    the resume is refused on every rank, naming the runs (found from outside: each rank
    trained on from its own run, silently)."""
    base = [os.path.join(OUT_DIR, f"files_of_two_runs_{footprint}")]
    dist.broadcast_object_list(base, src=0)
    kw = dict(bucket_mb=0.0005, process_group=dist.group.WORLD, state_footprint=footprint)
    for run, lr in (("a", LR), ("b", 3 * LR)):
        os.makedirs(os.path.join(base[0], run), exist_ok=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        opt = offload_adam.AdamW(model.parameters(), lr=lr,
                                 state_dirs=os.path.join(base[0], run), **kw)
        for it in range(2):
            backward(model, it)
            opt.step()
            opt.zero_grad()
        opt.close()
    dist.barrier()
    if dist.get_rank() == 1:
        mine = os.path.join(base[0], "a", "rank1")
        shutil.rmtree(mine)
        shutil.copytree(os.path.join(base[0], "b", "rank1"), mine)
    dist.barrier()
    out = {}
    try:
        offload_adam.AdamW(torch.nn.Linear(8, 3).parameters(), lr=LR, state_resume=True,
                           state_dirs=os.path.join(base[0], "a"), **kw)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    dist.barrier()
    return out


@scenario()
def nvme_one_process_state():
    """A one-process run's state (its manifest in the directory itself) given to two ranks
    with state_resume=True: each rank made an empty rank<R> folder and started at step 0,
    the state left unused with a warning that said nothing of it. Refused on every rank."""
    base = [os.path.join(OUT_DIR, "nvme_one_process_state")]
    dist.broadcast_object_list(base, src=0)
    if dist.get_rank() == 0:   # (plain params: a one-process state)
        os.makedirs(base[0])
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        opt = offload_adam.AdamW(lin.parameters(), lr=LR, state_dirs=base[0])
        lin(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.close()
    dist.barrier()
    out = {}
    try:
        offload_adam.AdamW(build().parameters(), lr=LR, state_dirs=base[0], state_resume=True)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    out["rank_folders"] = sorted(n for n in os.listdir(base[0]) if n.startswith("rank"))
    dist.barrier()
    return out


@scenario()
def stream_sharded():
    """stream_params on an FSDP2 model raised torch's 'mixed torch.Tensor and DTensor' from
    inside, leaving the param_dirs it made: refused by name before anything is made."""
    base = [os.path.join(OUT_DIR, "stream_sharded")]
    dist.broadcast_object_list(base, src=0)
    from offload_adam.testing import AsyncSimDevice, simulated
    model = build()
    out = {}
    try:
        with simulated(AsyncSimDevice(seed=0)):
            offload_adam.stream_params(model, torch.nn.Linear,
                                       param_dirs=base[0] + f"_{dist.get_rank()}")
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    out["made"] = os.path.exists(base[0] + f"_{dist.get_rank()}")
    dist.barrier()
    return out


@scenario()
def step_refused_on_one_rank():
    """Rank 0 sets opt.max_grad_norm = None after the optimizers were built (accepted: the
    check of the options ran at construction), then rank 1's step() is refused (an lr that
    overflows float32) and the script catches it and goes on: either left the other rank
    waiting in the step's collectives (a hang until the process group's timeout). Every
    rank's step() raises instead, nothing stepped, and the steps after go on together."""
    model = build()
    opt = offload_adam.AdamW(model.parameters(), lr=LR, max_grad_norm=CLIP)
    before = [p.full_tensor().clone() for p in model.parameters()]
    out = {"errors": []}
    for case in ("option", "lr", None):
        if case == "option" and dist.get_rank() == 0:
            opt.max_grad_norm = None
        if case == "lr" and dist.get_rank() == 1:
            opt.param_groups[0]["lr"] = 1e39
        backward(model, 0)
        try:
            opt.step()
            out["errors"].append(None)
        except (ValueError, RuntimeError) as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
        opt.zero_grad()
        opt.max_grad_norm, opt.param_groups[0]["lr"] = CLIP, LR
        if case == "lr":
            out["unchanged"] = all(torch.equal(p.full_tensor(), b)
                                   for p, b in zip(model.parameters(), before))
    out["stepped"] = not all(torch.equal(p.full_tensor(), b)
                             for p, b in zip(model.parameters(), before))
    dist.barrier()
    return out


@scenario("ram", "two_generations", "compact")
def early_step_refused_on_one_rank(variant):
    """step_in_backward: rank 1 changes its lr between backward and step(), which refuses
    its step (the steps that ran in backward used the old lr). The other rank used to
    commit its step alone (state files: its shards a step ahead of rank 1's, silently) or,
    with the compact footprint, wait in the pass's collectives for rank 1 (a hang, then
    gloo's abort). Every rank refuses now, naming rank 1's cause; trained on, the ranks
    stay at one step."""
    kw = {"step_in_backward": True, "bucket_mb": 0.0005}
    if variant != "ram":
        base = [os.path.join(OUT_DIR, f"early_refused_{variant}")]
        dist.broadcast_object_list(base, src=0)
        os.makedirs(base[0], exist_ok=True)
        kw.update(state_dirs=base[0], state_footprint=variant)
    model = build(BF16)
    opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=WD, **kw)
    train(model, opt, 1)
    backward(model, 1)
    if dist.get_rank() == 1:
        opt.param_groups[0]["lr"] = 2 * LR
    out = {}
    try:
        opt.step()
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    out["after_refusal"] = opt.step_count
    opt.param_groups[0]["lr"] = LR
    opt.zero_grad()
    train(model, opt, 2, start=2)
    out["counts"] = step_counts(opt)
    opt.close()
    dist.barrier()
    return out


@scenario()
def constructor_refused_on_one_rank():
    """Rank 1's optimizer refused while being built (a state_dirs that is a file, a negative
    lr): rank 0 waited in the ranks' comparison of options until the process group's
    timeout, then raised gloo's "Connection closed by peer" (found from outside). Both
    raise at once, rank 0 naming rank 1's cause; built again right, both train."""
    model = build()
    bad_dir = os.path.join(OUT_DIR, "not_a_dir")
    if dist.get_rank() == 0:
        open(bad_dir, "w").close()
    dist.barrier()
    out = {"errors": []}
    for kw in ({"state_dirs": bad_dir}, {"lr": -1.0}):
        if dist.get_rank() == 0:
            kw = {}
        started = time.monotonic()
        try:
            offload_adam.AdamW((p for p in model.parameters()), **{"lr": LR, **kw})
            out["errors"].append(None)
        except (ValueError, RuntimeError) as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
        out.setdefault("seconds", []).append(time.monotonic() - started)
    opt = offload_adam.AdamW(model.parameters(), lr=LR)
    train(model, opt, 2)
    out["count"] = opt.step_count
    return out


@scenario()
def state_dtype_spelled_two_ways():
    """One format named two ways on the two ranks (torch.float32 set on rank 1, the name
    "float32" the constructor keeps on rank 0; torch.bfloat16 / "bf16"): was refused at
    every step() as differing between the ranks (found from outside). Both step."""
    model = build()
    opt = offload_adam.AdamW(model.parameters(), lr=LR, state_dtype="bfloat16")
    opt.param_groups[0]["state_dtype"] = torch.bfloat16 if dist.get_rank() else "bf16"
    train(model, opt, 2)
    return {"count": opt.step_count}


@scenario("retry", "zero_grad")
def early_refused_before_backward_on_one_rank(variant):
    """step_in_backward, state in RAM: rank 1 sets a beta its step() refuses before
    backward, so its backward starts no step, while rank 0's steps run in backward and
    stay. Both step()s raise; rank 1 mends the beta. "retry": step() again on both, which
    steps the grads on rank 1. "zero_grad": rank 1's zero_grad() used to drop the grads
    without a word, its shards a step behind rank 0's from then on (found from outside);
    it raises, keeping them, and step() steps them. Either way the ranks end at one step,
    bitwise the training without the edit."""
    kw = {"lr": LR, "weight_decay": WD, "step_in_backward": True, "bucket_mb": 0.0005}
    ref = build(BF16)
    ref_opt = offload_adam.AdamW(ref.parameters(), **kw)
    train(ref, ref_opt, 4)
    model = build(BF16)
    opt = offload_adam.AdamW(model.parameters(), **kw)
    train(model, opt, 2)
    if dist.get_rank() == 1:
        opt.param_groups[0]["betas"] = (1.5, 0.999)
    backward(model, 2)
    out = {"zero_grad": None}
    try:
        opt.step()
        out["step"] = None
    except (RuntimeError, ValueError) as e:
        out["step"] = f"{type(e).__name__}: {e}"
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    if variant == "zero_grad":
        try:
            opt.zero_grad()
        except RuntimeError as e:
            out["zero_grad"] = str(e)
    opt.step()
    opt.zero_grad()
    train(model, opt, 1, start=3)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, opt.step_count)
    out["counts"] = counts
    out["same"] = all(torch.equal(p.full_tensor(), q.full_tensor())
                      for p, q in zip(model.parameters(), ref.parameters()))
    dist.barrier()
    return out


@scenario()
def early_accumulation_refused():
    """step_in_backward under FSDP2, a second backward before step() (accumulation): its
    grads' hook runs inside FSDP2's own step of backward, and raising there left the
    modules unsharded, their params plain tensors no optimizer steps: training on stepped
    nothing, silently (found from outside). The backward ends; step() refuses; trained on,
    every param is FSDP2's again and steps."""
    model = build(BF16)
    opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=WD, step_in_backward=True)
    train(model, opt, 1)
    backward(model, 1, 0)
    out = {"second": None, "step": None}
    try:
        backward(model, 1, 1)
    except RuntimeError as e:
        out["second"] = str(e)
    try:
        opt.step()
    except RuntimeError as e:
        out["step"] = str(e)
    opt.zero_grad()
    moved = []
    for it in range(2, 4):
        before = [p.to_local().clone() for p in model.parameters()]
        train(model, opt, 1, start=it)
        moved.append(all(not torch.equal(p.to_local(), b)   # (a rank's shard may be empty)
                         for p, b in zip(model.parameters(), before) if b.numel()))
    out["dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    out["moved"], out["steps"] = moved, sorted({float(s["step"]) for s in opt.state.values()})
    dist.barrier()
    return out


@scenario()
def options_differ():
    """Rank 0 clips (max_grad_norm=), rank 1 does not: each would run other collectives
    in its step; both optimizers are refused where they are built, naming the option."""
    out = {}
    try:
        offload_adam.AdamW(build().parameters(), lr=LR,
                           max_grad_norm=CLIP if dist.get_rank() == 0 else None)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    dist.barrier()
    return out


KILLED_STEPS = 2   # completed by both ranks before rank 0 is killed in the next one


def _kill(*args, **kw):
    os.kill(os.getpid(), signal.SIGKILL)


def _last_step(name, model, opt):
    """Phase 1's last step, in which ranks are killed; a rank that lives writes its result
    and exits at once (the other is gone)."""
    try:
        train(model, opt, 1, start=KILLED_STEPS)
        error = None
    except Exception as e:   # noqa: BLE001 -- the ranks' word after the pass finds one gone
        error = f"{type(e).__name__}: {e}"
    with open(os.path.join(OUT_DIR, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({name: {"ok": True, "step": opt.step_count, "error": error}}, f)
    os._exit(0)


def _resumed(folder, dtype, steps, **kw):
    """Phase 2: the files phase 1 left, resumed with state_resume=True on a model of
    another init: the step the ranks agreed on, the warnings, and whether the run is
    bitwise the uninterrupted one in RAM after `steps`, and after 2 more."""
    import warnings
    ram_model = build(dtype)
    ram = offload_adam.AdamW(ram_model.parameters(), lr=LR, weight_decay=WD)
    train(ram_model, ram, steps)
    model = build(dtype, seed=5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=WD, state_dirs=folder,
                                 state_resume=True, **kw)
    out = {"resumed_step": opt.step_count,
           "warned": [str(w.message) for w in seen if "all ranks resume" in str(w.message)],
           "resumed_bitwise": same_run((ram_model, ram), (model, opt))}
    train(ram_model, ram, 2, start=steps)
    train(model, opt, 2, start=steps)
    out["trained_on_bitwise"] = same_run((ram_model, ram), (model, opt))
    return out


@scenario("fp32", "bf16")
def nvme_kill(variant):
    """Phase 1 of issue 25's item 7 (tests/test_distributed.py runs it alone): both ranks
    complete KILLED_STEPS steps on their files; in the next one rank 1 commits and rank 0
    is SIGKILLed right before its commit (its slots written, its manifest one step
    behind)."""
    dtype = BF16 if variant == "bf16" else torch.float32
    folder = os.path.join(OUT_DIR, f"nvme_kill_{variant}")
    os.makedirs(folder, exist_ok=True)
    model = build(dtype)
    opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=WD, bucket_mb=0.0005,
                             state_dirs=folder)
    train(model, opt, KILLED_STEPS)
    if dist.get_rank() == 0:
        offload_adam.nvme.NvmeState.commit = _kill
    _last_step(f"nvme_kill_{variant}", model, opt)


@scenario("fp32", "bf16")
def nvme_after_kill(variant):
    """Phase 2: both ranks resume the files phase 1 left (rank 0 one step behind rank 1):
    they agree on step KILLED_STEPS (rank 1 goes back, its other slots still hold it),
    bitwise the uninterrupted run in RAM, and train on bitwise."""
    dtype = BF16 if variant == "bf16" else torch.float32
    return _resumed(os.path.join(OUT_DIR, f"nvme_kill_{variant}"), dtype, KILLED_STEPS,
                    bucket_mb=0.0005)


COMPACT = dict(bucket_mb=0.0005, state_footprint="compact")


@scenario("forward", "back")
def nvme_compact_kill(variant):
    """Phase 1 with compact state files (state_footprint="compact": one copy, a redo
    log; no rank moves a bucket before every rank's log of the step is durable). Both
    ranks complete KILLED_STEPS steps; in the next one, "forward": rank 0 is SIGKILLed
    right before its step's last commit (its log durable, buckets written) while rank 1
    completes it; "back": rank 0 is SIGKILLed before its log is committed and rank 1 right
    after its own (before the ranks' collective that lets buckets move)."""
    folder = os.path.join(OUT_DIR, f"nvme_compact_kill_{variant}")
    os.makedirs(folder, exist_ok=True)
    model = build(torch.float32)
    opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=WD, state_dirs=folder,
                             **COMPACT)
    train(model, opt, KILLED_STEPS)
    if variant == "forward" and dist.get_rank() == 0:
        offload_adam.nvme.NvmeState.commit = _kill
    if variant == "back":
        if dist.get_rank() == 0:
            offload_adam.nvme.NvmeState.begin = _kill
        else:
            from offload_adam.nvme_tier import FileStore
            FileStore._all_ranks_logged = _kill
    _last_step(f"nvme_compact_kill_{variant}", model, opt)


@scenario("forward", "back")
def nvme_compact_after_kill(variant):
    """Phase 2: both ranks resume what phase 1 left: "forward" at step KILLED_STEPS + 1
    (rank 0 finishes it from its log), "back" at KILLED_STEPS (rank 1 drops the step it
    began, warned); bitwise the uninterrupted run in RAM, and on."""
    steps = KILLED_STEPS + (1 if variant == "forward" else 0)
    return _resumed(os.path.join(OUT_DIR, f"nvme_compact_kill_{variant}"), torch.float32,
                    steps, **COMPACT)


# ---- the rank's main ----------------------------------------------------------------

OUT_DIR = None


def main(argv):
    global OUT_DIR
    rank, world, port, OUT_DIR = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    # (the kill's two phases only when named: the first ends its processes)
    names = argv[4:] or sorted(n for n in SCENARIOS if "_kill" not in n)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results = {}
    path = os.path.join(OUT_DIR, f"rank{rank}.json")
    for name in names:
        try:
            results[name] = {"ok": True, **SCENARIOS[name]()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

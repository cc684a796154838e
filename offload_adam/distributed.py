"""DTensor params (FSDP2's fully_shard, tensor parallel): each rank steps its shard.

Under FSDP2 a param is a DTensor whose local tensor is this rank's shard, and
so is its grad. offload_adam steps the local tensors, like any other param:
nothing is gathered and the kernels never see a DTensor. Three things need the
param's layout or the other ranks, and live here:

  * the state dict: optimizer.state[p] holds the local shard's state (plain
    tensors, what the kernels step); `export_state` shows it in
    optimizer.state_dict() as DTensors of the param's mesh and placements, as
    torch's optimizers keep it ("step" stays a plain 0-dim tensor), so that
    torch.distributed.checkpoint saves every rank's shard and reshards on load;
    `local_value` brings a loaded value back to this rank's shard;
  * clipping: the 2-norm over all shards (`global_sq_sum`): each rank's sums of
    squares, all-reduced over the mesh dims along which the grad is sharded,
    and over `process_group` for plain params a user sharded himself;
  * `local`: the tensor this process owns;
  * the NVMe tier's files: one set per rank (`rank_dirs`).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # a torch built without distributed support
    dist = DTensor = Partial = Replicate = Shard = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process owns: a DTensor's local shard, or `t`."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


# ---- the state dict ---------------------------------------------------------

def _contiguous_stride(shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def _at_offset_zero(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) as a tensor sharing its memory at storage offset 0. A
    DTensor over a local tensor with a storage offset fails torch.save ("invalid
    python storage": torch 2.13 pickles such a wrapper as a plain tensor), and
    the engine's state tensors are views into one host buffer. A slice of a
    storage holds a reference to the whole storage."""
    if t.storage_offset() == 0 or not t.is_contiguous():
        return t
    size = t.element_size()
    start = t.storage_offset() * size
    storage = t.untyped_storage()[start:start + t.numel() * size]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def as_dtensor_like(t: torch.Tensor, p) -> torch.Tensor:
    """`t`, this rank's shard of a tensor shaped like DTensor `p`, as a DTensor
    of p's mesh and placements (sharing t's memory; no communication)."""
    return DTensor.from_local(_at_offset_zero(t), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape,
                              stride=_contiguous_stride(p.shape))


def export_state(param_of_id: Dict[int, torch.Tensor], packed_state: dict) -> dict:
    """optimizer.state_dict()["state"] with the local-shard tensors of DTensor
    params shown as DTensors of their param's layout (new dicts; the
    optimizer's own state is not touched). `param_of_id` maps the state dict's
    param ids to the params."""
    out = dict(packed_state)
    for pid, st in packed_state.items():
        p = param_of_id.get(pid)
        if not is_dtensor(p) or not isinstance(st, dict):
            continue
        shard_shape = local(p).shape
        out[pid] = {k: (as_dtensor_like(v, p)
                        if isinstance(v, torch.Tensor) and not is_dtensor(v)
                        and k != "step" and v.shape == shard_shape else v)
                    for k, v in st.items()}
    return out


def local_value(value: torch.Tensor, p: torch.Tensor, key: str, label) -> torch.Tensor:
    """A loaded state tensor of DTensor param `p` as this rank's shard: from a
    DTensor (redistributed first if its layout is not p's) or from a full,
    unsharded tensor (its part cut out here, no communication)."""
    if is_dtensor(value):
        if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
            value = value.redistribute(p.device_mesh, p.placements)
        return local(value)
    if tuple(value.shape) == tuple(p.shape):
        mesh = p.device_mesh
        whole = DTensor.from_local(value.to(local(p).device), mesh,
                                   [Replicate()] * mesh.ndim, run_check=False)
        return local(whole.redistribute(mesh, p.placements))
    raise ValueError(
        f"loaded optimizer state {key!r} for param {label()} is a plain tensor of "
        f"shape {tuple(value.shape)}; the param is a DTensor of shape {tuple(p.shape)} "
        f"(local shard {tuple(local(p).shape)}): load a DTensor state dict (its "
        "state_dict() or torch.distributed.checkpoint's get_state_dict) or a full one")


# ---- the NVMe tier: each rank its own files -----------------------------------

def sharded(params: Iterable[torch.Tensor], process_group=None) -> bool:
    """Whether the params are one rank's part of a run over several ranks (DTensor
    params, or a process_group given for params a user sharded himself)."""
    sharded = process_group is not None or any(is_dtensor(p) for p in params)
    return bool(sharded and dist is not None and dist.is_initialized()
                and dist.get_world_size() > 1)


def replicated(params: Iterable[torch.Tensor], process_group=None) -> bool:
    """Whether the params are one rank's replica of a run over several ranks: plain
    tensors and no process_group (DistributedDataParallel, whose hooks average the grads
    across ranks after autograd accumulated them)."""
    return bool(process_group is None and dist is not None and dist.is_initialized()
                and dist.get_world_size() > 1 and not any(is_dtensor(p) for p in params))


def rank_dirs(dirs: Tuple[str, ...], params: Iterable[torch.Tensor],
              process_group=None) -> Tuple[str, ...]:
    """state_dirs= for this process: under several ranks, a folder "rank<R>" of each
    directory, R the global rank, made if missing, so that every rank may be given the
    same directories; the directories themselves otherwise."""
    import os
    world = dist.get_world_size() if sharded(params, process_group) else 1   # (global ranks name the folders)
    from .nvme.manifest import MANIFEST
    for d in dirs:   # the state of ranks this run does not have: refused, not started over
        if world > 1 and os.path.exists(os.path.join(d, MANIFEST)):
            raise ValueError(
                f"offload_adam: state_dirs {d!r} holds a one-process optimizer state (its "
                f"manifest is in {d!r} itself, not in a rank<R> folder), and this run has "
                f"{world} ranks, each of which keeps its shard's state in "
                f"{os.path.join(d, 'rank<R>')!r}: resume it in one process, or give this run "
                "other directories")
        old = [n for n in rank_folders_with_state(d) if world == 1 or n >= world]
        if old:
            what = ("a sharded run's (FSDP2)" if world == 1 else
                    f"rank {max(old)}'s, so at least {max(old) + 1} ranks')")
            raise ValueError(
                f"offload_adam: state_dirs {d!r} holds {what} optimizer state in "
                f"{os.path.join(d, f'rank{max(old)}')!r}, and this run has {world} "
                f"rank{'s' if world > 1 else ''}: resume it with the number of ranks that "
                "made it (each rank's state is its shard's), or give this run other "
                "directories")
    if world == 1:
        return dirs
    out = tuple(os.path.join(d, f"rank{dist.get_rank()}") for d in dirs)
    for d in out:
        os.makedirs(d, exist_ok=True)
    return out


def rank_folders_with_state(folder) -> list:
    """The ranks R whose folder "rank<R>" in `folder` holds a state's manifest."""
    import os
    from .nvme.manifest import MANIFEST
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [int(n[4:]) for n in names if n.startswith("rank") and n[4:].isdigit()
            and os.path.exists(os.path.join(folder, n, MANIFEST))]


def told(error: BaseException) -> BaseException:
    """Marks `error` as said to the other ranks (refuse_together): a caller further out
    must not say it again, in a collective the others never join."""
    try:
        error._offload_adam_told = True
    except Exception:   # noqa: BLE001 -- (an exception without a __dict__: said twice at worst)
        pass
    return error


def refuse_together(problem: Optional[str], params: Iterable[torch.Tensor],
                    process_group=None, replicas: bool = False) -> None:
    """Under several ranks each says what it cannot go on with (None: nothing; every rank
    must call it): a rank with nothing to say raises the first other rank's problem, so
    that none goes on into a collective that a rank which raised never joins (it would
    wait, then fail on a closed connection). The caller raises its own. (`replicas`:
    every_rank's.)"""
    other = other_refusal(problem, params, process_group, replicas)
    if other is not None:   # (said here: `told`, not said again further out)
        raise told(ValueError(f"offload_adam: rank {other[0]} refused its state files, so "
                              f"every rank does: {other[1]}"))


def tell_others(error: BaseException, params: Iterable[torch.Tensor], process_group=None,
                replicas: bool = False) -> None:
    """This rank raises `error` where the other ranks next say in a collective what they
    cannot go on with (refuse_together, the state files' pass: every_rank of a problem or
    None): joined there with it, they raise naming it instead of waiting for this rank
    (found from outside: an engine refused after the ranks compared their options, a
    directory missing on one DDP replica resuming, a state file truncated on one rank
    mid-run). Nothing where it was said already (`told`, which it marks) or where no rank
    would wait."""
    if getattr(error, "_offload_adam_told", False):
        return
    try:
        refuse_together(f"{type(error).__name__}: {error}", params, process_group, replicas)
    except Exception:   # noqa: BLE001 -- the error raised is this rank's own
        pass
    told(error)


def other_refusal(problem: Optional[str], params: Iterable[torch.Tensor],
                  process_group=None, replicas: bool = False) -> Optional[Tuple[int, str]]:
    """Each rank says what it cannot go on with (None: nothing; every rank must call it):
    for a rank with nothing to say, the first other rank's (rank, problem); else None."""
    problems = every_rank(problem, params, process_group, replicas)
    bad = [(r, p) for r, p in enumerate(problems or ()) if p is not None]
    return bad[0] if problem is None and bad else None


def every_rank(value, params: Iterable[torch.Tensor], process_group=None,
               replicas: bool = False) -> Optional[list]:
    """`value` of every rank of a sharded run (in rank order; each rank must call it), or
    None under one rank; `replicas`: of a replicated run's ranks too (DDP). The NVMe
    tier's ranks agree on the step to resume with it."""
    if not (sharded(params, process_group)
            or (replicas and replicated(params, process_group))):
        return None
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, value, group=process_group)
    return out


def refused_on_one_rank(error: BaseException, params: List[torch.Tensor],
                        process_group=None) -> None:
    """This rank's optimizer refused while being built, before the ranks compared their
    options (optimizer._same_on_every_rank, a collective): the others wait there. Joined
    with the error in place of the options, they raise naming it (refuse_refused)."""
    if not sharded(params, process_group):
        return
    try:
        every_rank((None, f"{type(error).__name__}: {error}"), params, process_group)
    except Exception:   # noqa: BLE001 -- the error raised is this rank's own
        pass


def refuse_refused(ranks: list) -> None:
    """A RuntimeError naming the first rank whose optimizer was refused while being built
    (refused_on_one_rank): each rank's (options, error) in rank order."""
    for r, (_, error) in enumerate(ranks):
        if error is not None:
            raise RuntimeError(
                f"offload_adam: rank {r}'s optimizer was refused while being built, so every "
                "rank's is (the ranks compare their options as they build it, and would "
                f"wait for that rank): {error}")


def refuse_differing(ranks: list, when: str) -> None:
    """A ValueError naming the first option whose value differs between the ranks (each
    rank's dict of them, in rank order), followed by `when`."""
    for key in ranks[0] if ranks else ():
        values = [r[key] for r in ranks]
        if any(v != values[0] for v in values):
            raise ValueError(
                f"offload_adam: {key} differs between the ranks ("
                + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)) + f"){when}")


def agree_to_step(options: Callable[[], dict], problem: Optional[BaseException],
                  param_groups, process_group=None, started: int = 0,
                  skipping: bool = False) -> Tuple[Optional[BaseException], List[int], bool]:
    """Under several ranks, before a step's first collective (every rank's step() calls
    it): each rank's options that decide the step's collectives, and whether its own
    checks refused the step. A rank whose step was refused (its caller raises that error)
    while the others went on, or an option set on one rank after the optimizers were built
    (opt.max_grad_norm = None), left the others waiting in a collective it never joined:
    a hang until the process group's timeout. Every rank raises instead: the refused rank
    its own error, the others the error returned here, naming it. `started`: how many
    params' steps of this iteration ran in backward on this rank and stay (step_in_backward,
    the state in RAM); returned with the error, the other ranks where some did: a rank whose
    own refusal started none in backward (an edit made before it) while another's did is
    then a step behind unless step() is called again (optimizer.zero_grad says so). (One
    process: nothing built, a step's hot path.) `skipping`: GradScaler found inf/NaN in
    this rank's grads; returned: whether any rank's did, so that every rank skips the
    step (a rank stepping alone waited for the others in its state files' collectives;
    torch's ShardedGradScaler agrees on found_inf likewise)."""
    if dist is None or not dist.is_initialized():
        return None, [], skipping
    params = [p for g in param_groups for p in g["params"]]
    if not sharded(params, process_group):
        return None, [], skipping
    said = None if problem is None else f"{type(problem).__name__}: {problem}"
    ranks = every_rank((options(), said, started, skipping), params, process_group)
    me = dist.get_rank(process_group)
    ahead = [r for r, (_, _, n, _) in enumerate(ranks) if n and r != me]
    skip = any(s for _, _, _, s in ranks)
    if problem is not None:
        return None, ahead, skip
    bad = [(r, p) for r, (_, p, _, _) in enumerate(ranks) if p is not None]
    if bad:
        stepped = ("nothing stepped" if not started else
                   f"nothing more stepped (the step of {started} params ran during backward "
                   "on this rank and stays: the state is in RAM, it cannot be undone; mended, "
                   f"step() called again on every rank steps these grads on rank {bad[0][0]} "
                   "too)")
        return RuntimeError(f"offload_adam: rank {bad[0][0]}'s step() was refused, so every "
                            f"rank's is, {stepped} (its collectives would wait for that "
                            f"rank): {bad[0][1]}"), ahead, skip
    try:
        refuse_differing([o for o, _, _, _ in ranks],
                         " at step(), set on some ranks since the optimizers were built: "
                         "every rank's optimizer must step with the same options (a step's "
                         "collectives depend on them); nothing was stepped")
    except ValueError as e:
        return e, ahead, skip
    return None, ahead, skip


# ---- clipping: the norm over all shards --------------------------------------

def _reduction(grad: torch.Tensor) -> Optional[tuple]:
    """(mesh, mesh dims to sum over) for a DTensor grad; None for a plain one."""
    if not is_dtensor(grad):
        return None
    dims = []
    for d, placement in enumerate(grad.placements):
        if isinstance(placement, Partial):
            raise NotImplementedError(
                f"offload_adam: a grad of shape {tuple(grad.shape)} has a Partial "
                "placement (not yet reduced); clip with torch.nn.utils.clip_grad_norm_")
        if not isinstance(placement, Replicate):   # Shard and its variants
            dims.append(d)
    return grad.device_mesh, tuple(dims)


def _mesh_key(mesh, dims) -> tuple:
    """The same on every rank, so that the ranks reduce in the same order."""
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape),
            tuple(mesh.mesh_dim_names or ()), dims)


def global_sq_sum(sums: Iterable[Tuple[torch.Tensor, float]], params: List[torch.Tensor],
                  process_group=None) -> float:
    """The sum of squares of every grad over all ranks.

    `sums` holds (param, the sum of squares of its local grad) for the params
    with a grad; `params` is every param of the optimizer (the same on every
    rank). The sums of DTensor grads are all-reduced over the mesh dims along
    which they are sharded (not the replicated ones), one all_reduce per
    distinct (mesh, dims) whatever the grads each rank has; the sums of plain
    grads over `process_group` when one is given (params sharded by hand),
    else not at all (plain params are replicas, as under DDP). Every rank must
    call this at the same point: it is a collective when any of that applies.
    """
    groups: Dict[tuple, list] = {}
    plain, replicated = [], []
    keys: Dict[tuple, tuple] = {}   # _mesh_key reads the mesh's ranks: once per mesh and dims

    def key_of(r):
        k = (id(r[0]), r[1])
        if k not in keys:
            keys[k] = _mesh_key(*r)
        return keys[k]

    # Each param's reduction, known to every rank alike: its grad's layout, or
    # the param's when the grad is gone (free_grads_after_copy freed it on the
    # way to the host; its sum comes from the host copy).
    reductions = {id(p): _reduction(p.grad if p.grad is not None else p) for p in params}
    for r in reductions.values():
        if r is not None and r[1]:
            groups.setdefault(key_of(r), [r[0], r[1], []])
    for p, s in sums:
        r = reductions[id(p)]
        if r is None:
            plain.append(s)
        elif not r[1]:
            replicated.append(s)    # the same on every rank of its mesh
        else:
            groups[key_of(r)][2].append(s)
    total = math.fsum(replicated)
    for key in sorted(groups):
        mesh, dims, values = groups[key]
        t = torch.tensor([math.fsum(values)], dtype=torch.float64, device=mesh.device_type)
        for d in dims:
            dist.all_reduce(t, group=mesh.get_group(d))
        total += float(t.item())
    plain_sum = math.fsum(plain)
    if process_group is not None:
        device = next((local(p).device for p in params), torch.device("cpu"))
        t = torch.tensor([plain_sum], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=process_group)
        plain_sum = float(t.item())
    return total + plain_sum


def norm_tensor(norm: float, params: List[torch.Tensor]) -> torch.Tensor:
    """The total norm as torch.nn.utils.clip_grad_norm_ returns it: a float32
    0-dim tensor on the params' device; for DTensor params a DTensor
    replicated over their mesh (the same value on every rank), as torch's."""
    device = local(params[0]).device if params else torch.device("cpu")
    t = torch.tensor(norm, dtype=torch.float32, device=device)
    mesh = next((p.device_mesh for p in params if is_dtensor(p)), None)
    if mesh is None:
        return t
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)

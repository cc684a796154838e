"""The optimizer's options beyond torch's: one record, checked when it is built,
for every path (in place and the offload engine alike). Each option is
documented here and nowhere else.

  overlap (True): copy each grad to the host as backward produces it; with
    False everything happens inside step(). Both give the same results.
  bucket_mb (32): size of the buckets the engine steps and transfers at once.
  free_grads_after_copy (False): free each grad's device memory as soon as it
    is on the host: p.grad then holds a FreedGrad (freed_grad.py), a tensor of
    the grad's shape and dtype that owns no memory. It answers clipping
    (torch.nn.utils.clip_grad_norm_, opt.clip_grad_norm_) and GradScaler's inf
    check from the host copy; another micro-batch's grad accumulates into it on
    the host (sent, then added to the host copy: bit for bit the sum on the
    device); everything else is refused with an error: reading its values,
    editing it. After step() its host copy is let go: until zero_grad() (the
    optimizer's or the model's) a second step() or a backward adding to it
    raises (torch would step it again, or add to it). Needs overlap=True.
    torch.nn.utils.clip_grad_norm_ of freed grads steps as torch's clip of the
    grads kept, bit for bit, whenever the two agree on the norms, and always
    when neither total norm exceeds max_norm (the coefficient is then 1): the
    coefficient is applied inside the kernel, each product rounded to the
    grad's dtype as torch's multiplication of the grad rounds it. The norms
    can differ: a freed grad's norm is its host copy's sum of squares in
    double, rounded once to the grad's dtype; torch's is a sum in fp32 on the
    device, in an order of the device's that the host cannot repeat, and
    carries that sum's rounding error (on the CPU: up to 1.4e-5 relative for
    1M random fp32 elements, 7.5e-4 for 16M). So fp32 norms usually differ, by
    that error; bf16/fp16 ones only where that error crosses a rounding
    boundary of the dtype, rarely while it stays far below the dtype's unit
    in the last place (2^-8 to 2^-7 relative in bf16; on the CPU, 1 in 60
    random bf16 grads of 1M elements). The total norm and the clip
    coefficient then differ by about as much, and every clipped grad with the
    coefficient. Two multiplications before step() (a second clip) are
    applied as one, by their product rounded once (torch rounds each), and a
    norm asked after a clip is the earlier norm times the coefficient
    (torch's: of the rounded clipped grads).
  num_threads (None): kernel threads, for every param; None =
    torch.get_num_threads(), minus one for CUDA params (the thread driving the
    GPU keeps a core).
  max_grad_norm (None): clip the grads' total 2-norm to this in every step,
    inside the kernel (no pass over the grads on the device). For DTensor
    params (FSDP2) the norm over all shards (distributed.py).
  process_group (None): for params sharded by hand (plain tensors, each rank a
    part), the group over which the clipping norm is summed. Not pickled.
  verify_grads (True): a grad copied to the host before step() (during
    backward, or by opt.clip_grad_norm_) is checked at its next use against a
    fingerprint taken when it was copied, so that in-place changes that leave
    its version counter alone (p.grad.data edits, GradScaler.unscale_; and
    torch's in-place foreach ops, clip_grad_norm_'s, run while any
    TorchDispatchMode is active, FlopCounterMode for one: torch bumps no
    counter for them then) are copied again instead of missed. Costs two passes over the grads on the
    device per step (at the copy, and at reuse in step()), ~12 ms per billion
    params each on an H100 (estimated); for bf16/fp16 params in host memory the
    kernels take it, 0.3-0.4 ns per element on one AVX-512 core of the dev VM
    (torch ops took 2.3). Turn it off only if nothing edits
    grads behind their version counters. (CPU params stepped in place need no
    check: the kernel reads p.grad.)
  step_in_backward (False): start each bucket's CPU step during backward, as
    soon as every param of it that got a grad in the previous backward has its
    grad on the host (in the first backward: every param of it that requires
    grad), instead of at step(); the first backward steps too. Needs
    overlap=True; max_grad_norm= cannot be used with it. It applies to the
    params the offload engine steps (on a GPU, or bf16/fp16 in host memory):
    fp32 params in host memory are stepped in place at step() (a warning says
    so when none is the engine's). A grad edited during
    backward by a post-accumulate-grad hook registered on its param after the
    optimizer was built (p.grad.mul_, .data, a new p.grad) is stepped as
    edited, exactly as by a plain step: the engine copies such a grad, and
    starts its bucket, only once autograd is past that hook (also without
    step_in_backward; with free_grads_after_copy the hook sees the grad, freed
    after it). Other writes to a grad during backward (another param's hook,
    a module's backward hook) are not ordered with its copy (on a GPU it may
    read them half done): make them there or after backward. Exact only when
    nothing changes between backward and step(), so the following raise
    RuntimeError (at step(), zero_grad() or the hook, as noted): editing,
    replacing, dropping, clipping (torch.nn.utils.clip_grad_norm_,
    opt.clip_grad_norm_) or scaling a stepped grad; GradScaler; changing lr or
    another hyperparameter (an LR scheduler stepped before opt.step());
    load_state_dict; zero_grad() before step(); a second backward into a
    stepped param (accumulation, raised from backward()). There is no undo:
    after such an error the params already stepped in backward stay stepped
    (param, master, moments and step agree) and the others are not, and the
    message says so; with state_dirs= nothing is committed before step(), so
    then nothing was stepped. A param streamed by stream_params has its host
    copy written once its block's backward is done: between backward and
    step(), model.state_dict() and an inference forward see those params
    stepped and the resident ones not (a block stepped in part, the rest of
    it waiting for step(), is refused with RuntimeError: it would be seen
    half stepped). The default is False because it is
    exact in every case.
  state_dirs (None): a directory, or a list of them (one per NVMe drive, the
    state striped over them; ordered: a resume gives them in the same order), where the optimizer state lives in files
    instead of host RAM: every param's fp32 master, the moments in any
    state_dtype, their scales and step counts (the NVMe tier, nvme/ and
    nvme_tier.py), for each param that trains when the optimizer is built (a
    frozen one has none, and its grad later is refused: build the optimizer
    after unfreezing). Each step streams it through host RAM bucket by bucket
    (bucket_mb; an engine param whose state is larger is cut into parts of its
    pieces, so that no buffer or spare extent is sized by the largest param),
    reading ahead and writing back while the kernel runs, and
    commits it crash-safe. CPU params stepped in place and the engine's params
    (CUDA, or CPU through the pipeline) alike; with step_in_backward the
    files' pass starts in backward (engine/disk_early.py), and the grads wait
    for it in a bounded host ring (engine/grad_ring.py: twice the largest
    bucket's grads, 4 x bucket_mb at least) instead of a buffer per param
    (the first backward guesses the buckets' order: the params registered last
    first; if wrong, the grads that do not fit wait for step() in buffers of
    their own); see grad_ring_mb for its size. The
    directories must exist and be writable; each optimizer needs its own.
    Under several ranks (FSDP2's DTensor params, or process_group=) each rank
    keeps its shards' state in a folder "rank<R>" of each directory (made if
    missing), so every rank may be given the same directories; resumed, the
    ranks agree on one step (a rank killed before it committed the others'
    last step makes them go back to the one before, which their files keep).
    The files are identified by the params (names, shapes, their order in the
    groups), state_dtype, amsgrad and bucket_mb (which lays out the buckets:
    give the same one to resume); not by the params' dtype (the files hold
    fp32 masters: a model cast between runs resumes from them). A directory
    that already holds this state at a completed step is refused unless
    state_resume=True (a fresh run must not silently start from an old run's
    moments and step count); one that holds another model's, or files of a
    state that cannot be trusted (data files without their manifest, the
    directories in another order than they were made in, a file of another
    run), is refused: a state is never overwritten unasked (remove its files
    to start afresh). Every bucket is checksummed (CRC32C) as it is written and
    checked whenever it is read (each step, state_dict(), a resume): damaged
    bytes are an error naming the bucket and the file. state_dict() returns
    tensors backed by the files (mmap'd, copy on write; save them before the
    second step after, with state_footprint="compact" before the next: a warning
    says when a step rewrites the place of some still alive), load_state_dict()
    writes into the files. Fixed at
    construction (no add_param_group). None = host RAM.
  grad_ring_mb (None): with step_in_backward, the host memory (pinned) the
    grads wait in between their copy and their bucket's step (engine/grad_ring.py).
    None: with the state in RAM, 4 x bucket_mb or twice the grads of the largest
    streamed block (stream_params), whichever is larger, so that the CPU has a
    block's grads to step while the next block's backward makes more; with the
    state in files, twice the grads of the largest state bucket. A size below
    what the pass needs to make progress (twice the largest state bucket's
    grads with state_dirs=, else 4 x bucket_mb) is raised to it. None is at most
    twice the grads of the params that take grads (a LoRA model's ring is its
    adapters' size); made again, larger, after a step whose grads overflowed it
    (a block unfrozen since). Needs step_in_backward.
  defer_blocks (0): with step_in_backward=True, the state in RAM and params
    streamed by stream_params: the CPU step of the first defer_blocks streamed
    blocks whose grads reach the host in backward (the model's last blocks) is
    left to run after step() returns, overlapping the next forward, instead of
    holding the CPU while the first blocks' steps (queued last) wait behind it:
    step() returns once the other blocks and the resident params are stepped,
    and each deferred block's next fetch waits for its own step, as does
    everything else that reads the state or those params (opt.state,
    state_dict() and load_state_dict() of the optimizer and of the model, the
    next backward and step(), close()); zero_grad() does not wait (the steps
    read the grads' host copies). The deferred blocks' grads wait
    in the grad ring, which grows by their bytes (grad_ring_mb= None: 2 +
    defer_blocks of the largest block's grads). Bitwise the same training as
    0. A block read between backward and step() (a no-grad forward,
    model.state_dict()) starts the held steps then, so that it reads the model
    stepped, as with 0. An error in a deferred step is raised by the next call
    that waits for it (the forward that fetches its block), with a note of how
    many params stayed a step behind (the deferred steps after it are not run;
    a param then stepped in part is refused by step(), as after a step that
    raised halfway). A script may end while deferred steps run: the exit waits
    for them. Needs step_in_backward=True, params streamed (none: a warning)
    and the state in RAM (with state_dirs= a step commits its files at step()).
  state_budget_mb (None): the host memory the NVMe tier may hold: a ring of
    buffers of the largest bucket; the ring needs 3 (one read ahead, one
    stepped, one written back), more read further ahead. None = 4 buckets.
    Needs state_dirs.
  state_resume (False): continue from the state state_dirs already holds (after
    a crash or a stop): the last completed step's moments and masters, and the
    params too: each param stepped at least once is set at construction from
    its master in the files (the files hold every param's value, fp32 params
    stepped in place included), so a crash loses nothing even without a model
    checkpoint; opt.step_count says the step. Directories holding no completed
    step (a first run) start at step 0 with a RuntimeWarning saying so (a
    mistyped path must not start afresh unseen). Nothing loaded after may mix
    steps: params changed before the next step must be the files' (or those
    of the step before, which the files keep: a model checkpoint saved before
    a kill between step() and the model's save; the state then goes back to
    that step, with a warning), else the step raises, nothing stepped; a
    state_dict loaded over params the resume set must be the one saved with
    them, else load_state_dict raises, nothing loaded. To resume from a
    checkpoint of your own (model and optimizer state, e.g. Trainer's
    resume_from_checkpoint), use directories without state and no
    state_resume. Needs state_dirs.
  state_footprint ("two_generations"): how the files keep the state crash-safe.
    "two_generations": two copies of every bucket (2 x the state on disk); a
    step writes the other copy, then commits; the step before stays whole
    (what a model saved before the last step, or the ranks of a sharded run,
    go back to). "compact": one copy in a ring with 4 spare buckets, and a
    redo log of each step's grads (and of the param values a master starts
    again from), written and made durable before any bucket moves; a step
    cut short is finished from the log by state_resume=True, bitwise the
    step that was running. On disk ~1 x the state + the grads (2 B per bf16
    param) instead of 2 x the state; the log adds the grads' bytes to each
    step's writes. No step before the last is kept (so no going back to
    it), and a load_state_dict cut short leaves files that are refused (load
    again). With step_in_backward=True the grads go to the redo log as they
    complete in backward (engine/disk_log.py: host RAM for grads is the grad
    ring's), and the pass runs at step(), reading them back (the grads' bytes
    read once more). Under several ranks (FSDP2) no rank moves a bucket of a
    step before every rank's log of it is durable (a collective per step):
    ranks killed anywhere resume at one step, all forward or all back.
    Fixed when the files are made. Needs state_dirs.

The state format is a param-group key, not an option of this record:
  state_dtype (torch.float32): how exp_avg and exp_avg_sq are stored:
    torch.float32 (12 B/param with the fp32 master), torch.bfloat16 (8 B;
    both moments rounded stochastically: unbiased) or "8bit" (~6 B:
    blockwise uint8 codes with an fp32 scale per 256 elements; no amsgrad).
    The master stays fp32. Fewer bytes is a faster CPU step (it is bound by
    memory bandwidth) and a larger model in the same RAM. state_dict() saves
    the moments as stored; state_dict(fp32_moments=True) as fp32, loadable
    into torch.optim.AdamW. See state_format.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import tempfile
from typing import Any, Iterator, Optional, Tuple

from .nvme.store import folder_problem


def positive_number(value) -> bool:
    """A finite int or float above 0, not a bool (nan and inf are no sizes or speeds):
    the options' MiB, stream_params' param_cache_mb, the planner's figures."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)

# The options that copy grads during backward, and why each needs overlap=True.
_NEEDS_OVERLAP = {
    "step_in_backward": "the step starts from the grads copied during backward",
    "free_grads_after_copy": "grads are freed as they are copied during backward",
}


FOOTPRINTS = ("two_generations", "compact")   # state_footprint's values
_BOOLS = ("overlap", "free_grads_after_copy", "verify_grads", "step_in_backward")


def _is_process_group(value) -> bool:
    import torch.distributed as dist
    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def _is_bool(value) -> bool:
    """True or False: a Python bool or a numpy one (not a string, whose "no" is true, nor
    a number)."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy"
                                       and kind.__name__ in ("bool_", "bool"))


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of the module docstring, checked at construction."""

    overlap: bool = True
    bucket_mb: float = 32.0
    free_grads_after_copy: bool = False
    num_threads: Optional[int] = None
    max_grad_norm: Optional[float] = None
    process_group: Any = None
    verify_grads: bool = True
    step_in_backward: bool = False
    state_dirs: Optional[Tuple[str, ...]] = None
    state_budget_mb: Optional[float] = None
    state_resume: bool = False
    state_footprint: str = "two_generations"
    grad_ring_mb: Optional[float] = None
    defer_blocks: int = 0

    def __post_init__(self):
        for name in _BOOLS:   # before any is read as true or false
            value = getattr(self, name)
            if not _is_bool(value):
                raise TypeError(f"{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, numbers.Real) \
                or not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive, finite number of MiB, got "
                             f"{self.bucket_mb!r}")
        if self.state_dirs is None and _state_roots and _state_roots[-1] is not None:
            object.__setattr__(self, "state_dirs", tempfile.mkdtemp(dir=_state_roots[-1]))
        if self.state_dirs is not None:
            object.__setattr__(self, "state_dirs", _checked_dirs(self.state_dirs))
        if self.state_budget_mb is not None:
            if self.state_dirs is None:
                raise ValueError("state_budget_mb= needs state_dirs= (it bounds the host "
                                 "memory of the NVMe tier)")
            self._positive_mib("state_budget_mb")
        if not isinstance(self.state_resume, bool):
            raise ValueError(f"state_resume must be True or False, got {self.state_resume!r}")
        if self.state_resume and self.state_dirs is None:
            raise ValueError("state_resume=True needs state_dirs= (the directories to resume from)")
        if self.state_footprint not in FOOTPRINTS:
            raise ValueError(f"state_footprint must be one of {list(FOOTPRINTS)}, got "
                             f"{self.state_footprint!r}")
        if self.state_footprint != "two_generations":
            if self.state_dirs is None:
                raise ValueError(f"state_footprint={self.state_footprint!r} needs state_dirs= "
                                 "(it is how the state files are laid out)")
        if self.max_grad_norm is not None:
            if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm,
                                                                      numbers.Real):
                raise TypeError(f"max_grad_norm must be a number > 0 or None, got "
                                f"{self.max_grad_norm!r}")
            if not self.max_grad_norm > 0:
                raise ValueError(f"Invalid max_grad_norm: {self.max_grad_norm}")
        if self.process_group is not None and not _is_process_group(self.process_group):
            raise TypeError(f"process_group must be a torch.distributed process group "
                            f"(e.g. dist.new_group(...)) or None, got {self.process_group!r}")
        for name, why in _NEEDS_OVERLAP.items():
            if getattr(self, name) and not self.overlap:
                raise ValueError(f"{name}=True needs overlap=True ({why})")
        if self.step_in_backward and self.max_grad_norm is not None:
            raise ValueError(
                "max_grad_norm= cannot be used with step_in_backward=True: clipping "
                "needs the norm of all grads, known only after backward, and the "
                "step starts during backward")
        if self.grad_ring_mb is not None:
            if not self.step_in_backward:
                raise ValueError("grad_ring_mb= needs step_in_backward=True (the grads wait "
                                 "in the ring only while the step runs in backward)")
            self._positive_mib("grad_ring_mb")
        if isinstance(self.defer_blocks, bool) or not isinstance(self.defer_blocks, int) \
                or self.defer_blocks < 0:
            raise ValueError(f"defer_blocks must be a whole number of blocks >= 0, got "
                             f"{self.defer_blocks!r}")
        if self.defer_blocks and not self.step_in_backward:
            raise ValueError("defer_blocks= needs step_in_backward=True (only a step that "
                             "started in backward can be left running after step())")
        if self.defer_blocks and self.state_dirs is not None:
            raise ValueError("defer_blocks= cannot be used with state_dirs=: a step "
                             "commits the state files at step(), every block stepped")
        if self.num_threads is not None:
            if isinstance(self.num_threads, bool) or not isinstance(self.num_threads,
                                                                    numbers.Integral):
                raise TypeError(f"num_threads must be a whole number >= 1 or None, got "
                                f"{self.num_threads!r}")
            if self.num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        object.__setattr__(self, "bucket_mb", float(self.bucket_mb))
        if self.num_threads is not None:
            object.__setattr__(self, "num_threads", int(self.num_threads))

    def _positive_mib(self, name: str) -> None:
        """Option `name` is a positive number of MiB (not a bool): kept as a float."""
        value = getattr(self, name)
        if not positive_number(value):
            raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
        object.__setattr__(self, name, float(value))

    @property
    def needs_pipeline(self) -> bool:
        """Options that only the engine's pipeline provides, for CPU params too."""
        return self.step_in_backward or self.free_grads_after_copy

    def replace(self, **changes) -> "Options":
        """A copy with `changes`, checked again (its state where this one's is)."""
        with state_root(None):
            return dataclasses.replace(self, **changes)

    def __getstate__(self):
        # A process group is not pickled.
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "process_group": None}

    def __setstate__(self, state):
        for f in dataclasses.fields(self):   # (an option added since it was pickled)
            object.__setattr__(self, f.name, f.default)
        for name, value in state.items():
            object.__setattr__(self, name, value)


_state_roots: list = []   # pushed by state_root(), innermost last


@contextlib.contextmanager
def state_root(root: Optional[str]) -> Iterator[Optional[str]]:
    """The seam for test support (offload_adam.testing.state_in_files): Options built
    inside this block with state_dirs=None get a new directory of their own under
    `root`, as if given it (None: host RAM, even inside an outer block)."""
    _state_roots.append(root)
    try:
        yield root
    finally:
        _state_roots.pop()


def _checked_dirs(value) -> Tuple[str, ...]:
    """state_dirs= as a tuple of absolute paths, each an existing writable directory."""
    if isinstance(value, (set, frozenset)):   # the order is the state's: file k in dirs[k]
        raise TypeError(f"state_dirs must be ordered (a list or tuple: the files of a "
                        f"striped state are matched to the directories by position), got "
                        f"a {type(value).__name__}: {value!r}")
    dirs = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    if not dirs or not all(isinstance(d, (str, os.PathLike)) for d in dirs):
        raise ValueError(f"state_dirs must be a directory or a non-empty list of "
                         f"directories, got {value!r}")
    out = tuple(os.path.abspath(os.fspath(d)) for d in dirs)
    for d in out:
        problem = folder_problem(d)
        if problem is not None:
            error, what = problem
            hint = (" (create one per drive before building the optimizer)"
                    if error is FileNotFoundError else "")
            raise ValueError(f"state_dirs: {d!r} {what}{hint}")
    # the same directory under two names (a symlink, a bind mount) too: its files would
    # be opened twice (the directory lock then blamed "another optimizer")
    same = {(st.st_dev, st.st_ino) for st in map(os.stat, out)}
    if len(same) != len(out):
        raise ValueError(f"state_dirs names a directory twice: {list(out)}")
    return out

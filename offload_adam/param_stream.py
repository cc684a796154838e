"""Params off the device between uses: each streamed block's params wait in host memory
and come in just before the block runs, for its forward and again for its backward.

    streamer = offload_adam.stream_params(model, blocks=LlamaDecoderLayer, prefetch=2)
    opt = offload_adam.AdamW(model.parameters())   # built after: it steps the host copies

The data path of one block (a module whose params stream), in the order of its uses:

    host copy (pinned, the param's dtype) --H2D on a side stream, up to k uses ahead-->
    the param's device storage
    forward pre-hook   the copy is published to the compute stream; the next k uses of
                       the recorded order are fetched
    forward hook       the storage is given back; grad hooks on the outputs (the block's
                       backward is next: fetch it again) and the inputs (it is done: hooks,
                       not a node in the graph, which would change the grads' sums);
                       after a forward that raised (an out-of-memory error a retry
                       catches), every block on the device goes back at once (torch
                       runs that hook for an Exception: after a KeyboardInterrupt they
                       go back at the next forward, or close())
    backward           fetched when the grads of its outputs arrive (before its recompute
                       under activation checkpointing too), given back once the grads of
                       its inputs are computed, or at the end of backward (of one
                       that raised: at the next forward)
    step()             the CPU step writes the new values into the host copy: the engine
                       reads and writes a streamed param's `Home`, never its device copy,
                       so nothing goes back to the device at step(); a fetch, state_dict()
                       and a load wait for a write in progress (step_in_backward: on the
                       engine's worker, maybe while an inference forward runs)

A backward with create_graph=True through a streamed block is refused (the graph of the
grads would read the params after the block gave them back).

Between uses a streamed param holds no device memory: its storage is resized to 0 and the
param shows a placeholder of its shape that reads as NaN (one element, expanded): a stray
read is loud, a write that torch lets through (fill_, zero_: the placeholder's one element)
is refused at the block's next use (_Block.check_unwritten), and shapes and counts stay right.
So is `p.data = t`. An in-place write through `p.data` (p.data.normal_(): a tensor of its
own version counter) is refused at state_dict(), load_state_dict() and close() only (seen
in the placeholder's element, which costs a device sync to read); p.data.zero_() of a complex
param (its placeholder is 0) and a write while the block is on the device, not at all. The storage object stays
the same, so the views of the param that autograd saved in forward (a Linear's
weight.t()) see the values again once backward fetched them. `model.state_dict()` shows
the host copies; `load_state_dict` writes them.

The order of uses (block, forward or backward) is recorded over the first micro-batch (to
the end of its backward; each forward of the model starts it anew, so inference passes
before it are not part of it) and the prefetch follows it; a use off the recorded order is
fetched on demand, never wrong. Device memory for params is at most (k + 2) x the largest
block beyond the resident params (those outside the blocks: embeddings, norms, a tied
head; a block's params of an integer or bool dtype, which can have no grad, and its
one-element ones, _find_blocks): the block in use, k ahead, and one given back whose
compute may still be queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import math
import operator
import os
import threading
import weakref
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .byte_view import byte_view
from .distributed import is_dtensor
from .engine.device import current_host_stand_in, make_device, outside_transforms
from .engine.host_memory import unpin_when_dropped
from .engine.worker import ForkedChildError
from .nvme.layout import ALIGN, round_up
from .options import positive_number
from .param_files import ParamFiles, default_cache_slots
from .params import home_of, set_home
from .warn import warn

__all__ = ["ParamStreamer", "stream_params"]

BlockSpec = Union[type, Tuple[type, ...], Iterable[str], Callable[[str, torch.nn.Module], bool]]
_ALIGN = 64   # bytes: each host copy starts on a cache line


def _outside_transforms(method):
    """`method` (a block's fetch, release, placeholders shown) outside torch.func's
    transforms (engine/device.py's outside_transforms): called from a hook inside one,
    its views of the host copies were the transform's tensors, without storage."""
    @functools.wraps(method)
    def plain(*args, **kwargs):
        with outside_transforms():
            return method(*args, **kwargs)
    return plain


class Home:
    """A streamed param's values in host memory: what the optimizer reads and steps.
    `like`: a meta tensor of its shape and dtype. With param files (param_files.py) the
    values are in the block's cache slot: `tensor` loads the block if it is not there, and
    stays valid only until the cache gives the slot to another block, so whoever keeps it
    across other blocks' loads holds it (before_write ... after_write)."""

    def __init__(self, block: "_Block", k: int, like: torch.Tensor):
        # The block weakly: an optimizer holds its params' homes, and its finalizers (in
        # weakref.finalize's registry, a root) and a param's hooks (held by autograd in
        # C++, unseen by the collector) reached the block, its streamer and the model
        # through them, so a dropped model held in a cycle outlived one collection. The
        # model holds its streamer (its hooks), the streamer its blocks.
        self._block, self.k, self.like = weakref.ref(block), k, like

    @property
    def block(self) -> "_Block":
        block = self._block()
        if block is None:
            raise RuntimeError(
                "offload_adam: a streamed param's streamer is gone (closed, or dropped with "
                "its model), its host copies with it: this optimizer can no longer step or "
                "read them; build a new optimizer over the params the model has now")
        return block

    @property
    def tensor(self) -> torch.Tensor:
        """The values now. In files: valid while the block is held (held(), or between
        before_write and after_write): another thread may give its slot away otherwise."""
        return self.block.host_views()[self.k]

    @contextlib.contextmanager
    def held(self) -> Iterator[torch.Tensor]:
        """The values, kept where they are until the block ends (for reading)."""
        self.block.hold()
        try:
            yield self.tensor
        finally:
            self.block.unhold(dirty=False)

    def values(self) -> torch.Tensor:
        """The values to read at leisure: the host copy in RAM, a copy of it from files."""
        if self.block.streamer.files is None:
            return self.tensor
        with self.held() as t:
            return t.clone()

    @contextlib.contextmanager
    def writing(self, ranges: Optional[Sequence[Tuple[int, int]]] = None,
                stepped: int = 0) -> Iterator[None]:
        """before_write ... after_write around the caller's write of elements `ranges`
        (None: all); a write that raised gives the bytes it took over back to the file's.
        `stepped`: see after_write."""
        claimed = self.before_write(ranges)
        done = False
        try:
            yield
            done = True
        finally:
            self.after_write(stepped, unwritten=() if done else claimed,
                             written=self._bytes(ranges))

    def before_write(self, ranges: Optional[Sequence[Tuple[int, int]]] = None) -> list:
        """Waits until no copy to the device still reads this block's host copies (the
        host is about to rewrite them); a device copy of the block made before is stale
        from now on, and its next use fetches again (`stale` is only set here, maybe on
        the engine's worker thread, and read on the thread that runs the model). With
        param files the block stays in its slot until after_write().
        `ranges`: the flat elements [a, b) of the param that the caller writes (None: all),
        reading nothing of it: with param files a block not in the cache is not read for
        them (param_files.hold_to_write). Returns what after_write takes back if the
        write failed. Until after_write, the block's readers (a fetch, state_dict, a
        load) wait (_Block.writing_done): the CPU step of step_in_backward writes on the
        engine's worker while the model's thread may read (an inference forward, a
        state dict taken between backward and step())."""
        block = self.block
        if len(block.mapped_out):
            block.streamer._warn_mapped(block)
        block.start_write()
        try:
            block.stale = True
            block.settle()
            claimed = block.hold(self._bytes(ranges))
        except BaseException:
            block.end_write()
            raise
        return claimed

    def after_write(self, stepped: int = 0, unwritten: Sequence[Tuple[int, int]] = (),
                    written: Optional[Sequence[Tuple[int, int]]] = None) -> None:
        """The write that before_write() announced is done: a block in files goes back
        to its file before its slot is reused (the bytes `written`, None: all of it).
        `stepped`: the elements the CPU step wrote (the cache keeps a block until its
        step wrote all of it); `unwritten`: what before_write returned, when the write
        failed (those bytes are the file's again)."""
        try:
            self.block.unhold(dirty=True, stepped=stepped, unwritten=unwritten,
                              written=written)
        finally:
            self.block.end_write()

    def _bytes(self, ranges: Optional[Sequence[Tuple[int, int]]]) -> List[Tuple[int, int]]:
        """The bytes of the block's host copy that elements `ranges` of this param are; a
        range to the param's end takes the padding after it (no one reads it)."""
        block, n = self.block, self.like.numel()
        size = self.like.element_size()
        start = block.offsets[self.k]
        end = block.offsets[self.k + 1] if self.k + 1 < len(block.offsets) else block.size
        return [(start + a * size, end if b >= n else start + b * size)
                for a, b in (ranges if ranges is not None else [(0, n)]) if a < b]

    def bumped(self) -> None:
        """The optimizer bumped the param's version counter (its step wrote the host
        copy): not a write through the placeholder (_Block.check_unwritten)."""
        block = self.block
        for b, k in block.counter_peers.get(self.k, ((block, self.k),)):
            for versions in (b.versions, b.used_versions):
                if versions is not None:
                    versions[k] += 1

    def mark(self) -> tuple:
        """What master_rule.mark reads of the host copy: in RAM, its version counter and
        address (a write through it bumps the first), and what state_dict() handed out
        over it (`model.state_dict()[k].copy_(v)` bumps only that tensor's counter: the
        times handed out, so that one edited and dropped since is seen too, and the
        counters of those alive; a mark that differs costs one comparison of the master
        with the values, master_rule.py); in files, no view lives on (state_dict() maps
        the file copy-on-write; the params are written through the param, whose counter
        counts, or by the engine)."""
        block = self.block
        if block.streamer.files is not None:
            return 0, id(block)
        t = self.tensor
        shown = list(block.shown[self.k])
        return (t._version, t.data_ptr(), block.times_shown[self.k], len(shown),
                sum(v._version for v in shown))


class _Block:
    """One streamed module: its params, their host copies and device tensors, and where
    they are: "away" (no device memory), "coming" (copy queued, placeholders still shown),
    "here" (published, shown)."""

    def __init__(self, streamer: "ParamStreamer", index: int, name: str,
                 module: torch.nn.Module, params: List[Tuple[str, torch.nn.Parameter]]):
        self.streamer, self.index, self.name, self.module = streamer, index, name, module
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        # where each param is held: (the submodule, its path in the block, its
        # attribute, the param's index), every place of a param tied inside the block
        # too; checked at each use
        index = {id(p): k for k, p in enumerate(self.params)}
        self.holders: List[Tuple[torch.nn.Module, str, str, int]] = []
        seen = set()
        for n, p in module.named_parameters(remove_duplicate=False):
            path, _, attr = n.rpartition(".")
            holder = module.get_submodule(path)
            if id(p) in index and (id(holder), attr) not in seen:
                seen.add((id(holder), attr))
                self.holders.append((holder, path, attr, index[id(p)]))
        self.loading = 0          # nested load_state_dict hooks running (submodules')
        self.loading_root: Optional[torch.nn.Module] = None   # the outermost one's module
        self.versions: Optional[List[int]] = None   # the params' counters while away
        # param k -> every (block, index) of a param sharing its version counter, k's
        # too (views of one tensor: a flat buffer's); absent: its counter is its own
        self.counter_peers: Dict[int, List[Tuple["_Block", int]]] = {}
        self.used_versions: Optional[List[int]] = None   # ... while on the device
        self.state = "away"
        self.forwarding = False   # in its forward (not a recompute): _post_forward not run yet
        self.inputs_need_grad = False   # ... a grad flows back through its inputs
        self.ticket: list = [None]   # ... the backward use its inputs' grads end
        # ... the first autograd node its forward may make, and its inputs' nodes: where
        # the walk of _guard_nodes stops
        self.first_node = 0
        self.input_nodes: set = set()
        self.stale = False        # its host copies were written since its last fetch
        self.awaiting = False     # used in backward, not all stepped (param files' cache)
        self.unstepped = 0        # ... its trainable elements the step has not written yet
        self.whole = False        # ... the step writes all of it (no frozen param)
        self.backward_use = 0     # ... when
        self.step_order = 0       # when the last step first wrote it (its pass's order)
        self.trained = False      # the CPU step wrote it once
        self.step_started = False
        self.copies: list = []    # its last fetch's H2D copies, until the host waited for them
        self.deferred: list = []  # waits for CPU steps still writing its host copies
        # the optimizers that step it in backward (step_in_backward), asked before a read
        # whether their steps left it half written (`wait_steps`); dropped with them
        self.step_checks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._copies_lock = threading.Lock()   # (settled on the worker, set on the model's)
        self.writers = 0          # writes of its host copies in progress (Home.before_write)
        self.written = threading.Condition()   # ... notified as each ends; held by a fetch
        # from its wait for them until its copies are set, so that a write starting
        # meanwhile waits for those copies (settle) instead of changing their source
        self.homes: List[torch.Tensor] = []   # the host copies in RAM (none with files)
        self.home_of: List[Home] = []         # each param's Home (params.home_of)
        self.last_hooks: List[int] = []       # its module's forward hooks that release it
        self.first_hook: Optional[int] = None  # its module's forward pre-hook that fetches it
        # what state_dict() mapped from its param file, while held (weakly): a write of the
        # block by the step makes them a mix of steps (ParamStreamer._warn_mapped)
        self.mapped_out: weakref.WeakSet = weakref.WeakSet()
        self.hook_fetched = False   # fetched for backward by a backward pre-hook of its module
        self.early = False          # fetched for this call by the global pre-hook (_global_fetch)
        self.backward_task = None   # the backward its last backward use was in
        # what state_dict() handed out over each host copy in RAM (tensors of storages of
        # their own: their version counters are not the host copy's), and how many times:
        # an edit through one is seen by Home.mark
        self.shown: List[weakref.WeakSet] = [weakref.WeakSet() for _ in self.params]
        self.times_shown = [0] * len(self.params)
        self.offsets: List[int] = []          # each param's bytes in the block's host copy
        self.device_tensors: List[torch.Tensor] = []
        self.placeholders: List[torch.Tensor] = []
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)

    def defer(self, wait: Callable[[], None]) -> None:
        """The optimizer left a step that writes this block's host copies running
        (defer_blocks=): `wait()` returns once it is done; called before they are read."""
        self.deferred.append(wait)

    def wait_steps(self, ahead: bool = False) -> bool:
        """Waits for the deferred steps writing the host copies (raises what one
        raised); then each optimizer stepping it in backward raises if the steps it ran
        left some of its params new and others waiting for step() (a reader would see
        the block half stepped: step_in_backward). `ahead` (a fetch ahead of its use,
        which may never come: the blocks run in another order than recorded) returns
        False instead of raising."""
        while self.deferred:
            try:
                self.deferred[0]()
            except (KeyboardInterrupt, ForkedChildError):
                raise   # (the step still runs, or never ends here: the next read waits again)
            except BaseException:
                self.deferred.pop(0)   # (it ran, and raised: done)
                raise
            self.deferred.pop(0)
        for early in list(self.step_checks.keys()):
            if early.holds(self):   # a step held for after step() (defer_blocks=)
                if ahead:
                    return False
                early.release()
            if not ahead:
                early.check_block(self)
            elif early.half_stepped(self):
                return False
        return True

    def start_write(self) -> None:
        with self.written:
            self.writers += 1

    def end_write(self) -> None:
        with self.written:
            self.writers -= 1
            self.written.notify_all()

    def writing_done(self) -> None:
        """Waits until no write of the host copies is in progress (a CPU step on the
        engine's worker, step_in_backward): a read meanwhile would see some params old,
        one half written. The caller holds `written` when it must keep new writes from
        starting until it is done (a fetch: until its copies are set)."""
        with self.written:
            self.written.wait_for(lambda: self.writers == 0)

    def check_held(self) -> None:
        """Each streamed param is still the one its module holds: one replaced after
        stream_params (`block.up.weight = nn.Parameter(...)`, or a weight tied to another
        block's) would compute with values the streamer knows nothing of, and the model's
        state_dict() would show the old host copy."""
        for module, path, attr, k in self.holders:
            now = module._parameters.get(attr)
            if now is not self.params[k]:
                name = f"{path}.{attr}" if path else attr
                if isinstance(now, torch.Tensor) and not isinstance(now, torch.nn.Parameter):
                    # (torch.func.functional_call's swap for the call, torch.func.grad's)
                    raise RuntimeError(
                        f"offload_adam.stream_params: param {self.name}.{name} of a "
                        f"streamed block holds a tensor that is not it for this call "
                        f"({type(now).__name__}: torch.func.functional_call or "
                        "torch.func.grad swapping tensors in): a streamed block computes "
                        "with its own params only. Call it with tensors for params outside "
                        "the streamed blocks, or on the model without streaming")
                if _parametrized(module, attr):
                    raise _parametrized_error(f"param {self.name}.{name} of a streamed block")
                raise RuntimeError(
                    f"offload_adam.stream_params: param {self.name}.{name} of a streamed block "
                    "was replaced after stream_params (assigned, or tied to another param); "
                    "the streamer and the optimizer hold the old one. Replace or tie params "
                    "before stream_params, or close() the streamer first")

    @_outside_transforms
    def show(self, tensors: List[torch.Tensor]) -> None:
        """Each param shows its tensor in `tensors` (device copies, host copies or
        placeholders)."""
        for p, t in zip(self.params, tensors):
            p.data = t
        self.versions = ([p._version for p in self.params] if tensors is self.placeholders
                         else None)
        self.used_versions = ([p._version for p in self.params]
                              if tensors is self.device_tensors else None)

    def written_in_use(self) -> List[str]:
        """The params written in place while they showed their device copies (an
        nn.Embedding(max_norm=...) renormalising its rows in its forward, a write under
        no_grad in a forward), or given other memory (`self.weight.data = renorm(...)`,
        a max-norm constraint's way: no version counter moves): the device copy goes back
        after the use, and the write with it; the optimizer's own bumps are counted
        (Home.bumped). A write through .data in place (`w.data.clamp_()`) moves no counter
        and keeps the memory: not seen (README, streamed params)."""
        if self.used_versions is None:
            return []
        return [n for n, p, v, t in zip(self.names, self.params, self.used_versions,
                                        self.device_tensors)
                if p._version != v or p.data_ptr() != t.data_ptr() or p.shape != t.shape
                or p.dtype != t.dtype]

    def check_unwritten(self, values: bool = False) -> None:
        """No param was written while it showed its placeholder: such a write lands in
        the placeholder, not in the host copy, and would be lost without a word. Seen:
        p.data = t (the param no longer shows its placeholder); an in-place write
        through the param (p.zero_(), nn.init on it, torch's own optimizer stepping it:
        torch bumps the param's version counter; the optimizer's own bumps are counted,
        Home.bumped); and with `values` (state_dict, load_state_dict, close: reading it
        syncs the device, too dear at each fetch) one through p.data (p.data.zero_(),
        p.data.normal_(): a tensor of its own version counter), which left the
        placeholder's one element other than NaN (0 for a complex param, whose zero_()
        is not seen). Raised once: the param shows its placeholder, NaN again, after."""
        if self.versions is None:
            return
        assigned = [k for k, (p, t) in enumerate(zip(self.params, self.placeholders))
                    if p.data_ptr() != t.data_ptr() or p.shape != t.shape
                    or p.dtype != t.dtype or p.device != t.device]
        written = [k for k, (p, v) in enumerate(zip(self.params, self.versions))
                   if p._version != v and k not in assigned]
        floats = [k for k, t in enumerate(self.placeholders) if t.is_floating_point()]
        if values and not written and floats:
            with torch.no_grad():   # (one read of the device for the block)
                firsts = torch.cat([self.placeholders[k].as_strided((1,), (1,)).float()
                                    for k in floats])
                kept = torch.isnan(firsts).tolist()
            written = [k for k, nan in zip(floats, kept) if not nan and k not in assigned]
        if not assigned and not written:
            return
        with torch.no_grad():
            for t in self.placeholders:
                t.fill_(math.nan if t.is_floating_point() else 0)
        self.show(self.placeholders)
        names = [self.names[k] for k in (assigned or written)]
        which = (f"param {self.name}.{names[0]}"
                 f"{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} of a streamed block")
        para = [f"{self.name}.{path + '.' if path else ''}{attr}"
                for module, path, attr, k in self.holders
                if k in (assigned or written) and _parametrized(module, attr)]
        if para:   # (register_parametrization wrote the placeholder with set_)
            raise _parametrized_error(f"param {para[0]} of a streamed block")
        if assigned:
            raise RuntimeError(
                f"offload_adam.stream_params: {which} was assigned (p.data = t) between its "
                "uses: a streamed param's values are its host copy, which the assignment did "
                "not reach; it was dropped (the param shows its placeholder again). Load "
                "values with model.load_state_dict(...) (or a submodule's), or assign them "
                "before stream_params")
        raise RuntimeError(
            f"offload_adam.stream_params: {which} was written in place between its uses "
            "(p.zero_(), p.data.normal_(), p.copy_(), nn.init on it, another optimizer's "
            "step): between uses a streamed param shows a placeholder, so the write did "
            "not reach its values and was dropped. Load values with "
            "model.load_state_dict(...), write them before stream_params, and step "
            "streamed params with offload_adam's optimizer")

    def settle(self) -> None:
        """Waits for the last fetch's copies; copies set meanwhile (another thread's
        fetch) are kept for the next settle, not dropped unwaited."""
        with self._copies_lock:
            copies = self.copies
        if copies:
            self.streamer.device.wait_host(*copies)
            with self._copies_lock:
                if self.copies is copies:
                    self.copies = []

    def set_copies(self, copies: list) -> None:
        with self._copies_lock:
            self.copies = copies

    def views(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """Each param's host copy in the block's buffer (uint8)."""
        return [buffer[off:off + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                for p, off in zip(self.params, self.offsets)]

    def host_views(self) -> List[torch.Tensor]:
        """The host copies now: in RAM, or in the block's cache slot (as the holder
        holds it; loaded if no one does; valid until the cache reuses the slot: see
        Home)."""
        files = self.streamer.files
        if files is None:
            return self.homes
        return self.views(files.peek(self.index))

    def hold(self, fills: Optional[List[Tuple[int, int]]] = None) -> list:
        """Keeps the block in its cache slot (param files), loaded; `fills`: the bytes
        the caller writes instead, the rest not read for it (returns those the slot did
        not hold: see param_files.hold_to_write)."""
        files = self.streamer.files
        if files is None:
            return []
        if fills is None:
            files.hold(self.index)
            return []
        return files.hold_to_write(self.index, fills)[1]

    def unhold(self, dirty: bool, stepped: int = 0,
               unwritten: Sequence[Tuple[int, int]] = (),
               written: Optional[Sequence[Tuple[int, int]]] = None) -> None:
        if stepped:   # the CPU step
            if self.awaiting and not self.step_started:
                self.step_started = True
                self.streamer._step_writes += 1
                self.step_order = self.streamer._step_writes
            self.unstepped -= stepped
            self.awaiting = self.awaiting and self.unstepped > 0
            self.trained = True
        if self.streamer.files is not None:
            self.streamer.files.unhold(self.index, dirty, unwritten, written,
                                       by_step=bool(stepped))


def _refuse_compiled() -> None:
    """A streamed model (or block) run by torch.compile (Hugging Face's torch_compile=True
    compiles the model): the streamer's hooks move each block's params between calls,
    which a compiled graph does not follow. inductor failed in the forward and aot_eager in
    backward, with torch's errors from deep inside, and the eager backend trained on
    other values than uncompiled, silently (found from outside). Refused in any compiled
    region: while dynamo traces the hook, and when it runs the hook uncompiled after a
    graph break (its frame callback still set)."""
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    callback = getattr(frames, "get_eval_frame_callback", lambda: None)()
    if torch.compiler.is_compiling() or callback is not None:
        raise RuntimeError(
            "offload_adam: torch.compile of a model streamed by stream_params (or of its "
            "streamed blocks) is not supported: the streamer's hooks move each block's "
            "params between calls, which a compiled graph does not follow. Stream the "
            "model uncompiled (Hugging Face's Trainer: torch_compile=False), or compile it "
            "without streaming; torch.compile(opt.step) runs")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ParamStreamer:
    """The streaming of one model's blocks (see the module docstring); made by
    `stream_params`. `fetched_bytes`: host-to-device bytes of params sent so far."""

    def __init__(self, model: torch.nn.Module, blocks: BlockSpec, prefetch: int = 2,
                 device=None, param_dirs=None, param_cache_mb=None):
        try:   # (any integer type: a numpy int from a config, as torch takes them)
            count = operator.index(prefetch) if not isinstance(prefetch, bool) else -1
        except TypeError:
            count = -1
        if count < 0:
            raise ValueError(f"offload_adam.stream_params: prefetch must be an int >= 0, "
                             f"got {prefetch!r}")
        prefetch = count
        param_dirs = _check_files(param_dirs, param_cache_mb)
        blocks = _module_names(model, blocks)
        blocks = _names_of(blocks) or blocks   # (an iterator of names: read once)
        self.model, self.prefetch = model, prefetch
        self.device, self.torch_device = _device_of(model, device)
        found = _find_blocks(model, blocks)
        if not found:
            raise ValueError("offload_adam.stream_params: no module of the model matches "
                             f"blocks={blocks!r}")
        _check_meta_buffers(model)
        # The files first (their sizes are the shapes', a meta model's too): refused, they
        # leave the model as it was, meta params included
        self.files: Optional[ParamFiles] = None
        if param_dirs is not None:
            sizes = [_offsets([p for _, p in ps])[1] for _, _, ps in found]
            largest = max(round_up(max(size, 1), ALIGN) for size in sizes)
            cache = (param_cache_mb * 2**20 if param_cache_mb is not None
                     else default_cache_slots(prefetch) * largest)
            self.files = ParamFiles(param_dirs, sizes, cache, prefetch, self.device,
                                    settle=lambda i: self.blocks[i].settle())
            self.files.rank = self._rank
        # Refused from here on (a param file's write failing as the blocks go in, a
        # Ctrl-C), the model is put back as it was too: its params, their grads and
        # buffers, and no hook (_undo); else it stayed half streamed, beyond close() and a
        # second stream_params ("streams already"): found from outside
        before = _model_as_it_is(model)
        self._handles: list = []
        self._guarded: list = []
        self.blocks: List[_Block] = []
        try:
            self._set_up(model, blocks, found)
        except BaseException:
            self._undo(before)
            raise

    def _set_up(self, model: torch.nn.Module, blocks: BlockSpec, found) -> None:
        # the streamed params that were meta (NaN, one element expanded): a block of them
        # alone is not written to its param file (ParamFiles.blank)
        unset: set = set()
        if any(p.is_meta for p in model.parameters()):
            unset = _replace_meta(model, {id(p) for _, _, ps in found for _, p in ps},
                                  self.torch_device)
            found = _find_blocks(model, blocks)
        self.blocks = [_Block(self, i, name, m, params)
                       for i, (name, m, params) in enumerate(found)]
        _find_counter_peers(self.blocks)
        for block in self.blocks:
            block.offsets, block.size = _offsets(block.params)
        self.fetched_bytes = 0
        self._backward_uses = 0
        self._step_writes = 0
        self._order: Optional[List[Tuple[int, str]]] = None   # recorded uses
        self._uses: Dict[int, List[int]] = {}   # each block's positions in _order
        self._gap: List[int] = []   # at each position of _order: the uses until its block's next
        self._recording: List[Tuple[int, str]] = []   # ... until a backward completes
        # (a model's forward starts it anew: _new_pass; a run of uses without one, blocks
        # called on their own, starts anew past this many)
        self._record_cap = 64 * len(self.blocks) + 1024
        # the fetch hooks of this forward's blocks (on their outputs): [block, outputs,
        # ticket, handle], registered again after the next block's release (_fetch_after)
        self._fetch_hooks: list = []
        # the release hooks on the blocks' inputs (_pre_forward), [handle, fired, ends of
        # backward seen]: removed once they fired, or a backward ended twice without them
        # (their graph never backpropagated). Torch's "all" multi-grad hook holds the
        # inputs' autograd nodes, on which it sits: a cycle through C++ that the garbage
        # collector cannot see, which kept each step's graph alive (~4000 nodes and
        # ~50 MB after 800 steps of an 8-block model), and after close(); removed at the
        # end of backward, not in the hook (autograd is iterating the node's hooks then)
        self._input_hooks: List[list] = []
        self._cursor: Optional[int] = 0
        self._graph_task = None          # the backward whose end releases every block
        self._forward_thread: Optional[int] = None   # the thread of the last forward use
        self._thread_lock = threading.Lock()
        self._pinned: list = []   # the host copies' buffers, pinned
        # unpinned by close(), or when a streamer dropped without it is collected
        self._unpin = weakref.finalize(self, unpin_when_dropped, self.device, self._pinned)
        self._closed = False
        self._mapped_warned = False   # (_warn_mapped: once)
        self._move_resident()
        for block in self.blocks:
            self._take(block, unset)
            self._hook(block)
        self._handles.append(model.register_forward_pre_hook(lambda mod, args: self._new_pass()))
        self._guard_conversions()
        self._guard_backward_pre_hooks()
        _sync_global_hooks()
        _watch_other_optimizers(self)

    def _undo(self, before) -> None:
        """A set-up refused part way: the model as it was (`before`, _model_as_it_is),
        the hooks removed, the host memory and the param files let go."""
        self._unhook()
        for block in self.blocks:
            for p in block.params:
                set_home(p, None)
        params, data, buffers = before
        with torch.no_grad():
            for p, value, grad in data:
                if not p.is_meta:   # (a meta param was replaced, not changed: put back below)
                    p.data = value
                    p.grad = grad
        for module, key, p in params:
            module._parameters[key] = p
        for module, key, b in buffers:
            module._buffers[key] = b
        self._closed = True
        if self.files is not None:
            files, self.files = self.files, None
            try:
                files.close()
            except Exception:   # (the error being raised says more; the files are scratch)
                pass

    def _unhook(self) -> None:
        """What streaming set on the model and the process taken off (close, and _undo
        part way through the set-up): the blocks' registrations, the hooks, the guards
        _guard_conversions set on the modules; the host copies unpinned."""
        for block in self.blocks:
            _BLOCK_OF.pop(block.module, None)
        _sync_global_hooks()
        for h in self._handles + [entry[0] for entry in getattr(self, "_input_hooks", [])]:
            h.remove()
        self._handles, self._input_hooks = [], []
        for module in self._guarded:
            for attr in ("_apply", "__deepcopy__", "__reduce_ex__",
                         "register_full_backward_pre_hook"):
                module.__dict__.pop(attr, None)
        self._guarded = []
        unpin = getattr(self, "_unpin", None)   # (made part way through the set-up)
        if unpin is not None:
            unpin()
        _LIVE.discard(self)

    # ---- setup --------------------------------------------------------------------

    def _move_resident(self) -> None:
        """What does not stream goes to the device: the params outside the blocks and a
        block's integer ones (_find_blocks), every buffer (a block's included: they are
        small)."""
        streamed = {id(p) for b in self.blocks for p in b.params}
        with torch.no_grad():
            for p in self.model.parameters():
                if id(p) not in streamed and p.device != self.torch_device:
                    p.data = _moved(p.data, self.torch_device)
                    if p.grad is not None:
                        p.grad = p.grad.to(self.torch_device)
            for m in self.model.modules():
                for key, b in m._buffers.items():
                    if b is not None and b.device != self.torch_device:
                        m._buffers[key] = _moved(b, self.torch_device)

    def _take(self, block: _Block, unset: set) -> None:
        """Copies the block's params into one host buffer (pinned), or into its param file
        through the cache, and leaves each param a placeholder and an empty device tensor
        for its fetches. `unset`: the ids of the params that were meta."""
        # A block built on the meta device (every param NaN until a state dict is loaded)
        # with param files: its NaNs are made when it is read, not written to its file
        # (2 B/param, written again by the load that follows: a 70B model's 141 GB)
        blank = (self.files is not None and bool(block.params)
                 and all(id(p) in unset for p in block.params))
        if self.files is None:
            buffer = torch.empty(block.size, dtype=torch.uint8)
            if self.device.pin(buffer):
                self._pinned.append(buffer)
        elif blank:
            self.files.blank(block.index, lambda into, b=block: _fill_nan(b.views(into)))
        else:
            buffer = self.files.hold(block.index, read=False)
        homes = [None] * len(block.params) if blank else block.views(buffer)
        try:
            with torch.no_grad():
                for k, (p, home) in enumerate(zip(block.params, homes)):
                    if home is not None:
                        home.copy_(p.detach())
                    if self.files is None:
                        block.homes.append(home)
                    real = _empty_as(p, self.torch_device)
                    real.untyped_storage().resize_(0)
                    block.device_tensors.append(real)
                    block.placeholders.append(_nan(p, self.torch_device, full=False))
                    like = torch.empty(p.shape, dtype=p.dtype, device="meta")
                    p.grad = None
                    block.home_of.append(Home(block, k, like))   # (params.py holds it weakly)
                    set_home(p, block.home_of[-1])
            block.show(block.placeholders)
        finally:
            if self.files is not None and not blank:
                self.files.unhold(block.index, dirty=True)

    def _hook(self, block: _Block) -> None:
        m = block.module
        _BLOCK_OF[m] = (weakref.ref(self), block.index)   # (weakly: no cycle through m)
        self._handles += [
            # (prepended: a pre-hook the user registered before, weight_norm's say, reads
            # the params fetched, not their placeholders)
            m.register_forward_pre_hook(lambda mod, args, kwargs, b=block:
                                        self._pre_forward(b, args, kwargs), with_kwargs=True,
                                        prepend=True),
            m.register_forward_hook(lambda mod, args, out, b=block: self._post_forward(b, out)),
            m.register_forward_hook(lambda mod, args, out, b=block: self._forward_ended(b),
                                    always_call=True),
        ]
        block.first_hook = self._handles[-3].id
        block.last_hooks = [h.id for h in self._handles[-2:]]
        # Each module that holds some of the block's params (the block, or a submodule)
        # shows their host copies in its own state_dict() and loads into them, also when
        # called on its own (block.up.state_dict()); a submodule called outside the
        # block's forward and backward would compute with the placeholders: refused.
        held: Dict[int, Tuple[torch.nn.Module, str, List[Tuple[str, int]]]] = {}
        for module, path, attr, k in block.holders:
            held.setdefault(id(module), (module, path, []))[2].append((attr, k))
        for module, path, entries in held.values():
            self._handles += [
                module._register_state_dict_hook(lambda mod, sd, prefix, meta, b=block, e=entries:
                                                 self._state_dict(b, sd, prefix, e)),
                module._register_load_state_dict_pre_hook(
                    lambda sd, prefix, meta, *rest, b=block, e=entries, mod=module:
                    self._before_load(b, meta, [prefix + a for a, _ in e if prefix + a in sd],
                                      mod)),
                module.register_load_state_dict_post_hook(
                    lambda mod, keys, b=block: self._after_load(b)),
            ]
            # First of the module's: a hook of the user's registered before stream_params
            # sees the host copies, not the placeholders (its result was overwritten by
            # ours, or it read NaN: found from outside)
            for hooks, handle in ((module._state_dict_hooks, self._handles[-3]),
                                  (module._load_state_dict_pre_hooks, self._handles[-2])):
                hooks.move_to_end(handle.id, last=False)
            if module is not m:
                self._handles.append(module.register_forward_pre_hook(
                    lambda mod, args, b=block, path=path: self._inner_use(b, mod, path)))

    @staticmethod
    def _hooks_last(block: _Block) -> None:
        """The block's release (and its always-called end) run after every other forward
        hook of its module, those registered after stream_params too (a hook logging a
        weight's norm would read the placeholder's NaN): moved to the end when another
        came after them."""
        hooks = block.module._forward_hooks
        if list(hooks)[-2:] != block.last_hooks:
            for hook_id in block.last_hooks:
                if hook_id in hooks:
                    hooks.move_to_end(hook_id)

    def _warn_mapped(self, block: _Block) -> None:
        """A RuntimeWarning (once per streamer) when the CPU step writes a block of which
        a model.state_dict() still held maps tensors from the param files: they are the
        file's bytes, copy-on-write, and a block written back to it shows the new values
        while one still in the cache shows the old (the dict, kept, is then a mix of steps;
        from host RAM they are the live host copies, as torch's are the live params)."""
        held = len(block.mapped_out)
        for b in self.blocks:
            b.mapped_out = weakref.WeakSet()
        if self._mapped_warned:
            return
        self._mapped_warned = True
        warn(f"offload_adam.stream_params: {held} tensors of block {block.name} from a "
             "model.state_dict() are still held, and the step writes the block: with "
             "param_dirs= they are mapped from the param files (not copied) and would show "
             "part of the model at one step and part at another. Save or copy what "
             "model.state_dict() gives before the next step(), and drop it after (said once)",
             RuntimeWarning)

    @staticmethod
    def _fetch_first(block: _Block) -> None:
        """The block's fetch runs before every other forward pre-hook of its module, those
        registered after stream_params with prepend=True too (one reading a weight read
        the placeholder's NaN): moved to the front, at the model's forward (a module's
        pre-hooks are listed before the first runs) and at the block's, for its next.
        A global one (register_module_forward_pre_hook) runs before any module's: while
        there is one, ours runs before it (_sync_global_hooks)."""
        hooks = block.module._forward_pre_hooks
        if block.first_hook in hooks and next(iter(hooks)) != block.first_hook:
            hooks.move_to_end(block.first_hook, last=False)

    def _inner_use(self, block: _Block, module: torch.nn.Module, path: str) -> None:
        if block.state != "here":
            raise RuntimeError(
                f"offload_adam.stream_params: {block.name}.{path} ({type(module).__name__}) "
                f"was called outside the forward and backward of its streamed block "
                f"{block.name}, whose params are on the device only while the block runs. "
                f"Stream a module that contains every use of it (blocks=), or keep it out "
                f"of the streamed blocks")

    def _guard_conversions(self) -> None:
        """model.to(dtype), .float(), .half(), .cpu() and the like would replace a streamed
        param's placeholder by a tensor of NaNs of its full size, and the streamer would go
        on with the old host copies: each module that holds streamed params (a block or an
        ancestor) checks a conversion against them first, and refuses it before anything
        is converted. A conversion that leaves them as they are (model.to(their dtype))
        goes through."""
        under: dict = {}   # module name -> [(block, the ids of its params there: None, all)]
        for block in self.blocks:
            parts = block.name.split(".") if block.name else []
            for i in range(len(parts) + 1):
                under.setdefault(".".join(parts[:i]), []).append((block, None))
            for sub, module in block.module.named_modules():
                if sub:   # a submodule: .half() of it would change the params it holds
                    ids = {id(p) for p in module.parameters()}
                    under.setdefault(f"{block.name}.{sub}", []).append((block, ids))
        self._guarded = []
        streamed = {id(p) for block in self.blocks for p in block.params}
        for name, module in self.model.named_modules():
            if name in under:
                module._apply = self._guarded_apply(module, name, under[name])
                refuse = self._refused_copy(name, [b for b, _ in under[name]])
                module.__dict__["__deepcopy__"] = module.__dict__["__reduce_ex__"] = refuse
                self._guarded.append(module)
                keys = [n for n, p in module.named_parameters(remove_duplicate=False)
                        if id(p) in streamed]
                self._handles.append(module._register_load_state_dict_pre_hook(
                    self._refuse_assign(name, keys), with_module=True))

    def _guard_backward_pre_hooks(self) -> None:
        """A full backward pre-hook of a block's module (register_full_backward_pre_hook)
        runs before the grads reach the block's outputs, where the fetch for its backward
        starts: one reading a weight read the placeholder's NaN (on a GPU, raced the
        copy). Each such hook, registered before stream_params or after, fetches the
        block first. A global one (register_module_full_backward_pre_hook) runs before
        any module's: while there is one, ours runs before it (_sync_global_hooks)."""
        for block in self.blocks:
            module = block.module
            for key, hook in list(module._backward_pre_hooks.items()):
                module._backward_pre_hooks[key] = self._fetching(block, hook)
            register = type(module).register_full_backward_pre_hook.__get__(module)

            def registered(hook, *args, b=block, register=register, **kwargs):
                return register(self._fetching(b, hook), *args, **kwargs)
            module.__dict__["register_full_backward_pre_hook"] = registered
            self._guarded.append(module)

    def _fetching(self, block: _Block, hook):
        def fetched_first(module, grad_output):
            if not self._closed:
                self._hook_fetch(block)
            return hook(module, grad_output)
        return fetched_first

    def _hook_fetch(self, block: _Block) -> None:
        """The fetch for the block's backward, from its module's backward pre-hook (once
        per backward: a recompute of checkpointing fetched it already, or another such
        hook did); the grad hook of its outputs that follows is then not a second use."""
        if block.hook_fetched or (block.state == "here" and block.backward_task is not None
                                  and block.backward_task == torch._C._current_graph_task_id()):
            return
        self._pre_backward(block, block.ticket)
        block.hook_fetched = True

    def _refused_copy(self, name: str, blocks: List[_Block]):
        """copy.deepcopy, copy.copy and pickling (torch.save(model)) of a module holding
        streamed params: the copy would have their NaN placeholders and the original's
        hooks (it would compute NaN while its state_dict() showed the original's
        values): refused, naming the way that works."""
        def refuse(*args, **kwargs):
            raise RuntimeError(
                f"offload_adam.stream_params: {name or 'the model'} holds the streamed params "
                f"of block {blocks[0].name} (between uses NaN placeholders of their shape, "
                "streamed by hooks of this model): it cannot be copied or pickled. Save or "
                "copy model.state_dict() (the real values), copy the model before "
                "stream_params, or close() the streamer first")
        return refuse

    def _refuse_assign(self, name: str, keys: Sequence[str]):
        """load_state_dict(assign=True) of a dict holding a streamed param (`keys`: their
        names under the module) would put the loaded tensors in place of them (then
        resident, of the dict's dtype, and no longer the ones the streamer and optimizer
        step): refused before anything is loaded (the hook of the outermost module that
        holds them runs first). A dict of other params (an adapter's, peft's
        low_cpu_mem_usage load) goes through."""
        def hook(module, state_dict, prefix, local_metadata, *rest):
            if local_metadata.get("assign_to_params_buffers") and any(
                    prefix + k in state_dict for k in keys):
                raise RuntimeError(
                    f"offload_adam.stream_params: load_state_dict(assign=True) into "
                    f"{name or 'the model'} would replace streamed params by the loaded "
                    "tensors; nothing was loaded. Load with assign=False (the default): the "
                    "values are copied into the streamed params' host copies (a model built "
                    "on the meta device and streamed loads that way too)")
        return hook

    def _guarded_apply(self, module: torch.nn.Module, name: str, blocks: list):
        original = type(module)._apply.__get__(module)

        def _apply(fn, *args, **kwargs):
            for block, ids in blocks:
                for p, placeholder in zip(block.params, block.placeholders):
                    if (ids is None or id(p) in ids) and fn(placeholder) is not placeholder:
                        raise RuntimeError(
                            f"offload_adam.stream_params: converting "
                            f"{name or 'the model'} ({type(module).__name__}: model.to, "
                            f".float(), .half(), .cpu() and the like) would change the "
                            f"streamed params of block {block.name} ({p.dtype} on "
                            f"{self.torch_device}); nothing was converted. Convert the "
                            f"model before stream_params, or close() the streamer first")
            return original(fn, *args, **kwargs)
        return _apply

    # ---- the hooks ---------------------------------------------------------------------

    def _new_pass(self) -> None:
        """A forward of the model: until a backward completes, the order is recorded
        anew from here, so that it is the last pass's before that backward (a training
        micro-batch's), not that of the inference passes before it (their recording
        kept, it grew with each, and prefetch fetched ahead what the pass did not use)."""
        _refuse_compiled()
        if not _in_backward():
            self._one_thread_forwards(None)
            self._fetch_hooks = []
        if self._order is None and not _in_backward():
            self._recording = []
        for block in self.blocks:
            self._fetch_first(block)
        _sync_global_hooks()

    def _begin_use(self, block: _Block) -> None:
        """The block is called: its params fetched (or already here), for its forward or
        the recompute of activation checkpointing in backward."""
        block.check_held()
        self._hooks_last(block)
        self._fetch_first(block)
        if _in_backward():   # the recompute of activation checkpointing
            self._note_backward()   # (reentrant: no forward hook saw this backward coming)
            if block.state != "here" or block.stale:
                self._use(block, "b")
        else:
            self._one_thread_forwards(block)
            self._end_raised_backward()
            self._use(block, "f")

    def _one_thread_forwards(self, block: Optional[_Block]) -> None:
        """A forward on one thread while another thread's is in a block (`block`: the
        one called, marked forwarding; None: the model's forward starting): each released
        the blocks the other used (a block's forward that raised releases every block),
        so one computed with placeholders (NaN, silently) or was told a submodule ran
        outside its block (found from outside). Refused before anything moves, and the
        refused call's end releases nothing (_forward_ended). (In backward, autograd runs
        the hooks on threads of its own: not checked.)"""
        me = threading.get_ident()
        with self._thread_lock:   # (the check and the mark at once: two threads at a time)
            other = self._forward_thread
            # (the blocks looked at only after another thread's forward: not per block use)
            busy = ([b.name for b in self.blocks if b.forwarding]
                    if other is not None and other != me else [])
            if busy:
                what = f"block {block.name} was called" if block is not None else \
                    "the model was called"
                raise RuntimeError(
                    f"offload_adam.stream_params: {what} in a forward on one thread while "
                    f"another thread's forward of this streamed model is in block {busy[0]}: "
                    "the blocks are fetched and released for one forward at a time. Run the "
                    "forwards one after another (a lock around them), or stream a model per "
                    "thread")
            self._forward_thread = me
            if block is not None:
                block.forwarding = True

    def _global_fetch(self, block: _Block) -> None:
        """From the global forward pre-hook, before the user's global ones: the block's
        fetch for this call, which its own pre-hook then does not repeat."""
        if not block.early:
            self._begin_use(block)
            block.early = True

    def _pre_forward(self, block: _Block, args, kwargs):
        _refuse_compiled()
        if block.early:   # (the global pre-hook fetched it for this call)
            block.early = False
        else:
            self._begin_use(block)
        if not torch.is_grad_enabled():
            return
        # Released once the grads of the inputs are computed: after the block's backward,
        # and (a reentrant checkpoint's recompute, whose graph is backpropagated on its
        # own) after the recomputed block's. A hook on the inputs, not a node between
        # them and the block: a node would change the order autograd sums the grads of an
        # input used outside the block too (a residual), and the grads in the last bits.
        # Hooks on one tensor run in the order they were registered: on the output of a
        # block's first use that is the input of its second (a block called twice), the
        # first use's fetch for backward runs before the second use's release, which
        # then leaves the block on the device (`ticket`: the backward use it ends).
        inputs, _ = _grad_tensors((args, kwargs))
        block.inputs_need_grad = bool(inputs)
        block.first_node = _next_node_number()
        block.input_nodes = {t.grad_fn for t in inputs if t.grad_fn is not None}
        block.ticket = ticket = [None]   # (set by _post_forward's hook: _pre_backward)
        if inputs:   # (none: nothing flows back through them, end of backward releases it)
            entry = [None, False, 0]
            entry[0] = _AllGrads(inputs, _weakly(self, "_backward_done", block, ticket, entry))
            # (the entries of graphs dropped unused, an evaluation run with grad enabled,
            # let go here: no backward comes to)
            self._input_hooks = [e for e in self._input_hooks if e[0].alive()]
            self._input_hooks.append(entry)
            self._fetch_after(block, inputs)

    def _fetch_after(self, block: _Block, inputs: List[torch.Tensor]) -> None:
        """The fetch for backward of the blocks whose output is an input of `block` (the
        block before) registered again, after `block`'s release: on one tensor the hooks
        run in the order registered, and the block before's, registered first, fetched
        it and `prefetch` ahead while this one was still on the device: a block more than
        the k + 1 the prefetch needs. (Not for the block itself, called twice: its first
        use's fetch then keeps it on the device for its second, `ticket`.)"""
        mine = {id(t) for t in inputs}
        for entry in self._fetch_hooks:
            other, refs, ticket, handle = entry
            outs = [r() for r in refs]
            if other is not block and all(t is not None for t in outs) \
                    and any(id(t) in mine for t in outs):
                handle.remove()
                entry[3] = self._fetch_hook(other, outs, ticket)

    def _fetch_hook(self, block: _Block, outs: List[torch.Tensor], ticket: list):
        return torch.autograd.graph.register_multi_grad_hook(
            outs, _weakly(self, "_pre_backward", block, ticket), mode="any")

    def _guard_nodes(self, block: _Block, outs: List[torch.Tensor]) -> None:
        """A pre-hook on each autograd node the block's forward made that leads to its
        outputs: backward can reach those nodes by another way than the outputs, whose
        hook fetches the block (a KV cache made with grad and read by a later forward,
        a loss on the attention maps a forward hook took out), and the first of them to
        run fetches the block instead (it read the released params: torch's 'setStorage:
        ... out of bounds for storage of size 0', found from outside). Costs a walk of
        the block's nodes at each forward (a Llama layer's 78: ~0.25 ms) and a check as
        each runs."""
        hook = _weakly(self, "_node_fetch", block, block.ticket)
        first, stop = block.first_node, block.input_nodes
        seen = set()
        stack = [t.grad_fn for t in outs]
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in stop:
                continue
            seen.add(node)
            number = node._sequence_nr()
            if number < first or number == _LEAF_NODE:   # made before, or a param's
                continue
            node.register_prehook(hook)
            stack.extend(n for n, _ in node.next_functions)

    def _node_fetch(self, block: _Block, ticket: list) -> None:
        """A node of the block's forward is about to run in backward (_guard_nodes): the
        block is fetched for it unless this backward has it on the device already."""
        if self._closed or (block.state == "here" and block.backward_task is not None
                            and block.backward_task == torch._C._current_graph_task_id()):
            return
        block.hook_fetched = False   # (a fetch of this backward's, released since)
        self._hook_fetch(block)

    def _backward_done(self, block: _Block, ticket: list) -> None:
        if ticket[0] is None or ticket[0] == block.backward_use:
            written = block.written_in_use()
            self._release(block)
            _refuse_written(block, written, "backward")

    def _post_forward(self, block: _Block, output):
        """Releases the block's params; returns the output to use instead (None: the
        block's own), with a copy of any tensor in it that is a view of one of them."""
        if _in_backward():
            return None   # a recompute: its backward comes next and releases it
        unaliased = self._unaliased(block, output)
        if unaliased is not None:
            output = unaliased
        if torch.is_grad_enabled():
            outs, opaque = _grad_tensors(output)
            if not outs and opaque and (block.inputs_need_grad
                                        or any(p.requires_grad for p in block.params)):
                # (raised before it is done forwarding: _forward_ended gives every block back)
                raise RuntimeError(
                    f"offload_adam.stream_params: block {block.name} "
                    f"({type(block.module).__name__}) returned a "
                    f"{type(opaque[0]).__name__}, in which the streamer finds no tensor: its "
                    "backward would run without its params fetched. Return tensors (in "
                    "tuples, lists, dicts or dataclasses), or register the type with "
                    "torch.utils._pytree (register_pytree_node)")
            if outs:   # (this forward's, for _fetch_after, the outputs held weakly: a
                # forward or the end of a backward starts them anew)
                self._fetch_hooks.append([block, [weakref.ref(t) for t in outs],
                                          block.ticket,
                                          self._fetch_hook(block, outs, block.ticket)])
                self._guard_nodes(block, outs)
        block.input_nodes = set()
        block.forwarding = False
        written = block.written_in_use()
        self._release(block)
        _refuse_written(block, written, "forward")
        return unaliased

    def _unaliased(self, block: _Block, output):
        """The output with a copy of each tensor that views a param of the block (learned
        queries returned expanded, a weight returned for a tied head), or None when none
        does. The params' device memory goes back when the forward ends, and such a view
        would read freed memory; its copy is what it read at the time (and its grad flows
        to the param through the copy)."""
        mine = {(t.device, t.untyped_storage().data_ptr()) for t in block.device_tensors
                if t.untyped_storage().nbytes()}

        def views_mine(x) -> bool:
            if not (isinstance(x, torch.Tensor) and x.layout == torch.strided
                    and x.device.type != "meta"):
                return False
            try:
                return (x.device, x.untyped_storage().data_ptr()) in mine
            except (RuntimeError, NotImplementedError):   # (a subclass without storage)
                return False

        leaves, spec = tree_flatten(output)
        hit = [views_mine(x) for x in leaves]
        # (in a dataclass pytree keeps whole, a tensor cannot be replaced)
        if any(views_mine(x) for x in _leaves([x for x in leaves if _is_dataclass(x)])):
            raise RuntimeError(
                f"offload_adam.stream_params: block {block.name} "
                f"({type(block.module).__name__}) returned a view of one of its params "
                "inside an object the streamer cannot rebuild; the params' device "
                "memory is given back after the forward. Return a copy (.clone()), or "
                "return tensors in tuples, lists, dicts or registered pytree types")
        if not any(hit):
            return None
        return tree_unflatten([x.clone() if h else x for x, h in zip(leaves, hit)], spec)

    def _forward_ended(self, block: _Block) -> None:
        """Called after the block's forward even when it raised (always_call): then
        _post_forward did not run, and the block and those fetched ahead for it would
        stay on the device until their next use, in the way of a retry (an out-of-memory
        error caught and the batch halved): all go back now. A first micro-batch that
        raised is recorded again from the next forward on, as after a backward that did."""
        block.early = False   # (a hook between the global fetch and the block's raised)
        if not block.forwarding or threading.get_ident() != self._forward_thread:
            return   # (not its forward: another thread's, this one's refused)
        block.input_nodes = set()   # (nor the graph behind them kept till the next)
        block.forwarding = False
        for b in self.blocks:
            self._release(b)
        if self._order is None:
            self._recording = []

    def _pre_backward(self, block: _Block, ticket: list) -> None:
        if block.hook_fetched:   # (a backward pre-hook of its module fetched it: _hook_fetch)
            block.hook_fetched = False
            ticket[0] = block.backward_use
            return
        if torch.is_grad_enabled():   # (autograd's grad mode in backward: create_graph)
            raise RuntimeError(
                f"offload_adam.stream_params: a backward with create_graph=True reached "
                f"streamed block {block.name}: the graph of the grads it would build reads "
                "the block's params after the block gave them back, and nothing fetches "
                "them for its backward (a double backward, a gradient penalty; "
                "torch.func.grad, vjp and jacrev build that graph). Keep the "
                "modules such a backward goes through out of the streamed blocks")
        self._note_backward()
        self._use(block, "b")
        ticket[0] = block.backward_use

    def _note_backward(self) -> None:
        """The end of the backward running now releases every block (once per backward)."""
        task = torch._C._current_graph_task_id()
        if task != self._graph_task:
            self._graph_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_raised_backward(self) -> None:
        """Outside backward: the last backward raised (a Ctrl-C, an out-of-memory error, a
        hook's): its end never ran, the blocks it fetched are still here; ended now."""
        if self._graph_task is not None and not _in_backward():
            self._end_of_backward(completed=False)

    def _end_of_backward(self, completed: bool = True) -> None:
        """`completed=False`: at the next forward after a backward that raised (in a hook,
        a custom Function's backward). Autograd runs the callbacks queued on a backward
        only when it completes, and an _AfterBackward only once grads reach it: the blocks
        that backward fetched (the one in use, those ahead) stayed on the device."""
        self._graph_task = None
        self._fetch_hooks = []
        for block in self.blocks:
            block.hook_fetched = False
        kept = []
        for entry in self._input_hooks:
            if entry[1] or entry[2] >= 1:
                entry[0].remove()
            else:
                entry[2] += 1
                kept.append(entry)
        self._input_hooks = kept
        for block in self.blocks:
            self._release(block)
        if self._order is None and not completed:
            self._recording = []   # the first micro-batch stopped part way: recorded again
        if self._order is None and self._recording:
            self._order = self._recording
            for q, (i, _) in enumerate(self._order):
                self._uses.setdefault(i, []).append(q)
            n = len(self._order)
            self._gap = [min(((u - q) % n or n for u in self._uses[i]), default=n)
                         for q, (i, _) in enumerate(self._order)]
        self._cursor = 0

    # ---- fetch, use, release --------------------------------------------------------

    @_outside_transforms
    def _use(self, block: _Block, phase: str) -> None:
        """The block is about to compute: its params on the device, published to the
        current stream; the next uses in the recorded order fetched ahead."""
        key = (block.index, phase)
        ahead: Sequence[Tuple[int, str]] = ()
        if self._order is None:
            if len(self._recording) >= self._record_cap:
                self._recording = []
            self._recording.append(key)
        else:
            self._cursor = _advance(self._order, self._cursor, key)
            if self._cursor is not None:
                ahead = self._order[self._cursor:self._cursor + self.prefetch]
        # no backward follows a forward without grad (an eval between steps): the
        # backward's uses in the window would stay on the device after it, prefetch - 1
        # blocks of device memory until the next forward
        forward_only = phase == "f" and not torch.is_grad_enabled()
        if forward_only:
            ahead = [use for use in ahead if use[1] == "f"]
        block.awaiting = phase == "b" and block.trained
        if phase == "b":
            block.unstepped = sum(p.numel() for p in block.params if p.requires_grad)
            block.whole = block.unstepped == sum(p.numel() for p in block.params)
            block.step_started = False
            self._backward_uses += 1
            block.backward_use = self._backward_uses
            block.backward_task = torch._C._current_graph_task_id()
        self._fetch(block)
        self.device.publish(block.copies)
        if block.state == "coming":   # (shown only now: _fetch)
            block.show(block.device_tensors)
        block.state = "here"
        for index, _ in ahead:
            self._fetch(self.blocks[index], ahead=True)
        if self.files is not None and self._order is not None and self._cursor is not None:
            # the param files read further ahead than the copies, as far as the cache
            # has slots it would give away before they are used (_floors)
            first = self._cursor + self.prefetch
            uses = self._order[first:first + len(self.files.slots)]
            floors = self._floors(first, len(uses))
            floor_of: Dict[int, float] = {}   # (each block's first use in the window)
            for (i, use), floor in zip(uses, floors):
                if not forward_only or use == "f":
                    floor_of.setdefault(i, floor)
            self.files.read_ahead(list(floor_of), list(floor_of.values()))

    def _fetch(self, block: _Block, ahead: bool = False) -> None:
        """Starts the copies of the block's params to the device (`ahead` of its use: not
        a block the CPU step left half written, whose use, if it comes, refuses it)."""
        self._end_abandoned_load(block)
        if block.stale:   # the step wrote its host copies while it was on the device
            block.stale = False
            self._release(block)
        if block.state != "away":
            return
        # (a step deferred past step() still writing its host copies: waited for)
        if not block.wait_steps(ahead):
            return
        try:
            block.check_unwritten()
        except RuntimeError as e:
            others = [name for name, _ in self._unwritten(besides=block)]
            if others:
                e.add_note(f"offload_adam.stream_params: the params of blocks {others} were "
                           "written so too, and their writes dropped alike")
            raise
        block.settle()   # (its last copies read the same host memory: done long ago)
        for t in block.device_tensors:
            self.device.materialize(t)
        fence = self.device.fence()   # after the last compute that used this memory
        # (with param files: from its cache slot, not reused before the copy ran: settle)
        block.hold()
        try:
            with block.written:   # no write in progress, none starting before the copies
                block.writing_done()   # are set (it then waits for them: before_write)
                block.stale = False   # (these copies take every write done)
                block.set_copies([self.device.h2d(list(block.device_tensors),
                                                  block.host_views(), fence)])
        finally:
            block.unhold(dirty=False)
        # (the params show their placeholders until _use publishes the copies: a read
        # of a block fetched ahead, from another block's hook, read the copy in flight:
        # found from outside)
        block.state = "coming"
        self.fetched_bytes += block.nbytes

    def _unwritten(self, values: bool = False, besides: Optional[_Block] = None
                   ) -> List[Tuple[str, RuntimeError]]:
        """check_unwritten of every block not given back (but `besides`): (name, error) of
        each whose params were written between uses, their writes dropped. A write
        refused in one block was often one across the model (model.apply(init),
        vector_to_parameters): one error names them all (it took a forward a block, and
        close() gave the other blocks back: found from outside)."""
        refused = []
        for b in self.blocks:
            if b is besides or getattr(b, "given_back", False):
                continue
            try:
                b.check_unwritten(values)
            except RuntimeError as e:
                refused.append((b.name, e))
        return refused

    @_outside_transforms
    def _release(self, block: _Block) -> None:
        if block.state == "away":
            return
        if block.state == "coming":   # fetched ahead, never used: free after its copy
            self.device.publish(block.copies)   # (its placeholders still shown)
        else:
            block.show(block.placeholders)
        for t in block.device_tensors:
            self.device.release(t)
        block.state = "away"

    # ---- state dicts ------------------------------------------------------------------

    def _state_dict(self, block: _Block, sd: dict, prefix: str,
                    entries: List[Tuple[str, int]]) -> None:
        """The host copies stand for the params (keep_vars=True: as Parameters around
        them, not the model's own, whose data is the placeholder between uses).
        `entries`: (attribute, index in the block) of the params the module holds."""
        block.check_held()
        block.wait_steps()
        block.writing_done()   # (views of the host copies: see the README on step_in_backward)
        block.check_unwritten(values=True)
        if self.files is None:
            homes = block.homes
        elif block.loading:   # (a load's writes are in the cache slot until it ends: a
            # state_dict() from a hook inside it, or after one abandoned; the slot is
            # given to other blocks later, the files' mapping is not, so: copies)
            homes = [t.clone() for t in block.host_views()]
        else:
            homes = block.views(self.files.mapped(block.index))
        for attr, k in entries:
            key, home = prefix + attr, _own_storage(homes[k])
            if self.files is None and home is not homes[k]:   # (Home.mark)
                block.shown[k].add(home)
                block.times_shown[k] += 1
            if key in sd:
                was = sd[key]
                sd[key] = (torch.nn.Parameter(home, requires_grad=was.requires_grad)
                           if isinstance(was, torch.nn.Parameter) else home)
                if self.files is not None:
                    block.mapped_out.add(sd[key])

    def _before_load(self, block: _Block, meta: Optional[dict] = None,
                     loaded: Sequence[str] = (), module: Optional[torch.nn.Module] = None
                     ) -> None:
        """load_state_dict copies into the host copies (the params show them meanwhile;
        with param files the block stays in its cache slot until loaded). The hooks of
        the block's submodules nest inside the block's: the outermost one acts. A load
        with assign=True of streamed params (`loaded`: their keys in the dict) is refused
        here, before anything changes (this hook may run before the module's own refusal,
        _refuse_assign)."""
        if meta and meta.get("assign_to_params_buffers") and loaded:
            self._refuse_assign(block.name, loaded)(block.module, set(loaded), "", meta)
        # (the blocks a backward that raised fetched showed as computing, so a checkpoint's
        # load, the way back, was refused until a forward ran: found from outside)
        self._end_raised_backward()
        root = block.loading_root
        if block.loading and (module is root or not any(m is module for m in root.modules())):
            # (a load nests only inside its outermost module's: this one is a new load,
            # the last one raised between its hooks)
            self._end_abandoned_load(block)
        if block.state == "here" and not block.loading:
            # (its params were released under its own computation, which then read the
            # placeholders: NaN, stepped into every param; found from outside)
            raise RuntimeError(
                f"offload_adam.stream_params: load_state_dict into block {block.name} "
                f"({type(block.module).__name__}) while it computes (from a hook of its own "
                "forward or backward): its params are on the device for this use, which "
                "the load would not reach. Load it before its forward or after its "
                "backward; nothing was loaded")
        block.loading += 1
        if block.loading > 1:
            return
        block.loading_root = module
        try:
            block.check_held()
            block.wait_steps()
            block.writing_done()
            block.check_unwritten(values=True)
            self._release(block)
            block.settle()
            block.hold()
        except BaseException:
            block.loading = 0
            raise
        block.show(block.host_views())

    def _after_load(self, block: _Block) -> None:
        block.loading -= 1
        if block.loading > 0:
            return
        block.show(block.placeholders)
        block.unhold(dirty=True)

    def _end_abandoned_load(self, block: _Block) -> None:
        """A load_state_dict that raised between the block's load hooks (a hook of the
        user's refusing a checkpoint) left it loading: its params showing the host copies,
        held in the param files' cache, and the next load, taken for one nested in it,
        wrote into the placeholders (torch's overlap error, at every load after the next
        forward: found from outside). Ended at the block's next fetch, the next load that
        is not inside the first one's module, or close() (a load of a submodule of that
        module in between goes into the host copies with the rest); what the load wrote
        before it raised stays written, as torch's load leaves it."""
        if block.loading:
            block.loading = 1
            self._after_load(block)

    # ---- the rest -----------------------------------------------------------------------

    @property
    def streamed_bytes(self) -> int:
        """The bytes of all streamed params (one copy of each)."""
        return sum(b.nbytes for b in self.blocks)

    @property
    def largest_block_bytes(self) -> int:
        return max(b.nbytes for b in self.blocks)

    def host_bytes(self) -> int:
        """Host memory the streamer holds for the host copies: every block's (in RAM), or
        the param files' cache."""
        if self.files is not None:
            return self.files.cache_bytes
        return sum(b.size for b in self.blocks)

    def _floors(self, first: int, count: int) -> List[float]:
        """For the uses at positions first, first + 1, ... of the recorded order: how
        late a cached block's next use must be for reading that use's block ahead to
        take its slot (param_files.read_ahead). Later than that use itself, and later
        than the next use of every block used from the current one until then: the cache
        gives those away before the cached block when the read comes due (the block used
        farthest leaves first), so a block used sooner stays and is not read twice. Read
        ahead freely instead, the reads would take the slots of the blocks forward reads
        after a step at step() (which wrote the last blocks last) before forward gets to
        them: every block read in that forward, the cache's worth more than needed. A
        block used in backward that step() writes next counts as next used then, at the
        end of the order (_rank: the two agree, or the read-ahead is refused the slots
        _rank gives away), ahead of _step_key's order among them: for the step, a block
        given away costs a slot whichever it is, and a read only where the step does not
        write it whole (which one block read ahead saves). The first use past the
        prefetch window (`first`) is the exception: its floor is its own next use, so that
        one block is always read ahead of the copies. With only the rule above, once the
        cache kept the blocks backward uses first, forward read through one slot, each
        block's read started as the block before it was copied, the disk idle meanwhile;
        the price is at most a block read again a pass (a kept block given away for it,
        where the cache would have given away one the window used)."""
        cursor, order, gap = self._cursor, self._order, self._gap
        n = len(order)
        floors: List[float] = []
        seen = -math.inf
        for q in range(max(cursor - 1, 0), min(first + count, n)):
            if q == first:
                floors.append(float(q - cursor))
            elif q > first:
                floors.append(max(seen, float(q - cursor)))
            i, phase = order[q]
            nxt = float(q - cursor + gap[q])
            if phase == "b" and q + gap[q] >= n and self._stepped_at_step(self.blocks[i]):
                # the step's start: whichever of them a read takes, the step writes it
                # (the latest in _step_key's order is the current block's, whose slot
                # its copies to the device keep busy: a floor at its rank refused all)
                nxt = float(n - cursor - 1)
            seen = max(seen, nxt)
        return floors

    def _stepped_at_step(self, block: _Block) -> bool:
        """The block trains and no optimizer steps it in backward: once backward used it,
        step() writes it next. (An optimizer that watched it once, whose steps now run at
        step(), a compact state's grads logged in backward after its first pass stepped in
        place, does not count: ranked as stepped in backward, each block backward used
        stayed in the cache until step(), which left backward one slot to read through,
        its reads never ahead: found in bench/param_files_big_run.py.)"""
        return block.trained and not any(
            early.steps_in_backward for early in list(block.step_checks.keys()))

    def _at_step(self, block: _Block, cursor: int) -> float:
        """The rank of a block step() writes next, from `cursor` in backward: after every
        use left in the recorded order, before the next forward's first (step() writes the
        blocks in _step_key's order: the ones it writes first sooner)."""
        return len(self._order) - cursor - 1 + min(_step_key(block), 2**20) / 2**21

    def _rank(self, index: int) -> Optional[float]:
        """How soon block `index` is used next (param files' cache): the uses until its
        next one in the recorded order. A block the CPU step is still to write (used in
        backward) comes before its next forward: in backward, one step() writes is next
        needed at the order's end, after the uses left in it (_at_step); outside backward
        (step() is next, or another micro-batch's forward, whose blocks backward uses
        again before step()), and when an optimizer steps it in backward, it is needed
        before any use (_step_key says when; one the step started writing before those it
        did not). None before the order is recorded. (A block the step writes whole is
        not read for it, but it needs a slot then all the same: it keeps its own
        meanwhile.)"""
        block = self.blocks[index]
        order, cursor = self._order, self._cursor
        if block.awaiting:
            if order is not None and cursor is not None and self._graph_task is not None \
                    and not block.step_started and self._stepped_at_step(block):
                return min([float(q - cursor) for q in self._uses.get(index, ())
                            if q >= cursor] + [self._at_step(block, cursor)])
            # a block the step started writing nearest of all: given away half written,
            # its file's bytes would be read to complete it, written, and its slot taken
            # again for the rest (a block spans buckets)
            return float(_step_key(block) - (2**41 if block.step_started else 2**40))
        if order is None:
            return None
        cursor = cursor or 0
        n = len(order)
        return float(min(((q - cursor) % n for q in self._uses.get(index, ())), default=n))

    def close(self) -> None:
        """Stops streaming: every param goes back to the device for good (the optimizer
        must be built again: it stepped the host copies). Once: closing again does
        nothing (the host copies are gone by then: the params have their values)."""
        if self._closed:
            return
        # An optimizer that stepped some params in backward steps the rest at step(),
        # which needs the streaming: closed now, the model would stay half stepped.
        for block in self.blocks:
            if any(early.pending() for early in list(block.step_checks.keys())):
                raise RuntimeError(
                    f"offload_adam.stream_params: close() between backward and step(): "
                    f"an optimizer stepping in backward (step_in_backward=True) has "
                    f"stepped block {block.name} and steps the other params at step(). "
                    "Call step() first; nothing was closed")
        # A param written in place between uses (its write dropped) is refused before
        # any block goes back: given back block by block, the others' hooks stayed on
        # blocks without host copies (forward failing inside, state_dict() blaming an
        # assignment the user never made: found from outside). Every block is checked,
        # so that one close() again gives them all back.
        refused = self._unwritten(values=True)
        if refused:
            e = refused[0][1]
            others = f" (and in blocks {[n for n, _ in refused[1:]]})" if len(refused) > 1 else ""
            e.add_note(f"offload_adam.stream_params: close() found this{others}; nothing was "
                       "closed, the writes are dropped, and close() again gives the params "
                       "back with their host copies' values")
            raise e
        # Every block that can be is given back, then the first error raised: a block
        # whose host copy cannot be read (a damaged param file) leaves the others' params
        # on the device and the streaming (hooks, files) as it was for that one, and a
        # close() again tries the blocks left.
        errors = []
        with torch.no_grad():
            for block in self.blocks:
                if getattr(block, "given_back", False):
                    continue
                try:   # (its writes checked above, with every block's)
                    self._end_abandoned_load(block)
                    self._release(block)
                    block.wait_steps()
                    block.writing_done()
                    block.settle()
                    block.hold()
                    try:
                        for p, home, real in zip(block.params, block.host_views(),
                                                 block.device_tensors):
                            p.data = _empty_as(real, self.torch_device).copy_(home)
                            set_home(p, None)
                    finally:
                        block.unhold(dirty=False)
                except Exception as e:
                    errors.append(e)
                    continue
                block.homes = []   # (their host memory goes with them)
                block.given_back = True
        if errors:
            raise errors[0]
        self._closed = True
        self._unhook()
        if self.files is not None:
            self.files.close()
            self.files = None


def stream_params(model: torch.nn.Module, blocks: BlockSpec, prefetch: int = 2,
                  device=None, *, param_dirs=None, param_cache_mb=None) -> ParamStreamer:
    """Streams the params of `model`'s blocks from host memory: between uses they hold
    no device memory (see offload_adam/param_stream.py). Build the optimizer after.

    Args:
        model: the model, on the CPU, already on the device, or on the meta device
            (then NaN until a state dict is loaded); streamed params move to host
            memory, the rest to the device. Converting it afterwards (model.to(dtype),
            .half(), .cpu()) is refused.
        blocks: which modules stream: a module class or tuple of classes (e.g. the
            decoder layer), an iterable of module names, the modules themselves (a
            list of them, or a ModuleList or Sequential such as model.layers: each
            child a block), or a predicate f(name, module) -> bool. A matching module
            inside another streams with it.
        prefetch: how many uses ahead to fetch (k).
        device: where the blocks compute (default: the current CUDA device).
        param_dirs: a directory or a list of them (one per drive) for the host copies:
            each block in a file there (striped: block i in directory i % n), read
            ahead through a cache of host buffers (offload_adam/param_files.py). The
            files are scratch, made anew here and removed by close(): a state to resume
            is the optimizer's (state_dirs=, state_resume=True writes the params from it).
        param_cache_mb: host memory for the param files' cache (MiB): at least
            prefetch + 3 of the largest block; default prefetch + 5 of them.
    """
    return ParamStreamer(model, blocks, prefetch, device, param_dirs, param_cache_mb)


# ---- helpers -------------------------------------------------------------------------

def _step_key(block: _Block) -> int:
    """When the step writes a block (smaller: sooner): the order the last step wrote it in,
    the order of its grads before any step did."""
    return block.step_order or block.backward_use


def _empty_as(p: torch.Tensor, device) -> torch.Tensor:
    """An empty tensor on `device` of p's shape, dtype and, where p is dense, strides (a
    transposed or channels_last weight computes on the device as it did resident, on the
    same kernels: bit for bit; a contiguous copy of it took another matmul path, 1 ulp
    off in fp32, found from outside). The host copy stays contiguous: the copies between
    them go element by element."""
    dims = sorted((stride, size) for size, stride in zip(p.shape, p.stride()) if size != 1)
    dense, span = p.numel() > 0, 1   # (the strides of a permutation of a contiguous one)
    for stride, size in dims:
        dense, span = dense and stride == span, span * size
    if dense:
        return torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
    return torch.empty(p.shape, dtype=p.dtype, device=device)


def _offsets(params) -> Tuple[List[int], int]:
    """Each param's offset in its block's host copy (a cache line each), and its size."""
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    return offsets, size


def _check_files(param_dirs, param_cache_mb):
    """param_dirs as a list of paths (None: no files); a ValueError naming a bad one."""
    if param_dirs is None:
        if param_cache_mb is not None:
            raise ValueError("offload_adam.stream_params: param_cache_mb is the param "
                             "files' cache: give param_dirs too")
        return None
    if isinstance(param_dirs, (str, bytes)) or hasattr(param_dirs, "__fspath__"):
        param_dirs = [param_dirs]
    if isinstance(param_dirs, (set, frozenset)):   # block i in directory i % n
        raise TypeError(f"offload_adam.stream_params: param_dirs must be ordered (a list or "
                        f"tuple), got a {type(param_dirs).__name__}: {param_dirs!r}")
    param_dirs = list(param_dirs)
    if not param_dirs:
        raise ValueError("offload_adam.stream_params: param_dirs is empty")
    for d in param_dirs:
        if not isinstance(d, (str, bytes)) and not hasattr(d, "__fspath__"):
            raise TypeError(f"offload_adam.stream_params: param_dirs holds {d!r}, not a path")
    if len({os.path.realpath(os.fsdecode(d)) for d in param_dirs}) != len(param_dirs):
        raise ValueError(f"offload_adam.stream_params: param_dirs names a directory twice: "
                         f"{param_dirs}")
    if param_cache_mb is not None and not positive_number(param_cache_mb):
        raise ValueError(f"offload_adam.stream_params: param_cache_mb must be a finite "
                         f"number > 0, got {param_cache_mb!r}")
    # absolute: close() removes these files, also after the process changed directory
    out = [os.path.abspath(os.fsdecode(d)) for d in param_dirs]
    for d in out:   # (a missing one is made, with its parents: the files are scratch)
        if os.path.exists(d) and not os.path.isdir(d):
            raise ValueError(f"offload_adam.stream_params: param_dirs: {d!r} is not a directory")
    return out


def _nan(t: torch.Tensor, device: torch.device, full: bool = True) -> torch.Tensor:
    """A tensor of t's shape and dtype on `device` that holds no value yet: NaN (zeros for
    an integer dtype); `full=False`: one element expanded (no memory)."""
    fill = math.nan if t.is_floating_point() else 0
    one = torch.full((), fill, dtype=t.dtype, device=device)
    return one.expand(t.shape) if not full else torch.full(t.shape, fill, dtype=t.dtype,
                                                            device=device)


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`; a meta tensor (a model built without memory) becomes NaNs there."""
    return _nan(t, device) if t.is_meta else t.to(device)


# Global module hooks (torch.nn.modules.module.register_module_forward_pre_hook and
# register_module_full_backward_pre_hook) run before every module's own, so before a
# streamed block's fetch: one reading a weight read the placeholder's NaN (on a GPU, raced
# the copy). While the user has such a hook, one of ours is registered and kept first of
# them: for a streamed block it fetches, for its forward (or recompute) or its backward.
# Only then: a global backward pre-hook alone makes every module of the process run under
# torch's BackwardHook (autograd nodes around each call, in-place edits of outputs refused),
# and a global forward pre-hook takes every module off torch's call without hooks.
_BLOCK_OF: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_global_handles: dict = {}


def _find_counter_peers(blocks: List[_Block]) -> None:
    """Fills each block's `counter_peers`. Params made as views of one tensor (a
    Megatron-style flat buffer) share its version counter, so the optimizer's bump of
    one moves the others' too (Home.bumped counts it for all of them), where each
    counted its own, and the next use said the others were written in place (found from
    outside). Only params on one storage can share a counter, and not all do (a tensor
    set_() on another's storage has its own): each one's peers are the ones whose
    counters move when it is bumped (at set-up, before any graph holds them)."""
    on: Dict[Tuple[str, int], List[Tuple[_Block, int]]] = {}
    for b in blocks:
        for k, p in enumerate(b.params):
            if not p.is_meta and p.numel():
                on.setdefault((str(p.device), p.untyped_storage().data_ptr()), []).append((b, k))
    for group in on.values():
        for b, k in group if len(group) > 1 else ():
            if k in b.counter_peers:
                continue
            before = [c.params[j]._version for c, j in group]
            torch.autograd.graph.increment_version(b.params[k])
            peers = [(c, j) for (c, j), v in zip(group, before) if c.params[j]._version != v]
            if len(peers) > 1:
                for c, j in peers:
                    c.counter_peers[j] = peers


def _global_entry(module):
    entry = _BLOCK_OF.get(module)
    if entry is None:
        return None, None
    streamer = entry[0]()
    return ((None, None) if streamer is None or streamer._closed
            else (streamer, streamer.blocks[entry[1]]))


def _global_pre_forward(module, args):
    streamer, block = _global_entry(module)
    if streamer is not None:
        streamer._global_fetch(block)


def _global_pre_backward(module, grad_output):
    streamer, block = _global_entry(module)
    if streamer is not None:
        streamer._hook_fetch(block)


def _sync_global_hooks() -> None:
    """Ours registered and first while the user has a global pre-hook of that kind and a
    streamer is open; removed otherwise (at each model forward, and at close())."""
    from torch.nn.modules import module as nn_module
    for kind, hook, register in (
            ("forward", _global_pre_forward, nn_module.register_module_forward_pre_hook),
            ("backward", _global_pre_backward,
             nn_module.register_module_full_backward_pre_hook)):
        hooks = getattr(nn_module, f"_global_{kind}_pre_hooks", None)
        if hooks is None:   # (a torch without them: nothing to order)
            continue
        handle = _global_handles.get(kind)
        ours = handle is not None and handle.id in hooks
        if len(hooks) > ours and len(_BLOCK_OF):
            if not ours:
                handle = _global_handles[kind] = register(hook)
            if next(iter(hooks)) != handle.id:
                hooks.move_to_end(handle.id, last=False)
        elif ours:
            handle.remove()
            del _global_handles[kind]


# The streamers not closed: while there is one, every torch optimizer's step() is checked
# first (a global step pre-hook, registered once) for streamed params it would step.
_LIVE: "weakref.WeakSet[ParamStreamer]" = weakref.WeakSet()
_other_step_hook = None


def _watch_other_optimizers(streamer: ParamStreamer) -> None:
    global _other_step_hook
    _LIVE.add(streamer)
    if _other_step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _other_step_hook = register_optimizer_step_pre_hook(_refuse_other_step)


def _refuse_other_step(optimizer, args, kwargs) -> None:
    """Another optimizer (torch's AdamW, the one transformers' Trainer builds by default)
    would step a streamed param's placeholder, one element expanded to the param's shape:
    torch's fused kernels write it whole, past its one element (a crash, or memory
    overwritten), the others raise torch's internal-overlap error that does not say why.
    Refused before anything is written. offload_adam's optimizers step the host copies."""
    if not _LIVE or getattr(optimizer, "steps_streamed_params", False):
        return
    for gi, g in enumerate(optimizer.param_groups):
        for i, p in enumerate(g["params"]):
            if home_of(p) is not None:
                raise RuntimeError(
                    f"offload_adam.stream_params: {type(optimizer).__name__} cannot step "
                    f"param {i} of param group {gi} (shape {tuple(p.shape)}): it streams "
                    "(stream_params), its values are in host memory and the param holds "
                    "a placeholder between uses. Step it with offload_adam.AdamW (with "
                    "transformers' Trainer: optimizers=(offload_adam.AdamW(model."
                    "parameters(), ...), None)), or streamer.close() first; nothing was "
                    "stepped")


class _AllGrads:
    """Calls `fn()` in a backward once the grads of all of `tensors` are computed (a
    hook on each), holding no autograd node: torch's "all" multi-grad hook keeps the
    nodes it sits on (to ask which will run), a cycle through C++ that the garbage
    collector does not see, so a forward never backpropagated kept its whole graph, its
    activations on the device with it. An input whose grad a backward does not compute
    (backward(inputs=...) leaving it out) holds it until the end of that backward, which
    releases every block."""

    def __init__(self, tensors: List[torch.Tensor], fn: Callable[[], None]):
        seen: Dict[int, set] = {}   # graph task -> the tensors whose grads came
        unique = list({id(t): t for t in tensors}.values())
        count = len(unique)   # (the hooks hold no tensor: a tensor holds its node)

        lock = threading.Lock()   # (autograd runs a device's hooks on its own thread)

        def one(k: int):
            @torch.utils.hooks.unserializable_hook   # (a saved activation: no warning of it)
            def hook(grad):
                task = torch._C._current_graph_task_id()
                with lock:
                    got = seen.setdefault(task, set())
                    got.add(k)
                    if len(got) < count:
                        return
                    del seen[task]
                fn()
            return hook
        self.handles = [t.register_hook(one(k)) for k, t in enumerate(unique)]

    def alive(self) -> bool:
        """Whether a hook is still on a tensor of a graph alive."""
        return any(h.hooks_dict_ref() is not None for h in self.handles)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


_LEAF_NODE = 2 ** 64 - 1   # the sequence number of a leaf's AccumulateGrad node


def _next_node_number() -> int:
    """The sequence number the next autograd node made on this thread gets (each
    thread numbers its nodes in the order they are made)."""
    with torch.enable_grad(), outside_transforms():   # (inside torch.func.grad: no node)
        return _PROBE.view(()).grad_fn._sequence_nr() + 1


_PROBE = torch.zeros((), requires_grad=True)


def _weakly(streamer: "ParamStreamer", method: str, block: _Block, ticket: list,
            entry: Optional[list] = None):
    """A grad hook calling streamer.`method`(block, ticket), holding neither weakly (a
    hook holding the streamer would keep a model dropped without close() alive, and its
    pinned host copies, its files' lock, while autograd holds the hook).
    `entry`: the streamer's [handle, fired, ...] of the hook, marked fired."""
    me, index = weakref.ref(streamer), block.index

    @torch.utils.hooks.unserializable_hook   # (on a block's outputs: torch.save of one
    def hook(*grads):                         # kept, a hidden state, warned of it)
        if entry is not None:
            entry[1] = True
        s = me()
        if s is not None:
            getattr(s, method)(s.blocks[index], ticket)
    return hook


def _refuse_written(block: _Block, written: List[str], when: str) -> None:
    """A RuntimeError naming the first param of `written` (block.written_in_use: the
    block is given back already, with the write lost)."""
    if not written:
        return
    more = f" (and {len(written) - 1} more)" if len(written) > 1 else ""
    raise RuntimeError(
        f"offload_adam.stream_params: param {block.name}.{written[0]}{more} of a streamed "
        f"block was written in place or given new memory during the block's {when} (an "
        "nn.Embedding with max_norm renormalises its rows so; a write under torch.no_grad() "
        "in forward; weight.data = ... in forward, a max-norm constraint's way): a "
        "streamed param is on the device only while its block runs, as a copy of its host "
        "copy that goes back after, so the write was lost. Keep that module out of the "
        "streamed blocks (it stays resident), or write params between steps with "
        "model.load_state_dict(...)")


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """`view` (a param's host copy: a contiguous run of its block's buffer) as a tensor
    over a storage of its own, the same memory (no copy): the block's params, views of one
    storage, were taken for tied weights by savers that keep one tensor per storage
    (safetensors, accelerate's save_state: all but one param of each block were left
    out). The new storage holds the buffer alive, through the memoryview it reads."""
    nbytes = view.numel() * view.element_size()
    if nbytes == 0:
        return view
    whole = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
    start = view.storage_offset() * view.element_size()
    run = byte_view(whole)[start:start + nbytes]
    return torch.frombuffer(run, dtype=torch.uint8).view(view.dtype).view(view.shape)


def _check_meta_buffers(model: torch.nn.Module) -> None:
    """A ValueError naming the meta buffers no state dict can fill (non-persistent: a
    rotary embedding's inv_freq): the NaN they would become would compute silently wrong
    results (a meta model's persistent buffers are loaded with its params)."""
    lost = [f"{name}.{key}" if name else key for name, m in model.named_modules()
            for key, b in m._buffers.items()
            if b is not None and b.is_meta and key in m._non_persistent_buffers_set]
    if lost:
        raise ValueError(
            f"offload_adam.stream_params: the model's buffers {', '.join(lost)} are on the "
            "meta device and not in its state_dict (non-persistent): no load can give them "
            "values, and they would compute with NaN. Build the model with "
            "accelerate.init_empty_weights() (params on meta, buffers real), or give them "
            "values before stream_params; nothing was streamed")


def _model_as_it_is(model: torch.nn.Module):
    """What a set-up changes, to put back (ParamStreamer._undo): each module's params and
    buffers (the objects), and each param's data and grad."""
    params = [(m, key, p) for m in model.modules() for key, p in m._parameters.items()]
    buffers = [(m, key, b) for m in model.modules() for key, b in m._buffers.items()]
    data = [(p, p.data, p.grad) for p in {id(p): p for _, _, p in params
                                          if p is not None}.values()]
    return params, data, buffers


def _replace_meta(model: torch.nn.Module, streamed: set, device: torch.device) -> set:
    """A model built on the meta device gets real params, NaN until a state dict is
    loaded: the resident ones on `device`, the streamed ones as one NaN element expanded
    (their host copies take those NaNs, and nothing of their size is allocated on the
    device). A meta tensor cannot take other data (`p.data = ...` refuses), so each is a
    new Parameter, set wherever the old one was (tied params stay tied). Returns the ids of
    the streamed ones made."""
    new: dict = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = torch.nn.Parameter(_nan(p, device, full=id(p) not in streamed),
                                                requires_grad=p.requires_grad)
            module._parameters[key] = new[id(p)]
    return {id(q) for old, q in new.items() if old in streamed}


def _fill_nan(views: Sequence[torch.Tensor]) -> None:
    """A blank block's params as a meta model's are streamed: NaN (ParamFiles.blank)."""
    for v in views:
        v.fill_(math.nan)


def _device_of(model, device):
    stand_in = current_host_stand_in()
    if stand_in is not None:   # offload_adam.testing.simulated(): the GPU's path on CPU
        return stand_in, torch.device("cpu")
    if device is None:
        if not torch.cuda.is_available():
            raise ValueError("offload_adam.stream_params: no CUDA device to stream the "
                             "params to (device=None and torch.cuda.is_available() is "
                             "False)")
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"offload_adam.stream_params: params stream to a CUDA device, "
                         f"not {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return make_device(device), device


def _find_blocks(model: torch.nn.Module, spec: BlockSpec):
    """[(name, module, [(param name in the module, param)])] of the outermost matching
    modules, their params that stream; a ValueError for a param shared by two blocks or
    with the rest."""
    match = _matcher(spec)
    # every name each module is registered under (one module in a ModuleList several
    # times: ALBERT's shared layer): it is one block, named by any of them
    aliases: Dict[int, List[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(m), []).append(name)
    found: List[Tuple[str, torch.nn.Module]] = []
    for name, m in model.named_modules():
        if m is model or any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if any(match(a, m) for a in aliases[id(m)]):
            found.append((name, m))
    names = _names_of(spec)
    if names is not None:
        unknown = sorted(names - {n for a in aliases.values() for n in a}, key=str)
        if unknown:
            raise ValueError(f"offload_adam.stream_params: blocks names modules the model "
                             f"does not have: {unknown}")
    for name, m in found:
        if type(m).forward is torch.nn.Module.forward:
            raise ValueError(
                f"offload_adam.stream_params: block {name} ({type(m).__name__}) is never called "
                "itself (it has no forward: a container), so its params would never be "
                "fetched: name the modules that compute, e.g. its children")
    owner: Dict[int, str] = {}
    module_of = dict(found)
    out = []
    for name, m in found:
        # A param that can take no grad (an integer or bool dtype: an index table) has no
        # state to step, and its placeholder would read as zeros, not NaN (a read between
        # uses wrong without a word): it stays resident. So does a one-element one (a
        # learned scale, a gate): a write through p.data that leaves NaN NaN
        # (`logit_scale.data.clamp_(0, 4.6)`) would be lost unseen in its placeholder,
        # where a larger param's fails at the call (the placeholder is one element
        # expanded), and it costs the device nothing.
        params = [(n, p) for n, p in m.named_parameters(remove_duplicate=True)
                  if (p.is_floating_point() or p.is_complex()) and p.numel() > 1]
        for pname, p in params:
            if id(p) in owner and owner[id(p)] != name:
                raise ValueError(f"offload_adam.stream_params: param {name}.{pname} is "
                                 f"shared with block {owner[id(p)]}: a streamed param "
                                 "belongs to one block")
            owner[id(p)] = name
            if is_dtensor(p):
                raise ValueError(
                    f"offload_adam.stream_params: param {name}.{pname} is a DTensor (FSDP2's "
                    "fully_shard, or tensor parallelism): a streamed block's params are whole "
                    "on the host and fetched whole, which a shard is not; stream_params and "
                    "FSDP2 do not combine. Stream the unsharded model on one GPU, or shard it "
                    "without streaming (offload_adam.AdamW keeps the state off the GPU "
                    "either way)")
            if home_of(p) is not None:
                raise ValueError(f"offload_adam.stream_params: param {name}.{pname} "
                                 "streams already (stream_params called twice?)")
        out.append((name, m, params))
    for full, p in model.named_parameters(remove_duplicate=False):
        block = owner.get(id(p))
        if block is not None and not any(full == a or full.startswith(a + ".")
                                         for a in aliases[id(module_of[block])]):
            raise ValueError(f"offload_adam.stream_params: param {full} is block "
                             f"{block}'s too (tied weights): keep it out of the streamed "
                             "blocks")
    return out


def _parametrized_error(which: str) -> RuntimeError:
    return RuntimeError(
        f"offload_adam.stream_params: {which} was parametrized after stream_params "
        "(register_parametrization, weight_norm, spectral_norm): its original moved under "
        "parametrizations, out of the streamer's reach, and what the parametrization made "
        "of it was computed from the placeholder. Parametrize before stream_params (the "
        "parametrization's params then stream), or close() the streamer first")


def _parametrized(module: torch.nn.Module, attr: str) -> bool:
    """Whether `attr` of `module` is parametrized now (torch.nn.utils.parametrize, as
    parametrizations.weight_norm does) or by the older hooks (nn.utils.weight_norm,
    spectral_norm: `attr`_orig / `attr`_g beside it)."""
    from torch.nn.utils import parametrize
    return (parametrize.is_parametrized(module, attr)
            or any(n in module._parameters for n in (attr + "_orig", attr + "_g")))


def _module_names(model: torch.nn.Module, spec):
    """blocks= given as the modules themselves (a list of them, or a ModuleList or
    Sequential of the model such as its decoder layers, each child a block; names may
    be mixed in): the list of their names in the model. Another spec as it is."""
    if not (isinstance(spec, (torch.nn.ModuleList, torch.nn.Sequential))
            or (isinstance(spec, (list, tuple))
                and any(isinstance(m, torch.nn.Module) for m in spec))):
        return spec
    names = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), name)
    out = []
    for m in spec:
        if isinstance(m, str):
            out.append(m)
        elif not isinstance(m, torch.nn.Module):
            raise TypeError(f"offload_adam.stream_params: blocks= lists {m!r}, neither a "
                            "module nor a module name")
        elif id(m) not in names or m is model:
            raise ValueError(
                f"offload_adam.stream_params: blocks= lists a module ({type(m).__name__}) "
                f"that is {'the model itself' if m is model else 'not in the model'}: "
                "give modules of the model (or their names, named_modules())")
        else:
            out.append(names[id(m)])
    return out


def _names_of(spec: BlockSpec) -> Optional[frozenset]:
    """The module names a block spec lists; None for a class, classes or a predicate."""
    if isinstance(spec, torch.nn.Module):   # (callable: it would be taken for a predicate)
        raise TypeError(f"offload_adam.stream_params: blocks= got a module "
                        f"({type(spec).__name__}), not a spec: give its class, its name in "
                        "the model (named_modules()), a list of modules or a predicate "
                        "(name, module) -> bool")
    if isinstance(spec, type) or (isinstance(spec, tuple) and spec
                                  and all(isinstance(c, type) for c in spec)):
        return None
    if callable(spec):
        return None
    if isinstance(spec, str):
        return frozenset([spec])
    try:
        names = list(spec)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError("offload_adam.stream_params: blocks= must be a module class, a "
                        "tuple of classes, a module name or names, modules (a list, a "
                        f"ModuleList), or a predicate (name, module) -> bool; got {spec!r}")
    return frozenset(names)


def _matcher(spec: BlockSpec) -> Callable[[str, torch.nn.Module], bool]:
    names = _names_of(spec)
    if names is not None:
        return lambda name, m: name in names
    if callable(spec) and not isinstance(spec, type):
        return spec
    return lambda name, m: isinstance(m, spec)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype,
          torch.device, torch.Size, torch.layout, torch.memory_format)


def _grad_tensors(tree) -> Tuple[List[torch.Tensor], list]:
    """The tensors that require grad in a block's inputs or output: in what pytree
    flattens (tuples, lists, dicts, registered types) and in the fields of a dataclass it
    leaves whole; and the leaves it cannot look into (other objects, which may hold
    tensors), for an error."""
    found: List[torch.Tensor] = []
    opaque: list = []
    for leaf in _leaves(tree):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                found.append(leaf)
        elif not isinstance(leaf, _PLAIN):
            opaque.append(leaf)
    return found, opaque


def _leaves(tree) -> Iterator:
    """The leaves pytree flattens `tree` to, and those in the fields of the dataclasses
    it leaves whole (each dataclass once), instead of them."""
    seen: set = set()
    todo = [tree]
    while todo:
        for leaf in tree_flatten(todo.pop())[0]:
            if not _is_dataclass(leaf):
                yield leaf
            elif id(leaf) not in seen:
                seen.add(id(leaf))
                todo.append([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])


def _is_dataclass(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _advance(order: List[Tuple[int, str]], cursor: Optional[int], key) -> Optional[int]:
    """The position after `key` in the recorded order: the next one when it matches,
    else the first match from the start (a new micro-batch, or a forward without
    backward); None when the order does not know it (no prefetch until it does)."""
    if cursor is not None and cursor < len(order) and order[cursor] == key:
        return cursor + 1
    try:
        return order.index(key) + 1
    except ValueError:
        return None

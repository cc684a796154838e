"""step_in_backward=True: a bucket's CPU step starts during backward.

By default a bucket is stepped at step(), the first moment its grads are known
to be final. With step_in_backward the worker starts a bucket's kernel as soon
as every piece of it whose param got a grad in the previous backward has its
grad copied in this one (in the first backward: every param with a grad hook, in
the buckets as first laid out, the last params first; step() then lays them out
in the order the grads came, moving what waits for it). Only the engine's own host
buffers are written then (master, moments, step, staging); the params are
written at step(), so a param read later in backward still sees its old value
(a streamed param's staging is its host copy, layout.allocate_transfers: written
then, once its grad is final, its block's backward is done; it is fetched next in
the next forward). The early step uses the group's hyperparameters at that moment and a grad
scale of 1.

It is exact only if nothing changes between backward and step(), so step()
checks (`verify`): every stepped grad is still the tensor, version and values
(fingerprint) that were copied, the hyperparameters are equal, the state was
not replaced; a second grad for a stepped param (accumulation), zero_grad()
before step(), clipping and GradScaler are errors too. There is no undo (a
backup of master and moments would cost 12 B/param of host memory and the
bandwidth to write it): an error leaves the params stepped early stepped
(params written, state consistent per param) and the others not, and says so.

The copies an early step reads are ordered before anything the user does after
backward (the engine publishes a backward's copies at its end), so a change
after backward cannot tear what was stepped: it is seen here and refused. A
change during backward by a post-accumulate-grad hook registered after the
optimizer (it runs after the engine's, on the same param) is no change here:
the engine copies that grad only once autograd is past the hook (core.py,
`_on_grad`), so its bucket starts from the grad as the hook left it, as a plain
step would. Other writes to a grad during backward (another param's hook, a
module's backward hook) are not ordered with its copy: not supported.

The grads land in a bounded ring (grad_ring.py): a bucket's room is free again once its
kernel read it, so the host holds a few buckets of grads, not a buffer per param.

With the state in files (state_dirs=) the unit is the file bucket and the NVMe
tier's pass runs during backward (disk_early.py, `use_files`); nothing is
committed before step(), so there an error leaves nothing stepped.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch

from .. import distributed
from ..freed_grad import is_freed
from ..kernel_step import Hyper
from ..params import check_listed_once, write_values
from ..state_format import MASTER_KEY
from .grads import start_check


class EarlyStart:
    def __init__(self, engine, owner, defer_blocks: int = 0):
        if owner is None:
            raise ValueError("step_in_backward=True needs the owning optimizer "
                             "(owner=weakref.ref(optimizer))")
        self._engine = weakref.ref(engine)
        self._owner = owner                  # weakref to the optimizer: groups, state
        self.error: Optional[str] = None     # found by a hook, raised at step()
        self._hooked: Dict[int, object] = {}     # recs that got a grad this iteration
        self._previous: Optional[set] = None     # ... and in the previous one (None: first)
        self._expected: Optional[set] = None     # still to come (None: not counted yet)
        self._waiting: Dict[int, int] = {}       # bucket index -> expected pieces to come
        self._started: Dict[int, object] = {}    # rec id -> the GradCopy its step read
        self.begun = 0   # begin() calls ever (a state_dict() read across one: check_saving)
        self._stepped: set = set()               # ids of the pieces whose kernel ran
        self._counted: set = set()               # ids of the pieces counted in one by one
        self._refused = False   # step() will refuse the groups: no step starts (refusal)
        self._step_refused: Optional[str] = None   # why step() refused, the steps pending
        self._hyper: Dict[int, Hyper] = {}       # group index -> what its steps used
        self.files = None   # the files' pass (disk_early.py) when the state is in files
        # defer_blocks=: the jobs of the buckets of the first streamed blocks to arrive,
        # held until step() has stepped the rest (see `_hold`)
        self.defer_blocks = defer_blocks
        self._held: list = []                    # BucketJobs held, in arrival order
        self._held_ids: set = set()              # ids of their pieces
        self._held_blocks: set = set()           # ids of the blocks they step
        self._holding = True                     # False once a block beyond them came
        self._replaced = False                   # the state they step was replaced
        self._written: list = []   # streamed recs written since their step began
        self._versions: Dict[int, int] = {}   # rec id -> its param's version at begin()
        # Why the grads held now cannot be stepped: a step() that failed after the
        # steps of some params ran in backward (those are stepped with them: a retry
        # would step them twice). Cleared by zero_grad() and the next backward's grads.
        self.spent: Optional[str] = None
        self._checked_task = None   # the backward whose params' memory was checked

    def use_files(self, files) -> None:
        """The state is in files: `files` (a DiskEarly) steps it in backward."""
        self.files = files

    @property
    def steps_in_backward(self) -> bool:
        """Whether the steps of the blocks it watches run in backward (the streamed
        blocks' cache ranks them by it: param_stream._stepped_at_step): not where the
        files' pass runs at step(), the grads logged in backward (disk_log.py)."""
        return self.files is None or self.files.steps_in_backward

    # ---- during backward ----------------------------------------------------------------

    def before_copy(self, rec) -> bool:
        """Before rec's grad is copied in backward; False: it is not (refused, said at
        step())."""
        self.spent = None   # (a new backward: its grads are new)
        task = torch._C._current_graph_task_id()
        if task != self._checked_task:   # once a backward, before any step starts in it:
            self._checked_task = task     # params tied since (optimizer.step's check)
            check = getattr(self._owner(), "check_addresses", None)
            if check is not None:
                check()
        if id(rec) in self._started:
            if self._engine()._unended:   # (a backward inside the one that started it
                self.backward_raised()    # takes no grad of a param stepped in that one)
            self.error = self.error or (
                "a grad arrived again for a param whose step already started during "
                "backward (gradient accumulation over micro-batches, a param used "
                "again after its grad was final, or no step() after the backward that "
                "started it: an exception between backward and step(), a Ctrl-C, before "
                "a checkpoint's load and this backward; there, opt.step() finishes that "
                "step and opt.zero_grad() drops it, saying what stays stepped)")
            msg = self.error
            if distributed.is_dtensor(rec.param):
                # FSDP2 runs this hook inside its own step of backward (after the
                # reduce-scatter): raised there, it left the modules unsharded, their
                # params plain tensors no optimizer steps, and training on stepped
                # nothing, silently (found from outside). The grad is not taken, and
                # step() (or zero_grad()) refuses, as it does after a raise here.
                return False
            raise RuntimeError(
                f"offload_adam: {msg}; step_in_backward=True forbids this. The "
                "next step() or zero_grad() raises too and says what was stepped; "
                "use step_in_backward=False to accumulate. (If another library's "
                "optimizer steps these params now, close() the offload_adam one: while it "
                "lives its hooks step them in backward)")
        return True

    def piece_sent(self, rec, piece) -> None:
        """One piece of rec's grad was sent before the rest of it (a param cut in pieces,
        each in a bucket of its own): the bucket it completes starts now, not once the
        whole param is sent, so the grad ring drains through the kernels while the later
        pieces of a param larger than the ring wait for room (if nothing ran, they
        would take buffers outside the ring: on CUDA pageable memory, copied
        synchronously)."""
        if self.files is not None:
            self._hooked[id(rec)] = rec
            self.files.arrived(rec, piece)
        elif self._arrived(rec) and id(piece) not in self._counted:
            self._counted.add(id(piece))
            self._piece_in(self._engine(), piece)

    def after_copy(self, rec) -> None:
        """Counts the grad in; starts every bucket it completes."""
        if self.files is not None:
            self._hooked[id(rec)] = rec
            self.files.arrived(rec)
            return
        if not self._arrived(rec):
            return
        self._expected.discard(id(rec))   # counted once per iteration
        engine = self._engine()
        for piece in rec.pieces:
            if id(piece) not in self._counted:   # (piece_sent counted it)
                self._piece_in(engine, piece)

    def _arrived(self, rec) -> bool:
        """rec got its grad: whether its pieces are still to be counted in."""
        self._hooked[id(rec)] = rec
        if self._expected is None:
            self._count(self._engine())
        return id(rec) in self._expected

    def _piece_in(self, engine, piece) -> None:
        b = piece.bucket
        self._waiting[b.index] -= 1
        if self._waiting[b.index] == 0:
            self._start(engine, b)

    def _count(self, engine) -> None:
        """At the iteration's first grad, on the buckets as they are now: the params
        expected to get one (the previous backward's; in the first, every hooked one)."""
        expected = self._previous
        if expected is None or not engine.order_learned:
            expected = {id(r) for r in engine.recs if r.hook is not None}
        self._expected = set(expected)
        self._waiting = {b.index: sum(1 for p in b.pieces if id(p.rec) in expected)
                         for b in engine.buckets}
        self._refused = self.refusal(engine)

    def refusal(self, engine) -> bool:
        """At the iteration's first grad: whether step() will refuse the param groups as
        they are now (a group's state_dtype changed, a group's params split over two
        groups by hand, a param listed twice, a refused hyperparameter). Then no step
        starts in this backward: the refusal leaves every param and its state at the last
        step, and undoing the edit before step() steps them all there (the other groups'
        buckets stepping in backward left the optimizer half a step ahead, which
        state_dict() and zero_grad() refuse)."""
        owner = self._owner()
        if owner is None:
            return False
        try:   # (read again: a swap inside the lists leaves what the cache is keyed by)
            engine._follow_owner(again=True)
            groups = owner.param_groups
        except RuntimeError:
            return True   # a group split
        used = {b.group for b in engine.buckets if b.group < len(groups)
                and groups[b.group] is not None}
        return (any(format_changed(groups, b) is not None for b in engine.buckets
                    if b.group in used) or any(_refused_hyper(groups[g]) for g in used)
                or _listed_twice(groups))

    def begin(self, recs) -> bool:
        """recs' steps start now, from their grad copies and their groups'
        hyperparameters as they are (read once per group per iteration). False
        when the optimizer is gone (no groups to step with)."""
        owner = self._owner()
        if owner is None:
            return False
        self.begun += 1
        for rec in recs:
            if rec.group not in self._hyper:
                self._hyper[rec.group] = Hyper.of(owner.param_groups[rec.group], rec.group)
            self._started[id(rec)] = rec.copy
            self._versions[id(rec)] = rec.param._version
        return True

    def interrupted(self, reason: str) -> None:
        """Something replaced what the steps started in backward use (the state files
        were loaded into): step() raises `reason`, if any step started."""
        if self._started and self.error is None:
            self.error = reason

    def owner(self):
        """The optimizer, None once it is gone."""
        return self._owner()

    def pending(self) -> bool:
        """Whether steps of this iteration started in backward and step() has not
        finished them (it steps the rest)."""
        return bool(self._started)

    def hyper(self, group: int) -> Hyper:
        """The hyperparameters group's early steps use (`begin` read them)."""
        return self._hyper[group]

    def _start(self, engine, bucket) -> None:
        owner = self._owner()
        if owner is None:
            return  # the optimizer is gone: no groups to step with
        if engine.torn is not None:
            return  # a state of no step: step() refuses it (OffloadEngine.step)
        if self._refused:
            return  # step() refuses the groups: nothing steps before it (refusal)
        pieces = [p for p in bucket.pieces if id(p.rec) in self._hooked]
        if format_changed(owner.param_groups, bucket) is not None:
            return  # stepped by nothing: step() refuses the group's state_dtype changed
        engine.flush_pack(bucket)

        def begin(recs):
            self.begin(recs)
            return self._hyper[bucket.group]
        # (the optimizer's raw state: its `state` waits for deferred steps, none by now)
        raw = getattr(owner, "raw_state", None)
        groups, state = owner.param_groups, raw() if raw is not None else owner.state
        if self._hold(pieces):
            job = engine.prepare_early(bucket, pieces, groups, state, begin)
            self._held.append(job)
            self._held_ids.update(map(id, pieces))
            self.watch(p.rec.home.block for p in pieces)   # (a reader before step(): release)
            return
        # step() or commit() writes the params back
        self.watch(p.rec.home.block for p in pieces if p.rec.home is not None)
        engine.start_early(bucket, pieces, groups, state, begin,
                           lambda ran: self._stepped.update(map(id, ran)))

    # ---- a streamed block read between backward and step() ------------------------------

    def watch(self, blocks) -> None:
        """Streamed `blocks` (param_stream._Block) are written by steps of this
        iteration: their readers ask check_block first."""
        for block in blocks:
            if self not in block.step_checks:   # (once: a reader may be iterating them)
                block.step_checks[self] = None

    def check_block(self, block) -> None:
        """Called before `block`'s host copies are read, once the steps queued on it
        ran (param_stream: _Block.wait_steps): raises if this iteration's steps wrote
        some of its params and left others, whose grads came, for step() (a bucket
        waiting for a param's grad that did not come, a step deferred past step(), the
        files' pass stopped at a bucket not complete): what the reader would see would
        be neither the block before the step nor after it."""
        if not self.half_stepped(block):
            return
        if torch._C._current_graph_task_id() != -1:   # fetched in backward
            raise RuntimeError(
                f"offload_adam: the streamed block {block.name!r} is fetched again in this "
                "backward after its CPU step (step_in_backward=True) wrote some of its "
                "params: its grads come in parts (a block run more than once per forward, "
                "or recomputed twice by nested activation checkpointing), and a param used "
                "in one of its runs only (a mixture-of-experts block routed to other experts "
                "in each) had its whole grad, and its step, before the block's other run "
                "was through backward. Use step_in_backward=False for this model")
        raise RuntimeError(
            f"offload_adam: the streamed block {block.name!r} is read between "
            "backward and step() while its CPU step (step_in_backward=True) has "
            "written some of its params and not yet others (they wait for step()): "
            "it would be seen half stepped. Call step() before reading it (an "
            "inference forward, model.state_dict(), load_state_dict).")

    def half_stepped(self, block) -> bool:
        """Whether this iteration's steps wrote some of `block`'s params and left others
        for step() (check_block's refusal)."""
        return bool(self.files.half_written(block) if self.files is not None
                    else self._half_written(block))

    def _half_written(self, block) -> bool:
        if not self._stepped:
            return False
        engine = self._engine()
        if engine is None:
            return False
        done = left = False
        for rec in engine.recs_of(block.params):
            for piece in rec.pieces:
                if id(piece) in self._stepped:
                    done = True
                elif id(rec) in self._hooked:
                    left = True
        return done and left

    def _hold(self, pieces) -> bool:
        """Whether this bucket's step is deferred past step() (defer_blocks=): its
        params all streamed, of the first defer_blocks blocks whose grads came in this
        backward. Backward makes the last blocks' grads first, and the worker steps in
        arrival order, so without this the first blocks, which the next forward needs
        first, are stepped last, after backward, while the GPU waits; deferred, the
        last blocks are stepped during the next forward's first blocks instead."""
        if not self.defer_blocks or not self._holding or self.files is not None:
            return False
        if any(p.rec.home is None for p in pieces):
            return False   # a resident param among them: step() writes it
        blocks = {id(p.rec.home.block) for p in pieces}
        if len(self._held_blocks | blocks) > self.defer_blocks:
            self._holding = False   # only the first ones: the rest in arrival order
            return False
        self._held_blocks |= blocks
        return True

    def holds(self, block) -> bool:
        """Whether a step of `block` is held for after step() (defer_blocks=) and the
        caller reads the block outside backward (between backward and step(): an
        inference forward, a state dict, the next micro-batch): it must `release` them
        first, or it would read the held blocks old, the others stepped (and a block in
        a bucket that reaches into one not held, half stepped)."""
        return (bool(self._held) and id(block) in self._held_blocks
                and torch._C._current_graph_task_id() == -1)

    def release(self) -> None:
        """Starts the held steps now, as if none had been held (they are the steps of
        this backward, checked at step() as those that ran in it), and waits for them:
        what is read between backward and step() is the model stepped, as without
        defer_blocks=. (An error is left for step() to raise.)"""
        engine = self._engine()
        held, self._held = self._held, []
        last = None
        for job in held:
            last = engine.run_early(job, lambda ran: self._stepped.update(map(id, ran)))
        if last is not None:
            engine.wait_for(last)

    def take_held(self) -> list:
        """step() has stepped everything else: the deferred jobs, the block the next
        forward uses first first (arrival order reversed), to run after it returns."""
        held, self._held = self._held[::-1], []
        return held

    # ---- at step() ----------------------------------------------------------------------

    def stepped(self) -> set:
        """Ids of the pieces stepped during backward (step() writes their params), or
        deferred past step() (their step started: step() must not step them again)."""
        return self._stepped | self._held_ids

    def verify(self, param_groups, state, grad_scale: float) -> None:
        """Waits for the early steps; raises if anything they used changed."""
        engine = self._engine()
        try:
            engine.drain()
        except BaseException:
            if self._started:
                self.commit()   # what ran stays consistent
            raise
        if self.spent is not None:
            raise RuntimeError(self.spent)
        problem = self._agreed(engine, self._problem(engine, param_groups, state, grad_scale))
        if problem is not None:
            self.fail(problem)

    def _agreed(self, engine, problem: Optional[str]) -> Optional[str]:
        """Under several ranks (FSDP2), the step is refused on every rank when one
        rank's is: a rank that went on would commit its step alone (its shards a step
        ahead of the others', with the state in files) or wait in the compact pass's
        collectives for a rank that raised (a hang). The refusal comes here, after the
        ranks agreed to step (optimizer.step: distributed.agree_to_step), because what
        the steps in backward used is compared only once they are drained."""
        other = distributed.other_refusal(problem, [r.param for r in engine.recs],
                                          engine.process_group)
        if other is not None:
            return f"rank {other[0]}'s step was refused, so every rank's is: {other[1]}"
        return problem

    def _problem(self, engine, param_groups, state, grad_scale) -> Optional[str]:
        if self.error is not None:
            return self.error
        early = [r for r in engine.recs if id(r) in self._started]
        if not early:
            return None
        if grad_scale != 1.0:
            return (f"step() scales the grads by {grad_scale!r} (a clipping "
                    "coefficient or 1/loss scale), but they were stepped unscaled")
        # A param taken out of param_groups since (a group popped, a list edited) is not
        # stepped by this step(), as a plain step would not step it: in RAM and two
        # generations its step in backward was kept all the same (found from outside)
        for rec in early:
            if id(rec) in engine._absent:   # (follow_groups just read them)
                return (f"{rec.label()} was taken out of param_groups after its step began "
                        "in backward")
        # The grad copied, still p.grad: unchanged when its version is, and its values
        # (fingerprint) are. A version bumped alone is not an edit when the values are
        # as copied: grads that are views of one flat buffer (DDP's
        # gradient_as_bucket_view, a grad arena) share one counter, which each
        # sibling's accumulation bumps. Without a fingerprint the version decides.
        kept = [r for r in early if r.copy is self._started[id(r)] and r.param.grad is not None
                and r.copy.grad() is r.param.grad]
        check = start_check(engine.device, kept)   # one wait for all
        same = {id(r) for r in kept
                if r.copy.is_of(r.param.grad) or r.copy.fingerprint is not None}
        edited = {id(r) for r, _, _ in check.changed()} if check is not None else set()
        # Params written (a model's load_state_dict, an in-place edit) after their step
        # began in backward from their values before: their own counters, which the
        # engine bumps only when step() ends. Resident params were then written from
        # their masters at step() (the load lost), streamed ones written in backward and
        # loaded over (the update lost), silently (found from outside)
        written = [r for r in early if r.param._version != self._versions.get(id(r))]
        wrote = {id(r) for r in written}
        # (with the state in files, those whose host copies the pass in backward wrote:
        # two generations)
        written_files = ({id(r) for r in self.files.stepped} & wrote
                         if self.files is not None else set())
        for rec in early:
            grad = rec.param.grad
            if grad is None or is_freed(grad):   # freed by us: its scale() guards edits
                if grad is None or not rec.freed:   # (None: the one we freed dropped)
                    return f"the grad of {rec.label()} was dropped after it was copied"
            elif id(rec) not in same or id(rec) in edited:
                return (f"the grad of {rec.label()} changed after it was copied during "
                        "backward (edited in place, replaced, clipped or scaled)")
            if engine.state_on_disk:   # load_state_dict abandons the pass itself
                if id(rec) in written_files:   # (abandoned by fail: the values stay)
                    self.files.written = written_files
                    return (f"{rec.label()} was written (a load_state_dict of the model, "
                            "an in-place edit) after its step began in backward from its "
                            "values before")
                continue
            if id(rec) in wrote:
                # the step's values win (in RAM), and it is said: a load of the same
                # values (a whole checkpoint) then changes nothing
                self._written = [r for r in written if r.home is not None]
                return (f"{rec.label()} was written (a load_state_dict of the model, an "
                        "in-place edit) after its step began in backward from its values "
                        "before: the values written are replaced by the step's (write "
                        "them again after step())")
            st = state[rec.param]
            if (st.get("exp_avg") is not rec.exp_avg or st.get(MASTER_KEY) is not rec.master
                    or st.get("step") is not rec.step_t):
                self._replaced = True
                return (f"the optimizer state of {rec.label()} was replaced "
                        "(load_state_dict?) after its step started")
        # A grad whose version moved with its values as copied (clip_grad_norm_ at inf
        # multiplies by 1; Trainer calls it every step) is its copy's grad as it is now:
        # said so, or step() would copy it again, into ring room that the steps deferred
        # past step() read before it lands (found from outside)
        for r in kept:
            if id(r) in same and id(r) not in edited:
                r.copy.version = r.param.grad._version
        now: Dict[int, Hyper] = {}
        for b in engine.buckets:
            used = self._hyper.get(b.group)
            if used is None:
                continue
            changed = format_changed(param_groups, b)
            if changed is not None:
                return changed
            if b.group not in now:
                now[b.group] = Hyper.of(param_groups[b.group], b.group)
            changes = used.changes(now[b.group])
            if changes:
                return (f"param group {b.group}'s hyperparameters changed after "
                        f"its step started ({', '.join(changes)}; an LR scheduler "
                        "stepped between backward and step()?)")
        return None

    def fail(self, reason: str) -> None:
        """Raises the step_in_backward error for `reason`, after writing the
        params whose step already ran (so each param equals its master). An
        engine taken over by a newer one writes nothing: the params are not its own."""
        self._engine().check_open()
        replaced, self._replaced = self._replaced, False
        # (read before commit(), whose abandon() clears it)
        written_files = self.files is not None and bool(self.files.written)
        stepped = (self.commit(write=not replaced, cause=reason)
                   if (self.error is not None or self._started) else 0)
        if replaced:
            what = ("The steps that ran in backward stepped the state that was replaced, "
                    "and are dropped: the params are those of the last completed step, "
                    "the state the one loaded")
        elif self.files is not None and self.files.unrestored:
            what = ("The state files are those of the last completed step, and so are the "
                    f"params, but {self.files.unrestored} streamed params in their first "
                    "step, which ran during backward and wrote them (their first values "
                    "are not kept): load the model's weights again to start over")
        elif self.files is not None and written_files:
            what = ("Nothing was stepped: the state files are those of the last completed "
                    "step, and so are the params but those written since backward, which "
                    "keep the values written (their masters follow them at the next step)")
        elif self.files is not None:
            what = ("Nothing was stepped: the state files and the params are those of "
                    "the last completed step")
        elif stepped:
            what = steps_kept(stepped)
            self.spent = (f"offload_adam: the last step() raised after the Adam step of "
                          f"{stepped} params had run during backward with these grads: a "
                          "step() with them again would step those params twice. Call "
                          "zero_grad() and run the next backward (or restore a checkpoint); "
                          "nothing was stepped")
        else:
            what = "Nothing was stepped"
        raise RuntimeError(
            f"offload_adam: {reason}; step_in_backward=True forbids this (the step "
            f"would differ from a plain step). {what}. Use step_in_backward=False "
            "(the default) to clip, scale, edit or accumulate grads or change "
            "hyperparameters between backward and step().")

    def commit(self, write: bool = True, cause: Optional[str] = None) -> int:
        """Writes the params of the early steps that ran, forgets them and starts
        a new iteration. Returns how many params were stepped (with the state in
        files: none, the pass is abandoned, see disk_early.py, for `cause`).
        write=False: the state they stepped was replaced (load_state_dict): their
        params are not written, and none counts."""
        engine = self._engine()
        if self.files is not None:
            try:
                self.files.abandon(cause)
            finally:
                self.new_iteration()
            return 0
        try:
            engine.drain()
        finally:
            stepped = {id(p.rec) for b in engine.buckets for p in b.pieces
                       if id(p) in self._stepped} if write else set()
            if write:
                engine.write_stepped(self._stepped)
                owner = self._owner()
                for rec in self._written:   # (streamed: their host copies loaded over)
                    master = owner.state[rec.param].get(MASTER_KEY)
                    if master is not None:   # (an fp32 one's is the host copy itself)
                        write_values(rec.param, master)
            self._written = []
            engine.forget_read(self._stepped)
            self.new_iteration()
        return len(stepped)

    def check_saving(self, since: Optional[int] = None, what: str = "state_dict()") -> None:
        """state_dict() between backward and step(): with the state in host RAM the
        steps started in backward write it in place, so it would hold the next step's
        state beside the model's weights of this one (a checkpoint that resumes wrong).
        Raises then; the iteration goes on (step() completes it). In files nothing is
        committed before step(): the state dict is the last completed step's. `since`:
        `begun` before state_dict() read the state; steps begun since, by a backward in
        another thread, read into it half (found from outside: a dict of two steps)."""
        if self.files is None and since is not None and self.begun != since:
            raise RuntimeError(
                f"offload_adam: {what} read the state while a backward (in another "
                "thread) started the step of some params with step_in_backward=True: the "
                "dict would hold state of two steps. Save the optimizer's state between "
                "step() and the next backward")
        if self.files is None and self._started:
            raise RuntimeError(
                f"offload_adam: {what} was called between backward and step() with "
                "step_in_backward=True: the step of some params already ran in backward, "
                "so their state is the next step's while the model's weights are not yet. "
                "Save the optimizer's state after step() (or before backward), with the "
                "model's; this iteration goes on with step()")

    def backward_raised(self) -> None:
        """The backward that started these steps raised (an error or Ctrl-C inside it,
        seen when the next grad, zero_grad or step comes): what comes next is told so."""
        if self._started and self.error is None:
            self.error = ("the backward in which the step of some params started raised "
                          "(an error or KeyboardInterrupt inside it)")

    def started_in_ram(self) -> int:
        """How many params' steps of this iteration ran (or run) in backward and stay:
        the state in RAM (a pass over state files commits nothing before step())."""
        return len(self._started) if self.files is None else 0

    def step_refused(self, problem: BaseException) -> None:
        """step() refused before its pass (a check: a bad lr, a param not of its
        optimizer...), the steps started in backward still pending: a step() after the
        problem is mended completes them; zero_grad() drops them (said, below)."""
        if self._started or self.error is not None:
            self._step_refused = f"{type(problem).__name__}: {problem}"

    def on_zero_grad(self) -> None:
        try:
            if (self._step_refused is not None and self.files is not None
                    and self.error is None):
                # step() said why it refused, and the files' pass commits nothing before
                # step(): dropped, nothing stepped, as torch's zero_grad after a refusal
                self.commit()
            elif self._started or self.error is not None:
                self.fail(self.error or (
                    f"zero_grad() was called after step() was refused ({self._step_refused})"
                    if self._step_refused is not None else
                    "zero_grad() was called after steps started during backward, before "
                    "step() (a backward that reached these params without a step() to "
                    "follow, a GAN's generator loss through its discriminator say: freeze "
                    "them for it, requires_grad_(False), so that it makes no grads for "
                    "them)"))
        finally:
            self.spent = None   # (the grads are zeroed: none is left to step twice)
        if self.files is not None and self.files.busy:   # read ahead, nothing stepped
            self.commit()

    def new_iteration(self) -> None:
        """The params that got grads this iteration are the ones the next
        iteration's buckets wait for (once the bucket order is learned; before, the
        guess: every hooked param)."""
        engine = self._engine()
        if self.files is not None:
            self.files.new_iteration()
        if self._hooked:   # (none: no backward since the last, e.g. a step() after a failure)
            self._previous = set(self._hooked) if engine.order_learned else None
        self._expected, self._waiting = None, {}
        self.error = self._step_refused = None
        self._hooked, self._started, self._stepped, self._hyper = {}, {}, set(), {}
        self._versions = {}
        self._counted = set()
        # (a failed step drops the held jobs unrun: those params are not stepped)
        self._held, self._held_ids, self._held_blocks, self._holding = [], set(), set(), True


def steps_kept(stepped: int) -> str:
    """What stays of the `stepped` params' steps that ran in backward, the state in host
    RAM, when the iteration ends without step() (a backward that raised, a close())."""
    return (f"The Adam step of {stepped} params already ran during backward, with the "
            "grads and hyperparameters as they were then, and cannot be undone (no copy of "
            "the previous state is kept): those params and their state are stepped, the "
            "other params are not (and step_count, the largest of their steps, counts this "
            "one). Restore a checkpoint to continue exactly")


def _listed_twice(groups) -> bool:
    """Whether step() refuses a param listed twice in the groups (check_listed_once)."""
    try:
        check_listed_once(groups)
    except ValueError:
        return True
    return False


def _refused_hyper(group: dict) -> bool:
    """Whether step() refuses the group's hyperparameters (kernel_step.Hyper.of: an lr set
    to NaN or past float32's step size, a beta set to 1, capturable=True): raised from a
    grad hook instead, it stopped backward with some grads made, and step() after the edit
    was undone stepped those only, silently (found from outside)."""
    try:
        Hyper.of(group)
    except (TypeError, ValueError):
        return True
    return False


def format_changed(param_groups, bucket) -> Optional[str]:
    """Why `bucket` cannot be stepped when its group's state_dtype is not its state's
    format (set after the optimizer was built: the offloaded state keeps the format it
    was laid out in); None when they agree."""
    group = param_groups[bucket.group]
    now, fmt = group.get("state_dtype", "float32"), bucket.pieces[0].rec.fmt.name
    if now == fmt:
        return None
    return (f"param group {bucket.group}'s state_dtype changed from {fmt!r} to {now!r} "
            "after the optimizer was built; the offloaded state keeps its format: build a "
            "new optimizer (load_state_dict converts a saved state)")

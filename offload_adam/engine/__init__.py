"""The offload engine: fp32 master weights and Adam moments in (pinned) host
memory, grads streamed to the host during backward, params streamed back.

Read in data order: core.py (the engine, the pipeline from hook to publish, the
step's one entry point `stepping`), then its parts: layout.py (pieces, buckets,
host buffers), grads.py (one record per grad copy, fingerprints), early.py
(step_in_backward; disk_early.py with the state in files), state.py (the state
dict's views, the master rule's checks), param_check.py (edits through p.data of
the device's params, seen by the sums of their bits), device.py (the device interface and its
rules; CudaDevice), packed_copy.py (which host bytes a copy of a list moves,
through which temporary), host_memory.py (pinned arenas), worker.py (the worker
thread, Ctrl-C), profile.py (the per-step profile).
"""

from .core import OffloadEngine, let_go_of

__all__ = ["OffloadEngine", "let_go_of"]

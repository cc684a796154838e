"""The NVMe tier: the optimizer state (fp32 master, moments in any state format, block
scales, step counts) in files on one or more drives, stepped bucket by bucket through a
ring of host buffers at the disk's speed, and crash-safe.

  layout.py    what a bucket holds, where its two slots lie in the files, the fingerprint
  direct_io.py aligned buffers, O_DIRECT (buffered fallback), a pool of pread/pwrite threads
  manifest.py  the checksummed manifest committed atomically each step; the directory lock
  fd_limit.py  the open-files limit: raised to the hard one when reached, else said
  store.py     NvmeState: open/create the files (never over a state), read/write a bucket
               (each slot checksummed), commit, roll back one step, mmap views
  circular.py  compact states: one copy per bucket in a ring per file with 4 spare extents
  redo.py      compact states: the redo log written before a step moves any bucket
  pipeline.py  StepPipeline: read ahead, step, write back, commit

Integration (the optimizer): build a StateSpec from its buckets in the order they are stepped
(the optimizer's: param_state.adam_bucket per bucket; `extra` for what else must match,
e.g. amsgrad; nothing in nvme/ knows what the tensors are), open
NvmeState.open(dirs, spec) (one set of directories per rank), fill it once with
StepPipeline.load (the masters from the params at step 0, or a loaded state dict), then each
step loop `for i, tensors in pipeline.buckets(): <bucket i's job: the fused kernel>` (or
pipeline.step(fn)); state_dict() returns NvmeState.views(i) of every bucket.
"""

from .direct_io import AlignedBuffer, NvmeError
from .layout import BucketSpec, StateSpec, TensorSpec
from .pipeline import StepPipeline, ring_size
from .store import NvmeState

__all__ = ["AlignedBuffer", "BucketSpec", "NvmeError", "NvmeState", "StateSpec",
           "StepPipeline", "TensorSpec", "ring_size"]

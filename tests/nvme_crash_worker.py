"""The training processes of tests/test_nvme_crash.py (the storage layer's, `worker`, the
optimizer's, `optimizer_worker`, and the engine's with step_in_backward, `engine_worker`),
forked from a forkserver that imported this module: torch, offload_adam and the compiled
kernels are loaded once there (the kernels' threads start at first use, so forking after
the load is safe), and a worker starts in milliseconds. Loading the kernels before the
state is opened also keeps the build's subprocesses (`c++ --version`, `ninja -n`) from
running while the lock is held."""

import torch

import offload_adam
from offload_adam import nvme_tier
from nvme_adam import adam_fn, compact_step, fill_initial, make_spec
from nvme_model import groups, make_params, train
from offload_adam.kernel_step import kernels
from offload_adam.nvme import NvmeState, StepPipeline
from offload_adam.testing import AsyncSimDevice, simulated

SEED = 5
kernels()


def spec_of(fmt, compact=False):
    # 4 buckets of ~1.2 MB (fp32): a step takes long enough that kills land in its writes;
    # compact: 12 smaller ones, so that a step commits its buckets a few at a time (its
    # ring has room for 4 more)
    if compact:
        return make_spec(fmt, buckets=12, numel=16_000)
    return make_spec(fmt, buckets=4, numel=50_000)


def worker(folder, fmt, until, progress):
    """Opens the state (the first values when it is at step 0: idempotent), sends its step
    count, and steps it until `until` completed steps, sending each one."""
    spec = spec_of(fmt)
    with NvmeState.open([folder], spec) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        if state.step == 0:
            pipe.load(fill_initial(SEED), step=0)
        progress.send(state.step)
        while state.step < until:
            pipe.step(adam_fn(SEED, state.step, threads=1))
            progress.send(state.step)
        pipe.close()


def compact_worker(folder, fmt, until, progress):
    """worker's run on a compact state (one copy, a redo log): a step cut short is
    finished from its log when the state is opened again."""
    spec = spec_of(fmt, compact=True)
    with open_compact([folder], spec) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        if state.step == 0 and not state.pending:
            pipe.load(fill_initial(SEED), step=0)
        if state.pending:
            compact_step(state, pipe, SEED)
        progress.send(state.step)
        while state.step < until:
            compact_step(state, pipe, SEED)
            progress.send(state.step)
        pipe.close()


def open_compact(folders, spec):
    """A compact state of `spec`, its redo log reserved for fp32 grads."""
    log = [sum(t.numel * 4 for t in b.tensors if t.name.endswith(".master")) + 4096
           for b in spec.buckets]
    return NvmeState.open(folders, spec, compact=True, log_bytes=log)


# The optimizer worker's model: fp32 and bf16 params in two groups, ~1.1 MB of fp32 state
# in ~70 KB buckets, so that a step has ~16 buckets, each read, stepped, written and the
# step committed: the kills land anywhere in it.
MODEL = dict(shapes=((130, 97), (9001,), (31, 7, 41), (12_000,), (77, 101), (5003,)),
             dtypes=(torch.float32, torch.bfloat16, torch.float32, torch.bfloat16,
                     torch.bfloat16, torch.float32))
BUCKET_MB = 0.07


def model_params():
    return make_params(**MODEL)


def optimizer(params, folder, fmt, resume=True, **kw):
    """The optimizer of the optimizer worker: state in files under `folder` (a directory
    or a list) when given, resumed from them; in host RAM otherwise (the uninterrupted run
    the test compares with)."""
    extra = dict(state_dirs=folder, bucket_mb=BUCKET_MB, state_resume=resume) if folder else {}
    return offload_adam.AdamW(groups(params, split=3), lr=0.01, state_dtype=fmt, **extra, **kw)


def committed_step(opt) -> int:
    """The completed steps of the state, read as a user can: the largest param step of the
    state dict (a param left without a grad has fewer; none at step 0)."""
    return int(max((float(s["step"]) for s in opt.state_dict()["state"].values()), default=0))


def compact_optimizer_worker(state_dir, fmt, until, progress):
    """optimizer_worker's run with state_footprint="compact" (one copy, a redo log)."""
    params = model_params()
    opt = optimizer(params, state_dir, fmt, state_footprint="compact")
    steps_until(opt, lambda k: train(opt, params, k, 1), until, progress)


def optimizer_worker(state_dir, fmt, until, progress):
    """A training run on the optimizer's NVMe tier: resumes the state in `state_dir`
    (state_resume=True: the params too come back from the files, as of its last completed
    step; nothing else is saved), sends its step, then trains to `until` steps, sending
    each step count once its step() returned."""
    params = model_params()
    opt = optimizer(params, state_dir, fmt)
    steps_until(opt, lambda k: train(opt, params, k, 1), until, progress)


def steps_until(opt, train_step, until, progress):
    """Sends opt's committed step, then train_step(k) for each next k up to `until`,
    sending each step count once it returned."""
    step = committed_step(opt)
    progress.send(step)
    while step < until:
        train_step(step)
        step += 1
        progress.send(step)


# The step_in_backward worker's model: bf16 layers and an fp32 head (both kinds of engine
# param) through the engine on the simulated device, with real backward passes so that the
# files' pass runs in them (engine/disk_early.py): ~20 file buckets. Elementwise layers, not
# matmuls: the test compares with a run in another process, and a matmul's rounding may
# change with the alignment of its buffers, which differs between processes.
ENGINE_BUCKET_MB = 0.01
# More rows than the tokens use (37): at dim 256 the table is 3 engine pieces, so its state
# is in 3 parts in the files (nvme_tier._lay_out), each in a bucket of its own.
EMBED_ROWS = 300


class Elementwise(torch.nn.Module):
    def __init__(self, dim=256, layers=8, rows=EMBED_ROWS):
        super().__init__()
        self.embed = torch.nn.Embedding(rows, dim)
        self.scales = torch.nn.ParameterList(torch.nn.Parameter(1 + 0.1 * torch.randn(dim))
                                             for _ in range(layers))
        self.biases = torch.nn.ParameterList(torch.nn.Parameter(0.1 * torch.randn(dim))
                                             for _ in range(layers))
        self.head = torch.nn.Parameter(torch.randn(dim) / dim ** 0.5)
        self.unused = torch.nn.Parameter(torch.zeros(dim))   # never gets a grad

    def forward(self, tokens):
        x = self.embed(tokens)
        for s, b in zip(self.scales, self.biases):
            x = torch.tanh(x * s + b)
        return (x.float() * self.head).sum(-1)


class Layer(torch.nn.Module):
    """One elementwise layer as a module: the block that `streamed` models stream."""

    def __init__(self, dim):
        super().__init__()
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x):
        return torch.tanh(x * self.scale + self.bias)


class Blocks(torch.nn.Module):
    """Elementwise's layers as modules, so that they can stream (issue 27)."""

    def __init__(self, dim=256, layers=8, rows=EMBED_ROWS):
        super().__init__()
        self.embed = torch.nn.Embedding(rows, dim)
        self.layers = torch.nn.ModuleList(Layer(dim) for _ in range(layers))
        self.head = torch.nn.Parameter(torch.randn(dim) / dim ** 0.5)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return (x.float() * self.head).sum(-1)


def engine_model(seed, blocks=False, streamed=False, param_dir=None):
    """Elementwise, or Blocks; `streamed`: Blocks with its layers streamed (stream_params,
    inside offload_adam.testing.simulated), from param files in `param_dir` when given
    (a cache of the fewest slots: blocks go back to their files and come again)."""
    torch.manual_seed(seed)
    m = (Blocks() if blocks or streamed else Elementwise()).to(torch.bfloat16)
    m.head.data = m.head.data.float()
    if streamed:
        files = {} if param_dir is None else dict(param_dirs=param_dir,
                                                  param_cache_mb=4 * 4096 / 2**20)
        offload_adam.stream_params(m, Layer, prefetch=1, **files)
    return m


def engine_values(m):
    """Every param's value in order (a streamed one's from its host copy)."""
    return list(m.state_dict().values())


def engine_loss(m, k):
    g = torch.Generator().manual_seed(1000 + k)
    tokens = torch.randint(0, 37, (4, 16), generator=g)
    return ((m(tokens) - tokens.float() / 37) ** 2).mean()


def engine_optimizer(m, folder=None, compact=False):
    """In files with step_in_backward (resuming them) when `folder` is given (`compact`:
    state_footprint="compact", the grads logged in backward); in host RAM with the plain
    step otherwise (the uninterrupted run)."""
    extra = dict(state_dirs=folder, state_resume=True, step_in_backward=True,
                 state_budget_mb=1.0) if folder else {}   # (3 of its largest buckets)
    if folder and compact:
        extra["state_footprint"] = "compact"
    return offload_adam.AdamW(m.parameters(), lr=3e-3, bucket_mb=ENGINE_BUCKET_MB,
                              state_dtype="bfloat16", **extra)


def engine_train(m, opt, first, count):
    for k in range(first, first + count):
        engine_loss(m, k).backward()
        opt.step()
        opt.zero_grad()


def engine_worker(state_dir, until, streamed, compact, progress):
    """As optimizer_worker, for the engine with step_in_backward on the simulated device
    (`compact`: on compact files; streamed="files": the layers' params in param files
    beside the state); the model starts from its init, and the files restore it."""
    nvme_tier.HEADS = streamed == "heads"   # (the split buckets, the default: set either way)
    sim = AsyncSimDevice(seed=until % 7)
    with simulated(sim), sim.watch():
        m = engine_model(seed=11, streamed=bool(streamed),
                         param_dir=state_dir + "-params" if streamed in ("files", "heads")
                         else None)
        opt = engine_optimizer(m, state_dir, compact)
        steps_until(opt, lambda k: engine_train(m, opt, k, 1), until, progress)

"""Models, data and training loops the optimizer and engine tests share.

TinyTransformer: 14 params of many shapes (an embedding, attention, norms,
biases, a head, and a layer that never gets a grad). make_mlp: 4 params, for
many short runs. Both in bf16 (the engine's usual case); the fp32 twin of a
model (`make_pair`) holds its params rounded, as a master starts.
"""
import copy

import torch

from offload_adam.state_format import stored_state
from offload_adam.testing import files_stepped_early, in_files, settle

BF16 = torch.bfloat16
OPTS = dict(lr=3e-3, weight_decay=0.1, bucket_mb=0.01)


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=37, dim=32, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)
        self.unused = torch.nn.Linear(dim, dim)  # never gets a grad

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


class Sometimes(TinyTransformer):
    """The tiny transformer, plus a layer that gets a grad every other step (`odd`)."""

    def __init__(self):
        super().__init__()
        self.sometimes = torch.nn.Linear(37, 37)
        self.odd = False

    def forward(self, tokens):
        out = super().forward(tokens)
        return self.sometimes(out.to(self.sometimes.weight.dtype)) if self.odd else out


def fp32_head(m):
    """m (bf16) with its head in fp32: both kinds of engine param (an fp32 param's master
    is the param itself)."""
    m.head.float()
    m.head.register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    return m


def decay_groups(m):
    """Two param groups: weight decay on the matrices, none on norms and biases."""
    named = list(m.named_parameters())
    return [{"params": [p for n, p in named if "norm" not in n and "bias" not in n]},
            {"params": [p for n, p in named if "norm" in n or "bias" in n], "weight_decay": 0.0}]


def make_pair(seed=0):
    """(bf16 model, fp32 twin holding the same values)."""
    torch.manual_seed(seed)
    ref = TinyTransformer()
    model = copy.deepcopy(ref).to(BF16)
    ref.load_state_dict({k: v.to(BF16).float() for k, v in ref.state_dict().items()})
    return model, ref


def loss_of(model, seed, dtype=BF16):
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, 37, (2, 8), generator=g)
    logits = model(tokens).to(dtype)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(BF16)


def mlp_loss(model, seed):
    """A loss of make_mlp's model (in its dtype: bf16, or fp32 after a cast)."""
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    return model(x.to(model[0].weight.dtype)).float().pow(2).sum()


# Options for make_mlp's model: tiny buckets, so that its params span several.
MLP_OPTS = dict(lr=3e-3, weight_decay=0.1, eps=1e-2, bucket_mb=0.0001)


def halve_grad(p):
    """A user's post-accumulate-grad hook that edits the grad in place."""
    p.grad.mul_(0.5)


class Boom(ValueError):
    """An error raised on purpose (a failing kernel, hook or user callback)."""


def copy_grads(model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = None if p.grad is None else p.grad.float()


def run(model, opt, iters, edit=None, micro=1, start=0, loss=loss_of):
    """`iters` training steps; `edit(model, opt)` between backward and step."""
    for it in range(start, start + iters):
        for m in range(micro):
            loss(model, 10 * it + m).backward()
        if edit is not None:
            edit(model, opt)
        opt.step()
        opt.zero_grad()


def train_shadow(shadow, ref, ropt, steps, micro=1):
    """The reference run: `shadow` (bf16, holding ref's params rounded) makes the
    grads of `run`'s batches, `ropt` steps the fp32 `ref` with them."""
    for it in range(steps):
        for m in range(micro):
            loss_of(shadow, 10 * it + m).backward()
        copy_grads(shadow, ref)
        ropt.step()
        shadow.zero_grad()
        with torch.no_grad():
            for p, q in zip(shadow.parameters(), ref.parameters()):
                p.copy_(q)


def states(opt):
    """param -> its state, wherever the optimizer keeps it: opt.state in host RAM; with
    state_dirs= (opt.state then holds an empty entry per stepped param, nvme_tier.py) the
    files' last committed step, as state_dict() shows it, under the state's own keys
    (stored_state: 8-bit codes as "exp_avg"...). The file views hold their values
    through the next step (clone to keep them longer)."""
    if not in_files(opt):
        return opt.state
    sd = opt.state_dict()
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    return {p: stored_state(sd["state"][i]) for i, p in zip(ids, params) if i in sd["state"]}


def state_of(opt, model, keys=("master_param", "exp_avg", "exp_avg_sq", "step")):
    """Every param's state entries (None for a param never stepped), cloned."""
    held = states(opt)
    return [{k: held[p][k].clone() for k in keys if k in held[p]}
            if held.get(p) else None for p in model.parameters()]


def assert_same(a, b):
    """Two runs (model, opt) ended bit for bit equal: params and state."""
    (m1, o1), (m2, o2) = a, b
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    for s1, s2 in zip(state_of(o1, m1), state_of(o2, m2)):
        assert (s1 is None) == (s2 is None)
        for key in s1 or {}:
            assert torch.equal(s1[key], s2[key]), key


def assert_param_is_master_rounded(opt, model):
    held = states(opt)
    for p in model.parameters():
        st = held.get(p)
        if st and p.dtype != torch.float32:
            assert torch.equal(p, st["master_param"].to(p.dtype))


def steps_of(opt, model):
    held = states(opt)
    return [float(held[p]["step"]) if held.get(p) else 0.0 for p in model.parameters()]


def early_steps(opt, model, before):
    """How many params were stepped during the backward just run (step_in_backward):
    once the steps it queued have run, their state's step count is past `before`
    (steps_of from before that backward). With state_dirs= the state shows nothing
    before step() commits (engine/disk_early.py): the params the files' pass stepped."""
    if in_files(opt):
        return files_stepped_early(opt)
    settle(opt)
    return sum(now > then for now, then in zip(steps_of(opt, model), before))


def kernels_that(monkeypatch, before_step):
    """The real kernels, with `before_step(args)` run before each adam_step."""
    from offload_adam import kernel_step
    real = kernel_step.kernels()

    class Wrapped:
        def adam_step(self, *args, **kwargs):
            before_step(args)
            return real.adam_step(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(kernel_step, "kernels", Wrapped)


def train_with_edit(make, edit, params, grads, groups, steps=3, edit_at=1, backward=False):
    """`steps` steps of optimizer `make(groups(ps))` over copies `ps` of `params`, with
    `edit(opt, ps)` before step `edit_at`; each step's grads `grads(step)` set by hand,
    or (`backward`) made by a backward, as the engine's hooks see them. Returns the
    params after, and the optimizer."""
    ps = [p.clone().requires_grad_() for p in params]
    opt = make(groups(ps))
    for s in range(steps):
        if s == edit_at:
            edit(opt, ps)
        if backward:
            sum((p * g).sum() for p, g in zip(ps, grads(s))).backward()
        else:
            for p, g in zip(ps, grads(s)):
                p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ps], opt

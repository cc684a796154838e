"""Params streamed per block (param_stream.py) on the simulated asynchronous device:
training is bit for bit the training with the params resident through the engine, the
device holds what the streamer promises, and nothing is read or reused out of order."""
import copy
import gc
import math
import re
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import offload_adam
from conftest import SIMS, sim_path
from offload_adam.testing import AsyncSimDevice, SimEvent, simulated

BF16 = torch.bfloat16
OPTS = dict(lr=3e-3, weight_decay=0.1, bucket_mb=0.05)   # a few blocks per bucket


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


class Block(torch.nn.Module):
    """A Llama decoder layer in small: causal attention and a gated MLP, pre-norm."""

    def __init__(self, dim, hidden, heads=2):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = (torch.nn.Linear(dim, hidden, bias=False) for _ in range(2))
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class TinyLlama(torch.nn.Module):
    """Embedding tied with the head, `layers` blocks, a final norm."""

    def __init__(self, vocab=61, dim=32, hidden=64, layers=16, checkpointed=False, block=Block):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(block(dim, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = (checkpoint(layer, x, use_reentrant=self.checkpointed == "reentrant")
                 if self.checkpointed else layer(x))
        return self.head(self.norm(x))


def make_llama(seed=0, layers=16, frozen=(3,), **kw):
    torch.manual_seed(seed)
    m = TinyLlama(layers=layers, **kw).to(BF16)
    for i in frozen:
        m.layers[i].requires_grad_(False)
    return m


def llama_loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 61, (2, 9), generator=g)
    logits = model(tokens[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 61), tokens[:, 1:].reshape(-1))


def train(model, opt, steps, micro=1, start=0):
    for it in range(start, start + steps):
        for m in range(micro):
            llama_loss(model, 10 * it + m).backward()
        opt.step()
        opt.zero_grad()


def values(model):
    """name -> value of every param (a streamed one's from its host copy), cloned."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_training(a, b):
    (m1, o1), (m2, o2) = a, b
    v1, v2 = values(m1), values(m2)
    assert v1.keys() == v2.keys()
    for k in v1:
        assert torch.equal(v1[k], v2[k]), k
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for i in s1:
        for key in s1[i]:
            assert torch.equal(torch.as_tensor(s1[i][key]), torch.as_tensor(s2[i][key])), (i, key)


@pytest.fixture(params=SIMS)
def device(request, kernels):
    with sim_path(request.param) as where:   # built, watched and checked as conftest's
        yield where.sim


class _FlatBlock(torch.nn.Module):
    """Its weights views of one flat buffer (Megatron's way): one version counter."""

    def __init__(self, seed):
        super().__init__()
        flat = torch.randn(2 * 64, generator=torch.Generator().manual_seed(seed))
        flat = flat.to(BF16)
        self.w1 = torch.nn.Parameter(flat[:64].view(8, 8))
        self.w2 = torch.nn.Parameter(flat[64:].view(8, 8))

    def forward(self, x):
        return torch.tanh(x @ self.w1 @ self.w2)


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_params_that_view_one_buffer_stream_as_resident(device, step_in_backward):
    """Params made as views of one flat buffer share its version counter: the optimizer's
    bump of one moved the others', each was counted on its own, and the second forward
    said they were written in place (found from outside). Trained bit for bit as
    resident."""
    runs = []
    for streamed in (False, True):
        model = torch.nn.Sequential(_FlatBlock(0), _FlatBlock(1), _FlatBlock(2))
        assert model[0].w1._version == model[0].w2._version   # (one counter)
        if streamed:
            offload_adam.stream_params(model, _FlatBlock, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-2, step_in_backward=step_in_backward)
        for it in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it)).to(BF16)
            model(x).float().square().sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_training(*runs)


def test_a_block_fetched_ahead_shows_its_placeholders_until_its_use(device):
    """A forward hook of block 0 reading block 1's weight (logging) while block 1 is
    fetched ahead read the device copy in flight (an ordering violation: on a GPU, any
    bytes) and a write there raced the copy and was lost (found from outside): the
    params show their placeholders until the block's own use publishes the copies, so
    the read is the NaN of any read between uses, and the device reports no violation
    (the fixture checks). Training is the same."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=4)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1)
        seen = []
        model.layers[0].register_forward_hook(
            lambda mod, args, out, m=model: seen.append(m.layers[1].q.weight.float().sum()))
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 3, micro=2)
        runs.append((model, opt))
    assert len(seen) == 6 and all(bool(torch.isnan(x)) for x in seen)
    assert_same_training(*runs)


def test_functional_call_with_other_tensors_for_streamed_params_is_refused_as_such(device):
    """torch.func.functional_call swapping a tensor in for a streamed param (and
    torch.func.grad, which swaps the model's own detached) was refused as a param
    "replaced after stream_params (assigned, or tied)", which the user had not done
    (found from outside): said as it is; the model computes as before after, and a
    call swapping only resident params goes through."""
    from torch.func import functional_call
    model = make_llama(layers=2, frozen=())
    offload_adam.stream_params(model, Block, prefetch=1)
    x = torch.arange(8).view(1, 8)
    zeros = torch.zeros(model.layers[0].q.weight.shape, dtype=BF16)
    with pytest.raises(RuntimeError, match=r"param layers.0.q.weight of a streamed block holds "
                                           r"a tensor that is not it .*functional_call"):
        functional_call(model, {"layers.0.q.weight": zeros}, (x,))
    before = model(x)
    assert bool(before.isfinite().all())
    head = model.embed.weight.detach().clone()
    assert torch.equal(functional_call(model, {"embed.weight": head}, (x,)), before)


@pytest.mark.parametrize("what", ["model", "block"])
def test_torch_compile_of_a_streamed_model_or_block_is_refused_by_name(device, what):
    """torch.compile of a streamed model (Hugging Face's torch_compile=True) or of a
    streamed block: inductor failed in the forward and aot_eager in backward with torch's
    errors, and the eager backend trained on other values than uncompiled, silently
    (found from outside). Refused naming it, by every backend; the model trains on
    uncompiled as if the refused call had not been made."""
    runs = []
    for refused in (False, True):
        model = make_llama(layers=4)
        offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        if refused:
            for backend in ("eager", "aot_eager"):
                torch._dynamo.reset()
                if what == "model":
                    f = torch.compile(model, backend=backend)
                else:
                    model.layers[1].compile(backend=backend)
                    f = model
                with pytest.raises(RuntimeError, match="torch.compile of a model streamed by "
                                                       "stream_params .* is not supported"):
                    llama_loss(f, 0).backward()
                if what == "block":
                    del model.layers[1]._compiled_call_impl
            opt.zero_grad()
        train(model, opt, 2)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_torch_func_grad_through_a_streamed_block_is_refused_by_name(device):
    """torch.func.grad through a streamed block (for a resident param, or a block's
    input): the block's fetch inside the transform failed in torch ("mutate a captured
    Tensor", or "no storage" from the views of its host copies; found from outside). The
    fetch runs outside the transform; what torch.func.grad then builds, a graph of the
    grads through the block (create_graph), is refused naming the block and torch.func;
    the model trains on as the unstreamed one."""
    from torch.func import functional_call, grad
    model = make_llama(layers=2, frozen=())
    plain = copy.deepcopy(model)
    offload_adam.stream_params(model, Block, prefetch=1)
    x = torch.arange(8).view(1, 8)
    calls = (lambda: grad(lambda w: functional_call(model, {"embed.weight": w}, (x,))
                          .float().sum())(model.embed.weight.detach()),
             lambda: grad(lambda e: model.layers[0](e).float().sum())(model.embed(x).detach()))
    for call in calls:
        with pytest.raises(RuntimeError, match=r"create_graph=True reached streamed block "
                                               r"layers\.\d.*torch\.func\.grad"):
            call()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    ref = offload_adam.AdamW(plain.parameters(), **OPTS)
    train(model, opt, 2)
    train(plain, ref, 2)
    _assert_same_values(model, plain)


@pytest.mark.parametrize("how", ["close", "take_over"])
def test_an_optimizer_closed_between_backward_and_step_lets_the_streamer_close(device, how):
    """step_in_backward, state in RAM: the optimizer closed (or taken over by a newer one)
    after a backward, before step(), was accepted without a word, the model half a step
    ahead, and its pending steps kept the streamer from closing ("call step() first") for
    as long as the old optimizer lived (found from outside). Now it says what ran, and
    the streamer closes; the params are their host copies' (masters rounded)."""
    model = make_llama(layers=4)
    s = offload_adam.stream_params(model, Block, prefetch=1)
    opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "step_in_backward": True})
    train(model, opt, 1)
    llama_loss(model, 1).backward()
    with pytest.warns(RuntimeWarning, match=r"closed \(or taken over by a newer one\) between "
                                            r"backward and step\(\).*The Adam step of [1-9]"):
        if how == "close":
            opt.close()
        else:
            newer = offload_adam.AdamW(model.parameters(), **OPTS)
    masters = {id(p): st["master_param"] for p, st in opt.state.items() if "master_param" in st}
    s.close()
    for p in model.parameters():
        if id(p) in masters:
            assert torch.equal(p.detach().cpu(), masters[id(p)].to(p.dtype)), p.shape
    if how == "take_over":
        newer.close()


def test_a_forward_on_another_thread_while_one_is_in_a_block_is_refused(device):
    """Two threads' forwards of one streamed model at once released each other's blocks:
    one computed with placeholders (NaN, silently) or was told a submodule ran outside
    its block (found from outside). The second is refused by name; the first goes on,
    its output the same as alone."""
    import threading
    model = make_llama(layers=3, frozen=())
    offload_adam.stream_params(model, Block, prefetch=1)
    x = torch.arange(8).view(1, 8)
    with torch.no_grad():
        want = model(x)
    errors = []

    def other():
        try:
            with torch.no_grad():
                model(x)
        except RuntimeError as e:
            errors.append(str(e))

    def start_other(module, args):   # (inside block 1, fetched: its forward is on)
        t = threading.Thread(target=other)
        t.start()
        t.join(30)
    handle = model.layers[1].register_forward_pre_hook(start_other)
    with torch.no_grad():
        got = model(x)
    handle.remove()
    assert len(errors) == 1 and ("another thread's forward of this streamed model is in "
                                 "block layers.1") in errors[0], errors
    assert torch.equal(got, want)


@pytest.mark.parametrize("files,step_in_backward", [(False, False), (False, True),
                                                    (True, False), (True, True)])
def test_a_backward_into_a_block_by_a_way_other_than_its_outputs(device, tmp_path, files,
                                                                  step_in_backward):
    """A loss on what a forward hook took out of a block (attention maps; a KV cache made
    with grad and read by a later forward), not on the block's output: backward ran the
    block's nodes without its outputs' hook fetching it, and they read the released
    params (torch's 'setStorage: ... out of bounds for storage of size 0', found from
    outside). Trained bit for bit as resident; the last block's output gets no grad,
    and block 3 none at all."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=4, frozen=())
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=2, **(
                {"param_dirs": tmp_path / "p", "param_cache_mb": 1} if files else {}))
        side = []
        for i in (1, 2):
            model.layers[i].q.register_forward_hook(lambda m, a, out: side.append(out))
        opt = offload_adam.AdamW(model.parameters(), **OPTS, step_in_backward=step_in_backward)
        for it in range(3):
            side.clear()
            tokens = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(it))
            model(tokens)
            sum(o.float().square().mean() for o in side).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("target", ["block", "submodule"])
def test_a_load_into_a_block_from_its_own_forward_is_refused(device, target):
    """load_state_dict into a block from its own forward pre-hook released its params
    under its computation, which read the placeholders: NaN, stepped into every param,
    silently (found from outside; a submodule's load was 'called outside its block').
    Refused by name, nothing loaded; the model trains on."""
    model = make_llama(layers=3, frozen=())
    offload_adam.stream_params(model, Block, prefetch=1)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    layer = model.layers[1]
    new = {k: torch.zeros_like(v) for k, v in layer.state_dict().items()}
    if target == "block":
        hook = layer.register_forward_pre_hook(lambda m, a: m.load_state_dict(new) and None)
    else:
        hook = layer.register_forward_pre_hook(
            lambda m, a: m.q.load_state_dict({"weight": new["q.weight"]}) and None)
    before = values(model)
    with pytest.raises(RuntimeError, match=r"load_state_dict into block layers.1 \(Block\) "
                                           r"while it computes .* nothing was loaded"):
        llama_loss(model, 0).backward()
    hook.remove()
    after = values(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt.zero_grad()
    train(model, opt, 2)
    assert all(bool(v.isfinite().all()) for v in values(model).values())


@pytest.mark.parametrize("files", [False, True])
def test_a_streamed_param_loaded_between_backward_and_step_is_said(device, tmp_path, files):
    """step_in_backward: the step wrote the host copy in backward, a load then wrote
    over it, and step() kept the load with the update lost (its master followed the
    load at the next step), silently (found from outside). In RAM the step's values
    win and it is said; with the state in files (two generations: the pass in
    backward) nothing is stepped and the values written are kept, said too."""
    model = make_llama(layers=3, frozen=())
    offload_adam.stream_params(model, Block, prefetch=1)
    kw = {"state_dirs": tmp_path} if files else {}
    opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "step_in_backward": True}, **kw)
    train(model, opt, 1)
    llama_loss(model, 1).backward()
    q = model.layers[1].q
    q.load_state_dict({"weight": torch.zeros_like(q.weight)})
    with pytest.raises(RuntimeError, match=r"was written \(a load_state_dict of the model, an "
                                           r"in-place edit\) after its step began in backward"
                                           + (r".*Nothing was stepped: .* but those written "
                                              r"since backward, which keep the values written"
                                              if files else r".*replaced by the step's")):
        opt.step()
    weight = values(model)["layers.1.q.weight"]
    if files:
        assert not weight.any()
    else:
        assert weight.any()
        master = opt.state[q.weight]["master_param"]
        assert torch.equal(weight, master.to(BF16))
    opt.zero_grad()
    train(model, opt, 2, start=2)
    assert all(bool(v.isfinite().all()) for v in values(model).values())


class _TransposedBlock(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        w = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))
        self.w = torch.nn.Parameter(w.t())   # strides (1, 16)

    def forward(self, x):
        return torch.tanh(x @ self.w)


def test_a_transposed_param_streams_with_its_strides(device):
    """A streamed param computes on the device with the strides it had resident (a
    transposed weight, a channels_last conv's): its contiguous copy took another matmul
    path, 1 ulp off in fp32 (found from outside). Trained bit for bit as resident; close()
    gives it back with them too."""
    runs, seen = [], []
    for streamed in (False, True):
        model = torch.nn.Sequential(_TransposedBlock(0), _TransposedBlock(1))
        s = offload_adam.stream_params(model, _TransposedBlock, prefetch=1) if streamed else None
        model[0].register_forward_pre_hook(lambda m, args: seen.append(m.w.stride()))
        opt = offload_adam.AdamW(model.parameters(), lr=1e-2)
        for it in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(it))
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_training(*runs)
    assert set(seen) == {(1, 16)}
    s.close()
    assert model[1].w.stride() == (1, 16)
    assert torch.equal(model[1].w, runs[0][0][1].w)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_streamed_training_is_the_resident_training(device, checkpointed, prefetch):
    """16 blocks (one frozen), tied embeddings, 4 micro-batches per step, 5 steps:
    streamed is bit for bit the same training with every param resident."""
    runs = []
    for streamed in (False, True):
        model = make_llama(checkpointed=checkpointed)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=prefetch)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 5, micro=4)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_device_holds_what_the_streamer_promises(device):
    """Per micro-batch: params go host->device twice (forward, backward), nothing of
    them at step(); the device's param memory peaks at (k + 1) x the largest block: the
    one in use and k ahead (the bound, k + 2, allows for one given back whose copy is
    still queued; in backward a block's release once came after the fetch of the block
    before it, which also fetched k ahead: a block more)."""
    model = make_llama(layers=8, frozen=())
    prefetch = 2
    streamer = offload_adam.stream_params(model, Block, prefetch=prefetch)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1, micro=1)   # the order is learned
    before = device.counters()
    device.reset_peak()
    for m in range(3):
        llama_loss(model, 100 + m).backward()
    after_backward = device.counters()
    opt.step()
    after_step = device.counters()
    opt.zero_grad()
    assert after_backward["h2d_bytes"] - before["h2d_bytes"] == 3 * 2 * streamer.streamed_bytes
    resident = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    resident_h2d = sum(p.numel() * p.element_size() for p in resident)
    assert after_step["h2d_bytes"] - after_backward["h2d_bytes"] == resident_h2d
    assert after_step["materialized_bytes"] == 0
    assert 0 < after_backward["peak_materialized_bytes"] <= (prefetch + 1) * streamer.largest_block_bytes


def test_a_streamed_param_between_uses_holds_no_device_memory_and_reads_as_nan(device):
    model = make_llama(layers=2, frozen=())
    offload_adam.stream_params(model, Block)
    w = model.layers[0].q.weight
    assert w.shape == (32, 32) and w.untyped_storage().nbytes() <= 2
    assert torch.isnan(w).all()
    with pytest.raises(RuntimeError):
        w.add_(1)  # a write into the placeholder raises
    assert not math.isnan(float(model.state_dict()["layers.0.q.weight"].float().sum()))


def test_state_dict_round_trip_through_the_host_copies(device):
    model = make_llama(layers=3, frozen=())
    plain = copy.deepcopy(model)
    offload_adam.stream_params(model, Block)
    sd = model.state_dict()
    kept = model.state_dict(keep_vars=True)   # Parameters, with the real values too
    for k, v in plain.state_dict().items():
        assert torch.equal(sd[k], v), k
        assert isinstance(kept[k], torch.nn.Parameter) and torch.equal(kept[k].detach(), v), k
    other = make_llama(seed=1, layers=3, frozen=())
    model.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert torch.isnan(model.layers[1].up.weight).all()   # streamed again, not resident
    torch.testing.assert_close(llama_loss(model, 3), llama_loss(other, 3), rtol=0, atol=0)


@pytest.mark.parametrize("files", [False, True])
@pytest.mark.parametrize("between", ["nothing", "forward", "close", "submodule"])
def test_a_load_that_raised_inside_a_block_leaves_it_loadable(device, tmp_path, files, between):
    """A hook of the user's refusing a checkpoint (a load pre-hook on a submodule of a
    block) raised between the block's own load hooks, which left the block loading: the
    next load, taken for one nested in it, wrote into the placeholders (torch's overlap
    error at every load after the next forward; found from outside). What the failed load
    wrote before it raised stays written, as torch's load leaves it; the next load, a
    forward and close() then see the checkpoint loaded (a load of a submodule of the
    block in between too: state_dict() reads it before the load is ended)."""
    def refuse_inf(module, sd, prefix, *rest):
        w = sd.get(prefix + "weight")
        if w is not None and not torch.isfinite(w.float()).all():
            raise ValueError(f"non-finite values at {prefix}weight")

    runs = []
    for streamed in (False, True):
        model = make_llama(layers=3, frozen=())
        streamer = offload_adam.stream_params(model, Block, **(
            {"param_dirs": tmp_path / "p", "param_cache_mb": 1} if files else {})) if streamed else None
        model.layers[1].up._register_load_state_dict_pre_hook(refuse_inf, with_module=True)
        bad = make_llama(seed=1, layers=3, frozen=()).state_dict()
        bad["layers.1.up.weight"] = torch.full_like(bad["layers.1.up.weight"], math.inf)
        with pytest.raises(ValueError, match=r"non-finite values at layers\.1\.up\.weight"):
            model.load_state_dict(bad)
        got = [values(model)]
        if between == "forward":
            with torch.no_grad():
                llama_loss(model, 0)
        elif between == "close" and streamed:
            streamer.close()
        good = make_llama(seed=2, layers=3, frozen=()).state_dict()
        if between == "submodule":   # (inside the failed load's block: taken as nested)
            model.layers[1].q.load_state_dict({"weight": good["layers.1.q.weight"]})
            got.append(values(model))
        model.load_state_dict(good)
        got.append(values(model))
        got.append(float(llama_loss(model, 1)))
        if streamed:
            assert torch.isnan(model.layers[1].up.weight).all() == (between != "close")
            streamer.close()
        got.append(values(model))
        runs.append(got)
    for a, b in zip(*runs):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert a == b


def test_hooks_of_the_users_registered_before_streaming_see_the_host_copies(device):
    """A state_dict hook on a submodule of a block registered before stream_params (save a
    weight in fp32, add its norm) ran before the streamer's, which then replaced its entry
    with the bf16 host copy, and the norm it added was of the placeholder's NaN; a load
    pre-hook reading the weight it loads over read NaN (found from outside). Both now see
    what they see unstreamed."""
    def fp32_and_norm(module, sd, prefix, meta):
        sd[prefix + "weight"] = sd[prefix + "weight"].float()
        sd[prefix + "weight_norm"] = sd[prefix + "weight"].norm()

    runs = []
    for streamed in (False, True):
        model = make_llama(layers=3, frozen=())
        seen = []
        up = model.layers[1].up
        up._register_state_dict_hook(fp32_and_norm)
        up._register_load_state_dict_pre_hook(
            lambda module, sd, prefix, *rest: seen.append(module.weight.detach().clone()),
            with_module=True)
        if streamed:
            offload_adam.stream_params(model, Block)
        sd = model.state_dict()
        model.load_state_dict({k: v for k, v in sd.items() if not k.endswith("_norm")})
        runs.append((sd, seen))
    (a, seen_a), (b, seen_b) = runs
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert b["layers.1.up.weight"].dtype == torch.float32
    assert torch.isfinite(b["layers.1.up.weight_norm"])
    assert len(seen_b) == 1 and torch.equal(seen_a[0], seen_b[0])


class _ScaledBlock(Block):
    """A block with a learned one-element scale (a layer scale, a gate)."""

    def __init__(self, dim, hidden):
        super().__init__(dim, hidden)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x + (super().forward(x) - x) * self.scale


def test_a_one_element_param_of_a_block_stays_resident_and_takes_data_writes(device):
    """`scale.data.clamp_(0, 1)` (CLIP's logit_scale clamp) between steps: on a streamed
    one-element param it clamped the placeholder's NaN, which stays NaN, so the write was
    lost without a word (found from outside); such a param stays resident, and the
    training is the unstreamed one with the clamp."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=3, frozen=(), block=_ScaledBlock)
        if streamed:
            streamer = offload_adam.stream_params(model, _ScaledBlock)
            assert all(id(l.scale) not in {id(p) for b in streamer.blocks for p in b.params}
                       for l in model.layers)
        opt = offload_adam.AdamW(model.parameters(), lr=0.1)
        train(model, opt, 1)
        with torch.no_grad():
            for layer in model.layers:
                layer.scale.data.clamp_(0, 1)
        assert all(float(l.scale) == 1.0 for l in model.layers)
        assert torch.isnan(model.layers[1].up.weight).all() == streamed
        train(model, opt, 2, start=1)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_the_refusal_after_a_grad_scaler_with_step_in_backward_names_it(device, tmp_path):
    """GradScaler with step_in_backward and state files: the first scaler.step is refused
    (its skip comes after the step that ran in backward), and the next step() is refused
    because the streamed params in their first step moved: that refusal read as a disk's
    failure ("a step of the state files failed"), the GradScaler unnamed (found from
    outside). It names what stopped the step now."""
    model = make_llama(layers=3, frozen=())
    offload_adam.stream_params(model, Block, prefetch=2)
    opt = offload_adam.AdamW(model.parameters(), lr=3e-3, bucket_mb=0.008,
                             step_in_backward=True, state_dirs=[tmp_path])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(llama_loss(model, 0)).backward()
    with pytest.raises(RuntimeError, match="GradScaler.step was used"):
        scaler.step(opt)
    opt.zero_grad()
    scaler.scale(llama_loss(model, 1)).backward()
    with pytest.raises(RuntimeError, match=r"a step of the state files failed \(GradScaler\.step "
                                           r"was used: .*\) after it had stepped some params"):
        scaler.step(opt)
    opt.close()


def test_setup_errors_name_the_problem(device):
    model = make_llama(layers=2, frozen=())
    with pytest.raises(ValueError, match="no module of the model matches"):
        offload_adam.stream_params(model, torch.nn.GRU)
    for bad in (-1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
            offload_adam.stream_params(model, Block, prefetch=bad)
    class Index:   # an integer of another type (numpy's, from a config): taken as torch does
        def __index__(self):
            return 1
    other = make_llama(layers=2, frozen=())
    assert offload_adam.stream_params(other, Block, prefetch=Index()).prefetch == 1
    tied = make_llama(layers=2, frozen=())
    tied.layers[1].q.weight = tied.layers[0].q.weight
    with pytest.raises(ValueError, match="layers.1.q.weight is shared with block layers.0"):
        offload_adam.stream_params(tied, Block)
    offload_adam.stream_params(model, Block)
    with pytest.raises(ValueError, match="streams already"):
        offload_adam.stream_params(model, Block)


def test_optimizer_built_before_streaming_is_refused_at_step(device):
    model = make_llama(layers=2, frozen=())
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    offload_adam.stream_params(model, Block)
    llama_loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="build the optimizer after stream_params"):
        opt.step()


@pytest.mark.parametrize("opts", [dict(), dict(step_in_backward=True), dict(files=True),
                                  dict(step_in_backward=True, files=True),
                                  dict(free_grads_after_copy=True),
                                  dict(free_grads_after_copy=True, files=True)],
                         ids=["ram", "step-in-backward", "files", "step-in-backward-files",
                              "free-grads", "free-grads-files"])
def test_streamed_training_in_every_store_is_the_resident_training(device, tmp_path, opts):
    """The state in RAM, stepped during backward, or in files (state_dirs=); the grads
    freed on the device once on the host, the second micro-batch added there: streamed
    is still bit for bit the resident training (its grads kept on the device)."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=6)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=2)
        kw = dict(OPTS, step_in_backward=opts.get("step_in_backward", False),
                  free_grads_after_copy=streamed and opts.get("free_grads_after_copy", False))
        if opts.get("files"):
            (tmp_path / f"state{int(streamed)}").mkdir()
            kw["state_dirs"] = str(tmp_path / f"state{int(streamed)}")
        opt = offload_adam.AdamW(model.parameters(), **kw)
        train(model, opt, 3, micro=1 if kw["step_in_backward"] else 2)   # (it forbids accumulation)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_a_streamed_param_loaded_mid_training_is_followed_by_its_master(device):
    """model.load_state_dict with new values between steps: the next step starts from
    them (the master rule), streamed as resident."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=4)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        sd["layers.2.q.weight"] = sd["layers.2.q.weight"] * 2
        model.load_state_dict(sd)
        train(model, opt, 2, start=2)
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("held", [False, True], ids=["dropped", "held"])
@pytest.mark.parametrize("early", [False, True], ids=["at step", "in backward"])
def test_a_write_into_the_state_dicts_tensors_is_followed_by_its_master(device, held, early):
    """model.state_dict()[k].mul_(0.5): torch's state dict tensors are the params, so the
    edit is the model's; a streamed model's are tensors over the host copies, of counters
    of their own: the master follows the edit all the same, whether the dict was dropped
    before the next step or held and edited after one."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=4)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=early, **OPTS)
        train(model, opt, 2)
        sd = model.state_dict()
        if held:
            train(model, opt, 1, start=2)
        with torch.no_grad():
            sd["layers.2.q.weight"].mul_(0.5)
            sd["layers.1.up.weight"].copy_(sd["layers.1.up.weight"] * -1)
        if not held:
            del sd
        train(model, opt, 2, start=3)
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("edited", [False, True])
def test_an_abandoned_pass_over_files_puts_the_streamed_params_back(device, tmp_path, edited):
    """step_in_backward with the state in files: a streamed param's kernel writes its host
    copy during backward. zero_grad() before step() abandons the pass; the params are then
    bit for bit those of the last completed step (or, for a param edited since, its edited
    value, followed by its master at the next step), and training on is the run that never
    had that backward."""
    def edit(model):
        sd = model.state_dict()
        sd["layers.2.q.weight"] = sd["layers.2.q.weight"] * 2
        model.load_state_dict(sd)

    runs = []
    for abandoned in (False, True):
        (tmp_path / f"s{int(abandoned)}").mkdir()
        model = make_llama(layers=6)
        offload_adam.stream_params(model, Block, prefetch=2)
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=True,
                                 state_dirs=str(tmp_path / f"s{int(abandoned)}"), **OPTS)
        train(model, opt, 2)   # the first learns the order, the second steps in backward
        if edited:
            edit(model)
        if abandoned:
            before = values(model)
            llama_loss(model, 99).backward()
            opt._engine.drain()   # the pass's kernels have run
            during = values(model)
            assert any(not torch.equal(before[k], during[k]) for k in before)
            with pytest.raises(RuntimeError, match="Nothing was stepped"):
                opt.zero_grad()
            after = values(model)
            for k in before:
                assert torch.equal(before[k], after[k]), k
            opt.zero_grad()
        train(model, opt, 2, start=2)
        runs.append((model, opt))
    assert_same_training(*runs)


class _Without:
    """The streamer's view of the device with one of its orderings removed."""

    def __init__(self, device, drop):
        self._device, self._drop = device, drop

    def __getattr__(self, name):
        if name == "publish" and self._drop == "publish":
            return lambda transfers: None
        if name == "fence" and self._drop == "fence":
            return lambda: SimEvent([], -1)
        if name == "wait_host" and self._drop == "wait_host":
            return lambda *transfers: None
        return getattr(self._device, name)


@pytest.mark.parametrize("drop", ["publish", "fence", "wait_host"])
def test_each_ordering_of_the_streamer_is_needed(kernels, drop):
    """Mutation test: without the publish of a fetch to the compute stream, the fence
    before a fetch, or the host's wait before it rewrites a host copy, the simulated
    device reports a violation."""
    sim = AsyncSimDevice(seed=0, latency="latest")
    try:
        with simulated(sim), sim.watch():
            model = make_llama(layers=4, frozen=())
            streamer = offload_adam.stream_params(model, Block, prefetch=1)
            streamer.device = _Without(sim, drop)
            opt = offload_adam.AdamW(model.parameters(), **OPTS)
            try:
                train(model, opt, 2, micro=2)
            except Exception:   # a read of a copy not landed may fail outright: also caught
                pass
        with pytest.raises(AssertionError, match="violations"):
            sim.check()
    finally:
        sim.close()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_closed_streamer_is_named_by_the_files_pass_in_backward_too(device, tmp_path,
                                                                      footprint):
    """With the state in files and step_in_backward, the pass that starts in backward
    steps the closed streamer's params too: refused by name there as at step() (it
    was an IndexError from the worker), the files left at the last step."""
    model = make_llama(layers=2, frozen=())
    streamer = offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True,
                             state_dirs=[str(tmp_path)], state_footprint=footprint, **OPTS)
    train(model, opt, 2)
    streamer.close()
    llama_loss(model, 5).backward()
    with pytest.raises(RuntimeError, match="no longer streams"):
        opt.step()
    opt.close()
    again = offload_adam.AdamW(make_llama(layers=2, frozen=()).parameters(),
                               state_dirs=[str(tmp_path)], state_footprint=footprint,
                               state_resume=True, **OPTS)
    assert again.step_count == 2
    again.close()


def test_close_puts_the_params_back_and_the_old_optimizer_refuses(device):
    model = make_llama(layers=2, frozen=())
    streamer = offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1)
    stepped = values(model)
    streamer.close()
    for name, p in model.named_parameters():
        assert torch.equal(p, stepped[name]), name   # resident again, with the stepped values
    llama_loss(model, 5).backward()
    with pytest.raises(RuntimeError, match="no longer streams"):
        opt.step()
    # Trained on resident, then closed again: nothing changes (the second close once put
    # the host copies of the first back, undoing the steps since).
    model.zero_grad()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 2, start=1)
    trained = values(model)
    streamer.close()
    for name, p in model.named_parameters():
        assert torch.equal(p, trained[name]), name
    copy.deepcopy(model)   # closed: an ordinary model again


def _streamed_beside_plain(layers):
    """A streamed model and its unstreamed twin, each with its optimizer, one step
    trained: (model, opt, plain, ref)."""
    model = make_llama(layers=layers, frozen=())
    plain = copy.deepcopy(model)
    offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    ref = offload_adam.AdamW(plain.parameters(), **OPTS)
    train(model, opt, 1)
    train(plain, ref, 1)
    return model, opt, plain, ref


def _assert_same_values(model, plain):
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_write_across_blocks_is_refused_once_naming_them_all(device):
    """model.apply(init) after stream_params writes every block's placeholders: refused at
    the first block's fetch, naming the other blocks, whose writes are dropped alike (it
    took a forward a block: found from outside); the next forward goes through and the
    model trains on as the unstreamed one."""
    model, opt, plain, ref = _streamed_beside_plain(layers=3)
    with torch.no_grad():
        for block in model.layers:
            block.up.weight.zero_()
    with pytest.raises(RuntimeError, match=r"layers\.0\.up\.weight .* written in place") as e:
        llama_loss(model, 1)
    assert "blocks ['layers.1', 'layers.2'] were written so too" in "".join(e.value.__notes__)
    model.zero_grad()
    train(model, opt, 1, start=1)
    train(plain, ref, 1, start=1)
    _assert_same_values(model, plain)


def test_an_optimizer_over_a_param_made_from_a_placeholder_says_so(device):
    """weight_norm registered after stream_params, then the optimizer built (the usual
    order of a script): its v is the block's placeholder, one NaN expanded, which the
    constructor refused as an expand() naming neither weight_norm nor stream_params (found
    from outside); the error says where such a param comes from."""
    from torch.nn.utils.parametrizations import weight_norm
    model = make_llama(layers=2, frozen=())
    offload_adam.stream_params(model, Block)
    weight_norm(model.layers[0].up)
    with pytest.raises(ValueError, match=r"has elements that share memory .* its one value is "
                                         r"NaN, as a streamed block's placeholder: .*weight_norm "
                                         r"registered after stream_params"):
        offload_adam.AdamW(model.parameters(), **OPTS)


def test_a_close_refused_for_a_dropped_write_closes_nothing(device):
    """close() after writes that did not reach the host copies (p.data.fill_ in one
    block, a parametrization registered on another's weight) refuses before any block
    goes back, naming the parametrization where there is one: it gave the other blocks
    back with their hooks on (forward failing inside, state_dict() blaming an
    assignment nobody made: found from outside). The model trains on, and close()
    again gives every param back with the trained values."""
    from torch.nn.utils import parametrize

    class Same(torch.nn.Module):
        def forward(self, x):
            return x
    model = make_llama(layers=3, frozen=())
    streamer = offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1)
    model.layers[2].up.weight.data.fill_(0.5)
    with pytest.raises(RuntimeError, match=r"layers\.2\.up\.weight .* written in place") as e:
        streamer.close()
    assert "nothing was closed" in "".join(getattr(e.value, "__notes__", []))
    assert all(b.homes for b in streamer.blocks)   # nothing given back
    train(model, opt, 1, start=1)
    trained = values(model)
    weight = model.layers[0].up.weight
    parametrize.register_parametrization(model.layers[0].up, "weight", Same())
    with pytest.raises(RuntimeError, match=r"layers\.0\.up\.weight of a streamed block was "
                                           r"parametrized after stream_params"):
        model.state_dict()
    with pytest.raises(RuntimeError, match=r"was parametrized after stream_params"):
        streamer.close()
    streamer.close()
    assert torch.equal(model.layers[0].up.parametrizations.weight.original, trained[
        "layers.0.up.weight"]) and model.layers[0].up.parametrizations.weight.original is weight
    for name, p in model.named_parameters():
        if "parametrizations" not in name:
            assert torch.equal(p, trained[name]), name


def test_an_optimizer_of_streamed_params_is_not_pickled(device, tmp_path):
    """torch.save/deepcopy of the optimizer object pickled each streamed param's
    placeholder: the copy's params were NaN, refused nowhere (found from outside). Refused
    when pickled, naming the param; the optimizer trains on as the unstreamed one."""
    model, opt, plain, ref = _streamed_beside_plain(layers=2)
    for copy_of in (copy.deepcopy, lambda o: torch.save(o, tmp_path / "opt.pt")):
        with pytest.raises(RuntimeError, match=r"param .* is streamed \(stream_params\).* "
                                               r"Save opt.state_dict\(\)"):
            copy_of(opt)
    train(model, opt, 1, start=1)
    train(plain, ref, 1, start=1)
    _assert_same_values(model, plain)


@pytest.mark.parametrize("files", [False, True], ids=["ram", "files"])
def test_a_streamer_dropped_without_close_is_collected(device, tmp_path, files):
    """A model, its streamer and optimizer dropped without close() (a notebook, a sweep)
    are collected: the host copies (or the cache's slots) unpinned, the param files' lock
    let go, so that the next streamer may use the same directory."""
    import gc
    kw = dict(param_dirs=tmp_path / "params", param_cache_mb=1) if files else {}
    before = len(device.pinned())
    for _ in range(2):
        model = make_llama(layers=4)
        streamer = offload_adam.stream_params(model, Block, prefetch=1, **kw)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 1)
        gone = weakref.ref(streamer)
        del model, streamer, opt
        gc.collect()
        assert gone() is None
        assert len(device.pinned()) == before


class _Ordered(torch.nn.Module):
    """Blocks run in the order each micro-batch asks (a LayerDrop, a reordering)."""

    def __init__(self, n=8, dim=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x, order):
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x.square().mean()


def test_blocks_run_off_the_recorded_order_are_not_fetched_ahead_half_stepped(device, tmp_path):
    """step_in_backward with the state in files: a backward that runs the blocks reversed
    prefetches, by the recorded order, a block it has stepped already, part of it (the
    files' pass stops at a bucket not complete): that fetch ahead is skipped (the block is
    not used again in it), where it raised as a block fetched twice in one backward."""
    orders = [list(range(8)), [0, 2, 4, 6], list(range(7, -1, -1))]
    runs = []
    for streamed in (False, True):
        torch.manual_seed(0)
        model = _Ordered()
        if streamed:
            offload_adam.stream_params(model, torch.nn.Linear, prefetch=1)
        (tmp_path / str(streamed)).mkdir()
        opt = offload_adam.AdamW(model.parameters(), lr=3e-3, bucket_mb=0.0005,
                                 step_in_backward=True, state_dirs=[tmp_path / str(streamed)])
        for step, order in enumerate(orders):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(4, 16, generator=g), order).backward()
            opt.step()
            opt.zero_grad()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


class _RenormBlock(torch.nn.Module):
    """A block whose forward writes its own param: nn.Embedding(max_norm=) renormalises
    the rows it looks up, in place."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 16, max_norm=0.5)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, ids):
        return x + self.lin(x + self.emb(ids))


def test_a_param_written_during_its_blocks_forward_is_refused(device):
    """The write lands in the device copy, which goes back after the forward: it would be
    lost without a word (the resident model keeps it). Refused, naming the param."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_RenormBlock() for _ in range(2)])
    offload_adam.stream_params(blocks, _RenormBlock, prefetch=1)
    ids = torch.randint(0, 8, (2, 5))
    with pytest.raises(RuntimeError, match=r"param 0\.emb\.weight of a streamed block was "
                                           r"written in place or given new memory during "
                                           r"the block's forward"):
        blocks[0](torch.randn(2, 5, 16), ids)


class _ConstrainedBlock(torch.nn.Module):
    """A max-norm constraint as some libraries write it: the weight's data replaced in
    forward (no version counter moves)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        self.lin.weight.data = torch.renorm(self.lin.weight.data, 2, 0, maxnorm=0.3)
        return x + self.lin(x)


def test_a_param_given_new_memory_during_its_blocks_forward_is_refused(device):
    """weight.data = ... in a streamed block's forward replaced the device copy, which
    the release then dropped: the constraint lost without a word (a resident model keeps
    it). Refused, naming the param, as an in-place write is."""
    blocks = torch.nn.ModuleList([_ConstrainedBlock() for _ in range(2)])
    offload_adam.stream_params(blocks, _ConstrainedBlock, prefetch=1)
    with pytest.raises(RuntimeError, match=r"param 0\.lin\.weight of a streamed block was "
                                           r"written in place or given new memory during "
                                           r"the block's forward"):
        blocks[0](torch.randn(2, 5, 16))


@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook, prepended"])
def test_a_hook_registered_after_streaming_sees_the_params(device, kind):
    """The release runs after every forward hook of the block, and the fetch before every
    forward pre-hook, those registered after stream_params too, a pre-hook with
    prepend=True also (one logging a weight's norm read the placeholder's NaN; on a GPU
    a pre-hook raced the copy): the resident model's values, from the first forward."""
    seen = {}
    for streamed in (False, True):
        model = make_llama(layers=4)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1)
        norms = seen.setdefault(streamed, [])
        for layer in model.layers:
            if kind == "forward hook":
                layer.register_forward_hook(
                    lambda mod, a, o: norms.append(mod.up.weight.float().norm()))
            else:
                layer.register_forward_pre_hook(
                    lambda mod, a: norms.append(mod.up.weight.float().norm()), prepend=True)
        for it in range(2):
            llama_loss(model, it).backward()
    assert len(seen[True]) == 8 and not any(torch.isnan(n) for n in seen[True])
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True]))


@pytest.mark.parametrize("checkpointed", [False, "reentrant", "non-reentrant"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_backward_pre_hook_sees_the_params(device, checkpointed, prefetch):
    """A full backward pre-hook of a block runs before the grads reach the block's
    outputs, where its fetch for backward starts: it read the placeholder's NaN (and on
    a GPU raced the copy). Such hooks, registered before stream_params (block 1) or
    after (the others), fetch first: the values the resident model's see, and the
    training bit for bit as resident."""
    seen, runs = {}, []
    for streamed in (False, True):
        model = make_llama(layers=4, checkpointed=checkpointed)
        norms = seen.setdefault(streamed, [])

        def hook(mod, grad_output):
            norms.append(mod.up.weight.float().norm())
        model.layers[1].register_full_backward_pre_hook(hook)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=prefetch)
        for layer in (model.layers[0], model.layers[2], model.layers[3]):
            layer.register_full_backward_pre_hook(hook)
        model.layers[2].register_full_backward_pre_hook(hook)   # two on one block
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2, micro=2)
        runs.append((model, opt))
    assert len(seen[True]) == 2 * 2 * 5 and not any(torch.isnan(n) for n in seen[True])
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True]))
    assert_same_training(*runs)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_global_module_hook_sees_the_params(device, kind, when):
    """A global module pre-hook (torch.nn.modules.module.register_module_forward_pre_hook,
    ..._full_backward_pre_hook) runs before any module's own, so before a streamed block's
    fetch: one reading a block's weight read the placeholder's NaN. While there is one,
    the streamer's runs first (registered before stream_params or after): the resident
    model's values, training bit for bit as resident; removed, the streamer's goes too
    (a global backward pre-hook puts every module of the process under BackwardHook)."""
    from torch.nn.modules import module as nn_module
    register = {"forward": nn_module.register_module_forward_pre_hook,
                "backward": nn_module.register_module_full_backward_pre_hook}[kind]
    hooks = getattr(nn_module, f"_global_{kind}_pre_hooks")
    seen, runs = {}, []
    for streamed in (False, True):
        model = make_llama(layers=4, checkpointed=kind == "backward")
        norms = seen.setdefault(streamed, [])

        def hook(mod, arg):
            if isinstance(mod, Block):
                norms.append(mod.up.weight.float().norm())
        handle = register(hook) if when == "before" else None
        try:
            if streamed:
                streamer = offload_adam.stream_params(model, Block, prefetch=1)
            if handle is None:
                handle = register(hook)
            opt = offload_adam.AdamW(model.parameters(), **OPTS)
            train(model, opt, 2, micro=2)
            if streamed:
                assert len(hooks) == 2 and next(iter(hooks)) != handle.id
        finally:
            handle.remove()
        if streamed:
            llama_loss(model, 9)   # (a forward: the streamer's hook goes with the user's)
            assert not hooks
            assert not any(torch.isnan(n) for n in norms)
            streamer.close()
        runs.append((model, opt))
    assert len(seen[True]) == 4 * 2 * 2   # (blocks x steps x micro-batches)
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True]))
    assert_same_training(*runs)


@pytest.mark.parametrize("how", ["deepcopy", "deepcopy a block", "copy", "torch.save",
                                 "load assign=True", "load a block assign=True",
                                 "load a submodule assign=True"])
def test_a_copy_or_an_assigning_load_is_refused_and_changes_nothing(device, how, tmp_path):
    """A copy (or pickle) of a module holding streamed params would hold their NaN
    placeholders and the original's hooks: it computed NaN while its state_dict() showed
    the original's values. load_state_dict(assign=True) put the loaded tensors in place of
    the streamed params (resident, the streamer and optimizer stepping the old ones,
    state_dict() showing the old values). Both are refused; training goes on as resident."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=4)
        opt = None
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 1)
        if streamed:
            other = make_llama(seed=5, layers=4)
            params = dict(model.named_parameters())
            act = {"deepcopy": lambda: copy.deepcopy(model),
                   "deepcopy a block": lambda: copy.deepcopy(model.layers[2]),
                   "copy": lambda: copy.copy(model),
                   "torch.save": lambda: torch.save(model, tmp_path / "m.pt"),
                   "load assign=True": lambda: model.load_state_dict(other.state_dict(),
                                                                     assign=True),
                   "load a block assign=True": lambda: model.layers[1].load_state_dict(
                       other.layers[1].state_dict(), assign=True),
                   "load a submodule assign=True": lambda: model.layers[1].up.load_state_dict(
                       other.layers[1].up.state_dict(), assign=True)}[how]
            match = "assign=True" if how.startswith("load") else "cannot be copied or pickled"
            with pytest.raises(RuntimeError, match=match):
                act()
            assert dict(model.named_parameters()) == params   # the same Parameters
            # (a refused load leaves no block loading: a load after a forward works)
            with torch.no_grad():
                llama_loss(model, 0)
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
            copy.deepcopy(model.embed)   # a module without streamed params copies as ever
        train(model, opt, 2, start=1)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_an_assigning_load_of_other_params_goes_through(device):
    """load_state_dict(assign=True) of a dict holding no streamed param (an adapter added
    after stream_params, as peft's PeftModel.from_pretrained(low_cpu_mem_usage=True)
    loads one) is the model's as with torch; with a streamed param in it as well, refused
    before anything is loaded. (Found from outside: every assigning load was refused.)"""
    model = make_llama(layers=4)
    offload_adam.stream_params(model, Block, prefetch=1)
    up = model.layers[1].up
    up.adapter = torch.nn.Parameter(torch.zeros(3))   # resident: added after streaming
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mixed = {"layers.1.up.adapter": torch.full((3,), 2.0),
             "layers.1.up.weight": torch.ones_like(up.weight)}
    for target, prefix in ((model, "layers.1.up."), (model.layers[1], "up."), (up, "")):
        with pytest.raises(RuntimeError, match="assign=True"):
            target.load_state_dict({prefix + k.rpartition(".")[2]: v for k, v in mixed.items()},
                                   strict=False, assign=True)
        assert torch.equal(up.adapter, torch.zeros(3))
    loaded = torch.ones(3)
    model.load_state_dict({"layers.1.up.adapter": loaded}, strict=False, assign=True)
    assert up.adapter is not None and torch.equal(up.adapter, loaded)
    up.load_state_dict({"adapter": loaded + 1}, strict=False, assign=True)
    assert torch.equal(up.adapter, loaded + 1)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if "adapter" not in k)
    with torch.no_grad():
        assert torch.isfinite(llama_loss(model, 0))


class Twice(TinyLlama):
    """Block 2 runs twice in each forward (weights shared across depth); `Outside`: each
    block's input is used outside it too (a residual around the block)."""
    twice, outside = (2,), 0.0

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x) + x * self.outside if self.outside else layer(x)
            if i in self.twice:
                x = layer(x)
        return self.head(self.norm(x))


class Outside(Twice):
    twice, outside = (), 0.5


def _model(cls, layers, streamed):
    """cls's bf16 model of `layers` blocks (seed 0), its blocks streamed or not."""
    torch.manual_seed(0)
    model = cls(layers=layers).to(BF16)
    if streamed:
        offload_adam.stream_params(model, Block, prefetch=1)
    return model


def test_a_block_called_twice_per_forward_is_fetched_for_each_use(device):
    runs = []
    for streamed in (False, True):
        model = _model(Twice, 5, streamed)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 3, micro=2)
        runs.append((model, opt))
    assert_same_training(*runs)


class Listed(TinyLlama):
    """One block registered twice in the layer list (ALBERT's shared layer): layers.1
    and layers.2 are the same module, its params named under both."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.layers = torch.nn.ModuleList([self.layers[0], self.layers[1], self.layers[1],
                                           *self.layers[2:]])


@pytest.mark.parametrize("blocks", ["class", "names"])
def test_a_block_registered_twice_is_one_block(device, blocks):
    """Its params' second names are not tied weights with the rest: it streams as one
    block, named by either registration, and trains as resident."""
    runs = []
    for streamed in (False, True):
        torch.manual_seed(0)
        model = Listed(layers=4).to(BF16)
        if streamed:
            spec = Block if blocks == "class" else ["layers.0", "layers.2", "layers.3",
                                                     "layers.4"]
            streamer = offload_adam.stream_params(model, spec, prefetch=1)
            assert len(streamer.blocks) == 4
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 3)
        runs.append((model, opt))
    assert_same_training(*runs)


class TwiceCheckpointed(TinyLlama):
    """Block 1 runs twice in each forward, each time under reentrant checkpointing: its
    recompute in backward fetches it again after the first use's grads came."""

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            for _ in range(2 if i == 1 else 1):
                x = checkpoint(layer, x, use_reentrant=True) if i == 1 else layer(x)
        return self.head(self.norm(x))


def test_a_block_fetched_again_in_backward_after_its_early_step_is_named(device):
    """step_in_backward: a block whose grads come in parts (run twice per forward, each
    recomputed in backward) cannot be stepped in backward; the refusal says so, not that
    the block was read between backward and step()."""
    model = _model(TwiceCheckpointed, 4, streamed=True)
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS)
    with pytest.raises(RuntimeError, match=r"block 'layers.1' is fetched again in this "
                                           r"backward .* step_in_backward=False"):
        train(model, opt, 3)


class RoutedBlock(Block):
    """Block whose run goes through its attention only when `attention_only` (as a
    mixture-of-experts block routed to no expert of its MLP)."""
    attention_only = False

    def forward(self, x):
        if not self.attention_only:
            return super().forward(x)
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


class TwiceRouted(TinyLlama):
    """Block 1 runs twice in each forward, the first time through its attention only: its
    MLP's grads are whole once the second run's backward is through, before the first
    run's is."""

    def __init__(self, **kw):
        super().__init__(block=RoutedBlock, **kw)

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            if i == 1:
                layer.attention_only = True
                x = layer(x)
                layer.attention_only = False
            x = layer(x)
        return self.head(self.norm(x))


def test_a_block_run_twice_on_other_params_each_time(device):
    """Trained as resident with the step at step(); with step_in_backward the MLP's step
    may write the block before its first run's backward fetches it again (as the worker's
    timing has it): then refused, naming the case (found from outside, with an MoE
    block routed to other experts per call), else trained as resident: never a block
    read half stepped."""
    runs = []
    for streamed in (False, True):
        model = _model(TwiceRouted, 4, streamed)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2)
        runs.append((model, opt))
    assert_same_training(*runs)
    model = _model(TwiceRouted, 4, streamed=True)
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS)
    try:
        train(model, opt, 2)
    except RuntimeError as e:
        assert re.search(r"block 'layers.1' is fetched again in this backward .*a "
                         r"mixture-of-experts block routed to other experts.*"
                         r"step_in_backward=False", str(e), re.S), e
    else:
        assert_same_training(runs[0], (model, opt))


@pytest.mark.parametrize("grad_off", ["no_grad", "inference_mode"])
def test_inference_between_steps_gives_the_resident_outputs_and_changes_no_training(device, grad_off):
    """eval() under no_grad or inference_mode between steps: the resident model's logits,
    and training goes on as if it had not run. (inference_mode dispatches `p.data = t`'s
    metadata check, which the simulated device once took for a read of a copy in flight.)"""
    off = torch.no_grad if grad_off == "no_grad" else torch.inference_mode
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(4))
    runs, logits = [], []
    for streamed in (False, True):
        model = make_llama(layers=6)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=2)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        out = []
        for it in range(3):
            train(model, opt, 1, start=it)
            model.eval()
            with off():
                out.append(model(tokens).float())
            model.train()
        runs.append((model, opt))
        logits.append(out)
    for a, b in zip(*logits):
        assert torch.equal(a, b)
    assert_same_training(*runs)


@pytest.mark.parametrize("files", [False, True], ids=["ram", "param-files"])
@pytest.mark.parametrize("prefetch", [2, 3])
def test_a_forward_without_grad_leaves_no_block_on_the_device(device, tmp_path, prefetch, files):
    """An eval forward between steps fetches ahead only the forward's own uses: the
    recorded order's next uses after the last block are backward's, and none comes, so
    they stayed on the device (prefetch - 1 blocks) until the next forward (found from
    outside)."""
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(4))
    model = make_llama(layers=6)
    offload_adam.stream_params(model, Block, prefetch=prefetch,
                               **({"param_dirs": tmp_path / "p"} if files else {}))
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 2)
    assert device.counters()["materialized_bytes"] == 0
    for _ in range(2):
        with torch.no_grad():
            model(tokens)
        assert device.counters()["materialized_bytes"] == 0
    train(model, opt, 1, start=2)
    assert device.counters()["materialized_bytes"] == 0


@pytest.mark.parametrize("convert", ["float", "half", "cpu-dtype", "double", "inner"])
def test_a_conversion_of_the_streamed_params_is_refused_and_changes_nothing(device, convert):
    """model.to(dtype) and the like would replace a streamed param's placeholder with a
    tensor of NaNs: refused with a clear error before any param changed; a .to() that
    changes nothing of them goes through."""
    model = make_llama(layers=2, frozen=())
    offload_adam.stream_params(model, Block)
    before = values(model)
    with pytest.raises(RuntimeError, match=r"stream_params: .* would change the streamed "
                                           r"params of block layers\.\d"):
        {"float": lambda: model.float(), "half": lambda: model.layers.half(),
         "cpu-dtype": lambda: model.to("cpu", torch.float32),
         "double": lambda: model.layers[1].double(),
         "inner": lambda: model.layers[1].up.half()}[convert]()   # a submodule of a block
    after = values(model)
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    model.to(BF16)   # nothing of the streamed params changes: allowed
    model.bfloat16()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1)


def test_a_model_built_on_meta_streams_then_loads_its_weights(device):
    """A model too large to build anywhere in full: built on the meta device, streamed
    (the host copies and the resident params start as NaN), then its weights loaded: the
    same training as the model built with them."""
    runs = []
    for meta in (False, True):
        weights = make_llama(layers=4, frozen=())
        if meta:
            with torch.device("meta"):
                model = TinyLlama(layers=4).to(BF16)
            offload_adam.stream_params(model, Block)
            assert all(torch.isnan(v).all() for v in values(model).values())
            model.load_state_dict(weights.state_dict())
        else:
            model = weights
            offload_adam.stream_params(model, Block)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2, micro=2)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_the_bytes_benchmark_reports_what_the_design_says(kernels, tmp_path):
    """bench/stream_sim.py (the bytes per link on the simulated device), small: its
    numbers are the ones the tests above assert."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "stream_sim.py"), "--layers", "3",
                    "--width", "64", "--micro", "2", "--prefetch", "1", "--out", str(tmp_path),
                    "--tag", "t"], check=True, cwd=root, capture_output=True, timeout=600)
    resident, streamed = json.loads((tmp_path / "stream_sim_t.json").read_text())["rows"]
    assert resident["h2d_params_bytes"] == 0 and resident["streamed_bytes"] == 0
    assert streamed["h2d_params_bytes"] == 2 * 2 * streamed["streamed_bytes"] > 0
    assert streamed["h2d_step_bytes"] == resident["h2d_step_bytes"] - streamed["streamed_bytes"]
    assert 0 < streamed["device_peak_bytes"] <= streamed["peak_bound_bytes"]
    assert streamed["d2h_bytes"] == resident["d2h_bytes"]


def test_reentrant_checkpointing_streams_and_releases_every_block(device):
    """torch.utils.checkpoint with use_reentrant=True: the forward runs without grad and
    the recompute's graph is backpropagated on its own. Bit for bit the resident
    training, each block fetched for the forward and the recompute, none left on the
    device after a step (they were, and then computed with the values of the step
    before)."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=6, checkpointed="reentrant")
        if streamed:
            streamer = offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 1, micro=2)
        if streamed:
            before = device.counters()["h2d_bytes"]
        train(model, opt, 2, micro=2, start=1)
        if streamed:
            resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                           if not n.startswith("layers."))
            assert device.counters()["h2d_bytes"] - before == 2 * (
                2 * 2 * streamer.streamed_bytes + resident)
            assert all(b.state == "away" for b in streamer.blocks)
            assert device.counters()["materialized_bytes"] == 0
        runs.append((model, opt))
    assert_same_training(*runs)


def test_a_block_left_on_the_device_over_a_step_is_fetched_again(device):
    """Whatever leaves a block's params on the device when the step rewrites its host
    copies (a path not foreseen), its next use fetches them again: never the values of
    the step before."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=4, frozen=())
        if streamed:
            streamer = offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 1, micro=1)
        llama_loss(model, 10).backward()
        if streamed:
            streamer._use(streamer.blocks[1], "f")   # left there over the step
            assert streamer.blocks[1].state == "here"
        opt.step()
        opt.zero_grad()
        train(model, opt, 2, micro=1, start=2)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_grad_scaler_with_fp16_streamed_params(device):
    """fp16 params streamed, GradScaler with a step that overflows (skipped, the scale
    lowered): bit for bit the resident training, the same scales."""
    runs, scales = [], []
    for streamed in (False, True):
        torch.manual_seed(0)
        model = TinyLlama(layers=4).to(torch.float16)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        seen = []
        for it in range(4):
            loss = llama_loss(model, it) * (1e30 if it == 1 else 1.0)   # step 1: inf grads
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            seen.append(scaler.get_scale())
        runs.append((model, opt))
        scales.append(seen)
    assert scales[0] == scales[1] and scales[0][1] < scales[0][0]
    assert_same_training(*runs)


def test_a_fetch_during_another_threads_settle_keeps_its_copies():
    """Block.settle waits for the copies it saw and forgets only those: copies that a
    fetch on another thread set meanwhile are still waited for by the next settle (else
    the host could rewrite memory a copy to the device still reads)."""
    from offload_adam.param_stream import _Block
    waited = []

    class Device:
        def wait_host(self, *copies):
            waited.extend(copies)
            if copies == ("old",):   # another thread's fetch lands while this one waits
                block.set_copies(["new"])

    class Streamer:
        device = Device()

    block = _Block(Streamer(), 0, "b", torch.nn.Linear(1, 1), [])
    block.set_copies(["old"])
    block.settle()
    assert waited == ["old"] and block.copies == ["new"]
    block.settle()
    assert waited == ["old", "new"] and block.copies == []


def test_a_streamed_param_replaced_or_tied_after_streaming_is_refused(device):
    """The streamer and the optimizer hold the params streamed at setup: one replaced
    afterwards (assigned, or tied to another block's) would compute with values they know
    nothing of, and the model's state_dict() would show the old host copy: the next use,
    state_dict() and load_state_dict() refuse it, naming the param."""
    for how in ("replaced", "tied"):
        model = make_llama(layers=3, frozen=())
        offload_adam.stream_params(model, Block)
        if how == "replaced":
            model.layers[2].up.weight = torch.nn.Parameter(torch.zeros(64, 32, dtype=BF16))
        else:
            model.layers[2].up.weight = model.layers[0].up.weight
        with pytest.raises(RuntimeError, match=r"param layers\.2\.up\.weight of a streamed "
                                               r"block was replaced after stream_params"):
            llama_loss(model, 0)
        with pytest.raises(RuntimeError, match=r"layers\.2\.up\.weight .*was replaced"):
            model.state_dict()
        with pytest.raises(RuntimeError, match=r"layers\.2\.up\.weight .*was replaced"):
            model.layers[2].load_state_dict(make_llama(layers=3, frozen=()).layers[2].state_dict())


def test_a_streamer_dropped_mid_forward_unpins_after_its_copies(device):
    """A forward refused partway leaves the read-ahead's copies in flight; a streamer
    then dropped without close() unpins its host copies when collected: only after
    those copies ran (the device synchronized first; the simulated device's check, at
    the end of the test, sees a buffer unpinned under a copy)."""
    for seed in range(4):
        torch.manual_seed(seed)
        model = make_llama(layers=6, frozen=())
        offload_adam.stream_params(model, Block, prefetch=3)
        model.layers[4].up.weight = torch.nn.Parameter(torch.zeros(64, 32, dtype=BF16))
        with pytest.raises(RuntimeError, match=r"layers\.4\.up\.weight .*was replaced"):
            llama_loss(model, 0)
        del model
        gc.collect()


def test_a_blocks_submodule_used_outside_the_block_is_refused(device):
    """A submodule of a streamed block has its params on the device only while the block
    runs: called from elsewhere (the model's forward reusing it, or directly) it would
    compute with the NaN placeholders; refused, naming it, with grads on or off."""
    class Reuse(TinyLlama):
        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.layers[0].mlp_norm(x))   # block 0's norm reused at the end

    torch.manual_seed(0)
    model = Reuse(layers=2).to(BF16)
    offload_adam.stream_params(model, Block)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(
                RuntimeError, match=r"layers\.0\.mlp_norm \(RMSNorm\) was called outside the "
                                    r"forward and backward of its streamed block layers\.0"):
            llama_loss(model, 0)
    with pytest.raises(RuntimeError, match=r"layers\.1\.up \(Linear\) was called outside"):
        model.layers[1].up(torch.ones(2, 32, dtype=BF16))
    model.forward = TinyLlama.forward.__get__(model)   # the block's own use works as before
    assert torch.isfinite(llama_loss(model, 0))


def test_a_container_or_an_unknown_name_as_block_is_refused(device):
    """A ModuleList is never called itself: its hooks would never fetch, and every use
    of its params would read NaN. A name that matches nothing is a typo."""
    model = make_llama(layers=3, frozen=())
    with pytest.raises(ValueError, match=r"block layers \(ModuleList\) is never called itself"):
        offload_adam.stream_params(model, ["layers"])
    with pytest.raises(ValueError, match=r"does not have: \['layer\.2'\]"):
        offload_adam.stream_params(model, ["layers.0", "layers.1", "layer.2"])
    with pytest.raises(ValueError, match=r"does not have: \['layer'\]"):
        offload_adam.stream_params(model, "layer")
    with pytest.raises(ValueError, match=r"does not have: \['layr\.1'\]"):
        offload_adam.stream_params(model, ("layers.0", "layr.1"))
    for spec, what in ((None, "must be a module class"), (42, "must be a module class"),
                       ([Block, "layers.0"], "must be a module class"),
                       (model.layers[0], r"got a module \(Block\), not a spec")):
        with pytest.raises(TypeError, match=what):   # (a module is callable: not a predicate)
            offload_adam.stream_params(model, spec)
    offload_adam.stream_params(model, ["layers.0", "layers.1", "layers.2"])   # unchanged


def test_blocks_given_as_modules_are_those_modules(device):
    """blocks= as the modules themselves, as FSDP2 users name what they shard: a
    ModuleList (model.layers: each child a block), a list of modules, names mixed in.
    A module of another model, or the model itself, is refused by name."""
    for spec, want in ((lambda m: m.layers, ["layers.0", "layers.1", "layers.2"]),
                       (lambda m: [m.layers[2], m.layers[0]], ["layers.0", "layers.2"]),
                       (lambda m: (m.layers[1], "layers.2"), ["layers.1", "layers.2"])):
        model = make_llama(layers=3, frozen=())
        streamer = offload_adam.stream_params(model, spec(model))
        assert sorted(b.name for b in streamer.blocks) == want
        streamed = {id(p) for b in streamer.blocks for p in b.params}
        for name, p in model.named_parameters():
            inside = any(name.startswith(w + ".") for w in want)
            assert (id(p) in streamed) == inside, name
        streamer.close()
    model = make_llama(layers=3, frozen=())
    with pytest.raises(ValueError, match=r"lists a module \(Block\) that is not in the model"):
        offload_adam.stream_params(model, [make_llama(layers=1, frozen=()).layers[0]])
    with pytest.raises(ValueError, match=r"that is the model itself"):
        offload_adam.stream_params(model, [model])
    with pytest.raises(TypeError, match=r"lists 3, neither a module nor a module name"):
        offload_adam.stream_params(model, [model.layers[0], 3])
    assert all(p.numel() and not torch.isnan(p).any() for p in model.parameters())


def test_a_submodules_state_dict_and_params_tied_inside_a_block_show_the_host_copies(device):
    """state_dict()/load_state_dict() of a submodule inside a block (block.up) go through
    the host copies as the model's and the block's do; so does a param tied inside a
    block, under each of its names."""
    model = make_llama(layers=2, frozen=())
    model.layers[1].k.weight = model.layers[1].q.weight   # tied inside one block
    plain = copy.deepcopy(model)
    offload_adam.stream_params(model, Block)
    for k, v in plain.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for k, v in plain.layers[0].up.state_dict().items():
        assert torch.equal(model.layers[0].up.state_dict()[k], v), k
    other = make_llama(seed=1, layers=2, frozen=())
    model.layers[0].up.load_state_dict(other.layers[0].up.state_dict())
    model.layers[0].load_state_dict(model.layers[0].state_dict())   # nested hooks: once
    plain.layers[0].up.load_state_dict(other.layers[0].up.state_dict())
    assert torch.equal(model.state_dict()["layers.0.up.weight"], other.layers[0].up.weight)
    assert torch.isnan(model.layers[0].up.weight).all()   # streamed again
    torch.testing.assert_close(llama_loss(model, 3), llama_loss(plain, 3), rtol=0, atol=0)


def _trained_twins(steps):
    """A 3-block Llama streamed and its unstreamed twin, each with its optimizer,
    trained `steps` steps: (model, plain, opt, ref)."""
    model = make_llama(layers=3, frozen=())
    plain = copy.deepcopy(model)
    offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    ref = offload_adam.AdamW(plain.parameters(), **OPTS)
    train(model, opt, steps)
    train(plain, ref, steps)
    return model, plain, opt, ref


def test_an_in_place_write_to_a_streamed_param_between_uses_is_refused(device):
    """Between uses a streamed param shows a one-element placeholder: p.zero_() or
    nn.init on it writes there, not into its values, and was dropped without a word. Its
    next use (or state_dict, load_state_dict) raises instead, once; the optimizer's own
    steps are no such write, nor is loading a state dict."""
    model, plain, opt, ref = _trained_twins(2)
    model.load_state_dict(model.state_dict())   # a load is a write the streamer makes
    for how, write in [("forward", lambda: llama_loss(model, 5)),
                       ("state_dict", lambda: model.state_dict()),
                       ("load", lambda: model.layers[1].load_state_dict(plain.layers[1].state_dict()))]:
        with torch.no_grad():
            torch.nn.init.zeros_(model.layers[1].up.weight)
        with pytest.raises(RuntimeError, match=r"param layers\.1\.up\.weight of a streamed "
                                               r"block was written in place between its uses"):
            write()
        assert torch.isnan(model.layers[1].up.weight).all(), how   # the placeholder again
    train(model, opt, 1, start=2)   # raised once: training goes on from the host copies
    train(plain, ref, 1, start=2)
    assert_same_training((model, opt), (plain, ref))


class _RaiseInBackward(torch.autograd.Function):
    """The identity, whose backward raises."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("raised in backward")


@pytest.mark.parametrize("when", ["first backward", "later backward"])
def test_a_backward_that_raised_leaves_no_block_on_the_device(device, when):
    """A backward that raises part way (a custom Function's backward inside block 4) runs
    none of autograd's end-of-backward callbacks: the blocks it had fetched (block 4, those
    ahead of it) stayed on the device into the next micro-batch, beyond (k + 2) x the
    largest block. They are given back at the next forward; each micro-batch then moves the
    streamed bytes twice, and training is the resident training with the same failed
    backward, bit for bit. Raised in the first backward too, while the order is recorded."""
    prefetch, failing = 2, []
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=6)
        if streamed:
            streamer = offload_adam.stream_params(model, Block, prefetch=prefetch)
        model.layers[4].mlp_norm.register_forward_hook(
            lambda m, args, out: _RaiseInBackward.apply(out) if failing else out)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        if when == "later backward":
            train(model, opt, 1)
        failing.append(True)
        with pytest.raises(ValueError, match="raised in backward"):
            llama_loss(model, 7).backward()
        failing.clear()
        opt.zero_grad()
        if streamed:
            assert device.counters()["materialized_bytes"] > 0   # (what this test is about)
        _train_on_after_a_raise(device, model, opt, streamer if streamed else None, prefetch)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_a_checkpoint_loads_after_a_backward_that_raised(device):
    """A backward that raised inside block 4 (a Ctrl-C, an out-of-memory error) left the
    blocks it fetched showing as computing until a forward ran: model.load_state_dict(),
    the way back to a checkpoint (HF Trainer's resume in the same process), was refused
    as a load from the block's own hooks (found from outside). Loaded now, the values are
    the checkpoint's, no block stays on the device, and training goes on as the resident
    model's loaded from the same checkpoint, bit for bit."""
    runs, failing = [], []
    for streamed in (False, True):
        model = make_llama(layers=6)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=2)
        model.layers[4].mlp_norm.register_forward_hook(
            lambda m, args, out: _RaiseInBackward.apply(out) if failing else out)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        opt_saved = opt.state_dict()
        train(model, opt, 1, start=1)
        failing.append(True)
        with pytest.raises(ValueError, match="raised in backward"):
            llama_loss(model, 7).backward()
        failing.clear()
        opt.zero_grad()
        model.load_state_dict(saved)
        opt.load_state_dict(opt_saved)
        if streamed:
            assert device.counters()["materialized_bytes"] == 0
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), k
        train(model, opt, 2, start=1)
        runs.append((model, opt))
    assert_same_training(*runs)


def _train_on_after_a_raise(device, model, opt, streamer, prefetch):
    """Three steps of two micro-batches after a forward or backward of make_llama(layers=6)
    that raised; `streamer` (None: resident), then: the first step's micro-batches move
    the streamed bytes twice each, within (k + 2) x the largest block on the device, and
    leave none there; the order prefetch follows is a whole micro-batch's."""
    if streamer is not None:
        device.reset_peak()
        before = device.counters()["h2d_bytes"]
    train(model, opt, 1, micro=2, start=1)
    if streamer is not None:
        after = device.counters()
        assert after["materialized_bytes"] == 0
        assert after["peak_materialized_bytes"] <= (prefetch + 2) * streamer.largest_block_bytes
        resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if not n.startswith("layers."))
        assert after["h2d_bytes"] - before == 2 * 2 * streamer.streamed_bytes + resident
        forward, backward = [(i, "f") for i in range(6)], [(i, "b") for i in range(6)]
        assert streamer._order == forward + backward[::-1]
    train(model, opt, 2, micro=2, start=2)


@pytest.mark.parametrize("when", ["first forward", "later forward"])
def test_a_forward_that_raised_leaves_no_block_on_the_device(device, when):
    """A forward that raises in block 3 (an out-of-memory error, caught to retry with a
    smaller batch) ran no forward hook of the block: it and the blocks fetched ahead of it
    stayed on the device until their next use, in the way of the retry. They go back as
    it raises; the retry moves the streamed bytes twice per micro-batch within (k + 2) x
    the largest block, the order prefetch follows is a whole micro-batch's, and training
    is the resident one's, bit for bit."""
    prefetch, failing = 2, []
    runs = []

    def boom(m, args, out):
        if failing:
            raise torch.OutOfMemoryError("raised in forward")
        return out

    for streamed in (False, True):
        model = make_llama(layers=6)
        if streamed:
            streamer = offload_adam.stream_params(model, Block, prefetch=prefetch)
        model.layers[3].mlp_norm.register_forward_hook(boom)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        if when == "later forward":
            train(model, opt, 1)
        failing.append(True)
        with pytest.raises(torch.OutOfMemoryError, match="raised in forward"):
            llama_loss(model, 7)
        failing.clear()
        if streamed:
            assert device.counters()["materialized_bytes"] == 0
        _train_on_after_a_raise(device, model, opt, streamer if streamed else None, prefetch)
        runs.append((model, opt))
    assert_same_training(*runs)


class PermutedBlock(Block):
    """A block whose output's features are permuted by an index table held as a param
    (an integer param: it can take no grad)."""

    def __init__(self, dim, hidden):
        super().__init__(dim, hidden)
        self.perm = torch.nn.Parameter(torch.randperm(dim), requires_grad=False)

    def forward(self, x):
        return super().forward(x)[..., self.perm]


def test_an_integer_param_of_a_block_stays_resident(device):
    """An integer param in a streamed block has no grad and no state: it stays resident
    (streamed, it read as zeros between uses, and a read of it outside the block's forward
    was wrong without a word). Reading it, the model's state_dict, load_state_dict, to()
    and training are as without streaming, bit for bit."""
    runs = []
    for streamed in (False, True):
        torch.manual_seed(0)
        model = TinyLlama(layers=4, block=PermutedBlock).to(BF16)
        perm = model.layers[1].perm.clone()
        if streamed:
            streamer = offload_adam.stream_params(model, PermutedBlock, prefetch=1)
            assert torch.isnan(model.layers[1].up.weight).all()   # the rest of it streams
            assert streamer.streamed_bytes == sum(p.numel() * p.element_size() for n, p in
                                                  model.named_parameters()
                                                  if n.startswith("layers.") and "perm" not in n)
        assert torch.equal(model.layers[1].perm, perm)
        opt = offload_adam.AdamW([p for p in model.parameters() if p.requires_grad], **OPTS)
        train(model, opt, 2, micro=2)
        assert torch.equal(model.layers[1].perm, perm)
        assert torch.equal(model.state_dict()["layers.1.perm"], perm)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        sd["layers.1.perm"] = perm.flip(0)
        model.load_state_dict(sd)
        assert torch.equal(model.layers[1].perm, perm.flip(0))
        model.to(BF16)
        assert model.layers[1].perm.dtype is torch.int64
        train(model, opt, 2, micro=2, start=2)
        runs.append((model, opt))
    assert_same_training(*runs)


# (a write in progress is waited for by the same count whatever the store: "writing" with
# files would repeat the RAM case; the files' queued jobs are their own)
@pytest.mark.parametrize("store, hold", [("ram", "writing"), ("ram", "queued"), ("files", "queued")])
@pytest.mark.parametrize("read", ["forward", "state_dict"])
def test_reads_between_backward_and_step_wait_for_a_step_writing_the_block(device, monkeypatch,
                                                                          tmp_path, read, hold,
                                                                          store):
    """step_in_backward: block 0's CPU step (on the engine's worker) is writing its host
    copies ("writing"), or the second of the two steps that write them (its params are
    in two buckets) is queued ("queued"), when an inference forward, or
    model.state_dict(), reads them after backward. The reads once went on meanwhile and
    saw the block half stepped; they wait for the steps now (Home.before_write's count,
    the engine's `defer` of each queued step: with the state in files, of each queued
    job of the files' pass): the forward computes with the stepped block (as once the
    steps are all done), the state dict shows its stepped values, and training goes on
    as the run without these reads."""
    import threading
    import time

    from offload_adam.engine.core import BucketJob
    from offload_adam.param_stream import Home
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(4))
    armed, started, reading = [], threading.Event(), threading.Event()

    def held():   # the worker held until the read (which, without its wait, is done by then)
        armed.clear()
        started.set()
        reading.wait(5)
        time.sleep(0.1)

    before_write = Home.before_write

    def held_write(self, ranges=None):   # block 0's last write (its attn_norm's: that
        claimed = before_write(self, ranges)   # one's job is the last of the two)
        if armed and hold == "writing" and self.block.index == 0 and self.k == 0:
            held()
        return claimed

    kernel, jobs = BucketJob.kernel, []

    def held_kernel(self):   # the second job writing block 0, before it writes
        if armed and hold == "queued" and any(
                p.rec.home is not None and p.rec.home.block.index == 0 for p in self.pieces):
            jobs.append(self)
            if len(jobs) == 2:
                held()
        kernel(self)

    monkeypatch.setattr(Home, "before_write", held_write)
    monkeypatch.setattr(BucketJob, "kernel", held_kernel)
    runs = []
    for read in (None, read):
        model = make_llama(layers=4)
        offload_adam.stream_params(model, Block, prefetch=1)
        kw = {}
        if store == "files":
            (tmp_path / f"s{read}").mkdir()
            kw["state_dirs"] = str(tmp_path / f"s{read}")
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS, **kw)
        train(model, opt, 2)   # from the second step on, stepped in backward
        if read is not None:
            started.clear()
            reading.clear()
            jobs.clear()
            armed.append(True)
        llama_loss(model, 50).backward()
        if read is not None:
            assert started.wait(5)
            reading.set()
            if read == "forward":
                with torch.no_grad():
                    seen = model(tokens)
                opt._engine.drain()   # every step of the pass done
                with torch.no_grad():
                    assert torch.equal(seen, model(tokens))   # the stepped block 0 in both
            else:
                seen = values(model)
        opt.step()
        opt.zero_grad()
        if read == "state_dict":
            now = values(model)
            for k in now:
                if k.startswith("layers.0."):
                    assert torch.equal(seen[k], now[k]), k   # the stepped values
        train(model, opt, 1, start=3)
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("store", ["ram", "files"])
def test_a_block_left_half_stepped_until_step_is_not_read(device, tmp_path, store):
    """step_in_backward: a param that gets no grad in a backward holds its bucket (in
    RAM, in the first backward, which expects every param's; in files, every backward)
    and, in files, the pass behind it, for step(); a block with params stepped in
    backward and others waiting there would be seen half stepped between backward and
    step(): an inference forward or model.state_dict() then raises, naming it, and
    step() trains on as the run without the read."""
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(4))
    runs = []
    for read in (None, "forward", "state_dict"):
        model = make_llama(layers=6)
        streamer = offload_adam.stream_params(model, Block, prefetch=1)
        kw = {}
        if store == "files":
            (tmp_path / f"s{read}").mkdir()
            kw["state_dirs"] = str(tmp_path / f"s{read}")
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS, **kw)
        if store == "files":
            train(model, opt, 1)   # (the files' pass steps in backward from the second on)
        model.layers[2].up.weight.requires_grad_(False)   # no grad in this backward
        before = [[h.clone() for h in b.homes] for b in streamer.blocks]
        llama_loss(model, 50).backward()
        opt._engine.drain()   # every step started in backward done
        # which blocks the steps left half: some params with a grad stepped, some not
        half = []
        for b, olds in zip(streamer.blocks, before):
            moved = {not torch.equal(h, o)
                     for p, h, o in zip(b.params, b.homes, olds) if p.grad is not None}
            if moved == {True, False}:
                half.append(b.name)
        assert half, "the layout left no block half stepped: the test tests nothing"
        if read == "forward":
            with pytest.raises(RuntimeError, match="half stepped") as e, torch.no_grad():
                model(tokens)
            assert any(repr(n) in str(e.value) for n in half)
        elif read == "state_dict":
            with pytest.raises(RuntimeError, match="half stepped") as e:
                model.state_dict()
            assert any(repr(n) in str(e.value) for n in half)
        opt.step()
        opt.zero_grad()
        model.layers[2].up.weight.requires_grad_(True)
        values(model)   # read after step(): whole again
        train(model, opt, 1, start=3)
        runs.append((model, opt))
    assert_same_training(runs[0], runs[1])
    assert_same_training(runs[0], runs[2])


def test_grads_are_the_unstreamed_ones_when_a_blocks_input_is_used_outside_it(device):
    """How the streamer learns that a block's backward is done must not change autograd's
    graph: a node on the block's inputs (once an identity Function) summed the block's
    grads of its input before the grad from outside it, and the grads differed from the
    unstreamed model's in the last bits."""
    grads = []
    for streamed in (False, True):
        model = _model(Outside, 4, streamed)
        llama_loss(model, 1).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_a_dataclass_output_streams_and_a_double_backward_is_refused(device):
    """A block that returns a dataclass (not registered with pytree): its tensors are
    found, and its backward fetches its params (it once ran on the placeholders and
    crashed in a setStorage error). A backward with create_graph=True would make a graph
    of the grads that reads the params after their blocks gave them back: refused,
    naming the block."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor
        note: str = "x"

    class DataclassBlock(Block):
        def forward(self, x):
            return Out(super().forward(x))

    class Model(TinyLlama):
        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x).hidden
            return self.head(self.norm(x))

    runs = []
    for streamed in (False, True):
        torch.manual_seed(0)
        model = Model(layers=3, block=DataclassBlock).to(BF16)
        if streamed:
            offload_adam.stream_params(model, DataclassBlock, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2)
        runs.append((model, opt))
    assert_same_training(*runs)

    model = make_llama(layers=3, frozen=())
    offload_adam.stream_params(model, Block, prefetch=1)
    loss = llama_loss(model, 1)
    with pytest.raises(RuntimeError, match=r"stream_params: a backward with create_graph=True "
                                           r"reached streamed block layers\.2"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1)   # training goes on


def test_the_recorded_order_is_a_training_micro_batchs_and_bounded(device):
    """The order of uses is recorded until a backward completes: inference forwards
    before it (no_grad, or a forward with grads and no backward) once grew the recording
    without bound and went into the order prefetch follows, fetching blocks ahead that
    the pass did not use next (more than (k + 2) x the largest block on the device). Each
    forward of the model starts the recording anew."""
    prefetch = 1
    model = make_llama(layers=4, frozen=())
    streamer = offload_adam.stream_params(model, Block, prefetch=prefetch)
    tokens = torch.randint(0, 61, (1, 3), generator=torch.Generator().manual_seed(4))
    for i in range(12):
        with torch.set_grad_enabled(i % 3 == 0):
            model(tokens)
        assert len(streamer._recording) <= 2 * len(streamer.blocks), i
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1)   # the order is learned
    forward, backward = [(i, "f") for i in range(4)], [(i, "b") for i in range(4)]
    assert streamer._order == forward + backward[::-1]
    device.reset_peak()
    train(model, opt, 1, start=1)
    assert device.counters()["peak_materialized_bytes"] <= (prefetch + 2) * streamer.largest_block_bytes


@pytest.mark.parametrize("how", ["assigned", "in place"])
def test_a_write_through_data_to_a_streamed_param_is_refused(device, how):
    """p.data = t replaces the placeholder a streamed param shows between uses, and
    p.data.zero_() writes into it without bumping the param's version counter: both were
    dropped without a word. p.data = t is refused at the block's next use, state_dict()
    or load_state_dict(); an in-place write through p.data at state_dict(),
    load_state_dict() or close() (its next use cannot see it without a device sync).
    Raised once; training goes on from the host copies."""
    model, plain, opt, ref = _trained_twins(1)
    w = model.layers[1].up.weight
    sd = {k: v.clone() for k, v in model.layers[1].state_dict().items()}
    writes = [("state_dict", lambda: model.state_dict()),
              ("load", lambda: model.layers[1].load_state_dict(sd))]
    if how == "assigned":
        writes.append(("forward", lambda: llama_loss(model, 5)))
    for name, use in writes:
        if how == "assigned":
            w.data = torch.zeros(w.shape, dtype=w.dtype)
            match = r"param layers\.1\.up\.weight of a streamed block was assigned \(p\.data = t\)"
        else:
            w.data.zero_()
            match = r"param layers\.1\.up\.weight of a streamed block was written in place"
        with pytest.raises(RuntimeError, match=match):
            use()
        assert torch.isnan(w).all() and w.untyped_storage().nbytes() <= 2, name
    train(model, opt, 1, start=1)
    train(plain, ref, 1, start=1)
    assert_same_training((model, opt), (plain, ref))


class Latents(torch.nn.Module):
    """Learned queries returned expanded (Perceiver, Q-Former): a view of its own param."""

    def __init__(self, n=7, dim=32):
        super().__init__()
        self.latents = torch.nn.Parameter(torch.randn(n, dim))

    def forward(self, x):
        return self.latents.expand(x.shape[0], -1, -1)


class WithLatents(TinyLlama):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.queries = Latents()

    def forward(self, tokens):
        return super().forward(tokens) + self.head(self.queries(tokens)).mean()


def test_a_block_output_that_views_its_param_is_a_copy(device):
    """A block whose output is a view of one of its params: the params' device memory goes
    back after the forward, and the view read freed memory (a segfault on the simulated
    device). The output is a copy of what it viewed, and training is the resident one; a
    view inside a dataclass the streamer cannot rebuild is refused, naming the block."""
    import dataclasses
    runs = []
    for streamed in (False, True):
        torch.manual_seed(0)
        model = WithLatents(layers=2).to(BF16)
        if streamed:
            offload_adam.stream_params(model, (Latents, Block), prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 3)
        with torch.no_grad():   # (and without grad: the same release)
            out = model.queries(torch.zeros(2, 3))
        runs.append((model, opt))
        assert torch.equal(out[1], values(model)["queries.latents"])
    assert_same_training(*runs)

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor

    class Wrapped(Latents):
        def forward(self, x):
            return Out(super().forward(x))

    model = torch.nn.Sequential(Wrapped()).to(BF16)
    offload_adam.stream_params(model, Wrapped)
    with pytest.raises(RuntimeError, match=r"block 0 \(Wrapped\) returned a view of one of its "
                                           "params inside an object"):
        model(torch.zeros(2, 3))


def test_a_forward_pre_hook_registered_before_streaming_sees_the_params(device):
    """The streamer's fetch runs before every other forward pre-hook of the block: one the
    user registered before streaming (weight_norm's, say) read the NaN placeholders."""
    seen = {}
    for streamed in (False, True):
        model = make_llama(layers=2, frozen=())
        norms = seen[streamed] = []
        model.layers[1].register_forward_pre_hook(
            lambda mod, args: norms.append(mod.q.weight.float().norm().item()))
        if streamed:
            offload_adam.stream_params(model, Block)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2)
    assert seen[True] == seen[False] and all(math.isfinite(n) for n in seen[True])


@pytest.mark.parametrize("files", [False, True], ids=["ram", "files"])
def test_close_between_a_backward_that_stepped_and_step_is_refused(device, tmp_path, files):
    """step_in_backward: the blocks were stepped in backward, the resident params wait for
    step(). close() then would leave the model half stepped for good (the old optimizer
    cannot step a closed streamer's params): refused, and step() trains on."""
    runs = []
    for close_early in (False, True):
        model = make_llama(layers=4, frozen=())
        streamer = offload_adam.stream_params(model, Block, prefetch=1)
        (tmp_path / f"s{close_early}").mkdir()
        kw = dict(state_dirs=str(tmp_path / f"s{close_early}")) if files else {}
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS, **kw)
        train(model, opt, 2)   # (the files' pass steps in backward from the second on)
        llama_loss(model, 7).backward()
        opt._engine.drain()
        if close_early:
            with pytest.raises(RuntimeError, match="close\\(\\) between backward and step\\(\\)"):
                streamer.close()
        opt.step()
        opt.zero_grad()
        streamer.close()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


class GatedBlock(Block):
    """A learnable scalar gate on the block's update (a 0-dim param)."""

    def __init__(self, dim, hidden):
        super().__init__(dim, hidden)
        self.alpha = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x + self.alpha * (super().forward(x) - x)


def test_a_scalar_param_streams(device):
    """A 0-dim param in a block streams and trains as resident (the simulated device's
    checksum once could not view one as bytes)."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=2, frozen=(), block=GatedBlock)
        if streamed:
            offload_adam.stream_params(model, GatedBlock)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2)
        runs.append((model, opt))
    assert_same_training(*runs)
    assert not torch.equal(runs[1][0].layers[0].alpha.new_tensor(0.5),
                           values(runs[1][0])["layers.0.alpha"])   # (it trained)


@pytest.mark.parametrize("kind", ["fused", "foreach", "single"])
def test_another_optimizers_step_of_a_streamed_param_is_refused(device, kind):
    """torch's AdamW (transformers' Trainer builds one by default) would step the
    placeholders, one element expanded: its fused kernel wrote past that element (a
    segfault on the simulated device), the others raised torch's internal-overlap error.
    Refused before anything is written, naming the param; offload_adam's step goes on."""
    model, plain, opt, ref = _trained_twins(1)
    other = torch.optim.AdamW(model.parameters(), lr=1e-3, **{
        "fused": dict(fused=True), "foreach": dict(foreach=True),
        "single": dict(foreach=False)}[kind])
    llama_loss(model, 3).backward()
    before = values(model)
    with pytest.raises(RuntimeError, match=r"stream_params: AdamW cannot step param \d+ of "
                                           r"param group 0 \(shape .*\): it streams"):
        other.step()
    assert all(torch.equal(v, before[k]) for k, v in values(model).items())
    model.zero_grad()
    train(model, opt, 1, start=1)
    train(plain, ref, 1, start=1)
    assert_same_training((model, opt), (plain, ref))


def test_a_streamed_models_state_dict_has_a_storage_per_param(device, tmp_path):
    """Each streamed param's tensor in state_dict() has a storage of its own (the block's
    params were views of one buffer, taken for tied weights by savers that keep one
    tensor per storage: safetensors' save_model refused, accelerate's save_state kept one
    param a block). Same memory, no copy: it reads the host copy as it is."""
    model, _, opt, _ = _trained_twins(1)
    sd = model.state_dict()
    storages = [sd[f"layers.1.{n}"].untyped_storage().data_ptr() for n, _ in
                model.layers[1].named_parameters()]
    assert len(set(storages)) == len(storages)
    kept = {k: v.clone() for k, v in sd.items()}
    train(model, opt, 1, start=1)   # (as torch's, they alias the params: stepped with them)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())
    assert not torch.equal(sd["layers.1.up.weight"], kept["layers.1.up.weight"])
    sd = model.state_dict()
    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors (installed "
                                      "with transformers by the README's test command)")
    safetensors.save_model(model, str(tmp_path / "m.safetensors"))
    fresh = make_llama(seed=9, layers=3, frozen=())
    missing, unexpected = safetensors.load_model(fresh, str(tmp_path / "m.safetensors"))
    assert (missing, unexpected) == (set(), [])
    assert all(torch.equal(v, sd[k]) for k, v in fresh.state_dict().items())


class Rotary(torch.nn.Module):
    """A rotary table as transformers keeps it: a non-persistent buffer."""

    def __init__(self, dim=32):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim),
                             persistent=False)


def test_a_meta_buffer_no_state_dict_fills_is_refused(device):
    """A model built on meta has NaN for what a state dict does not hold: a rotary
    embedding's non-persistent inv_freq computed silently wrong results after the load
    said every key matched. Refused, naming it, with nothing changed; a model whose
    buffers are real (accelerate's init_empty_weights) streams."""
    with torch.device("meta"):
        model = make_llama(layers=2, frozen=())
        model.rotary = Rotary()
    with pytest.raises(ValueError, match=r"buffers rotary\.inv_freq are on the meta device "
                                         r"and not in its state_dict"):
        offload_adam.stream_params(model, Block)
    assert all(p.is_meta for p in model.parameters())
    model.rotary = Rotary()   # (real, as init_empty_weights leaves buffers)
    offload_adam.stream_params(model, Block)
    assert torch.isfinite(model.rotary.inv_freq).all()


def _autograd_nodes() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__.endswith(("Backward0", "Backward1")))


@pytest.mark.parametrize("early", [False, True], ids=["at-step", "in-backward"])
def test_no_step_leaves_its_graph_alive(device, early):
    """The release hook on each block's inputs (torch's "all" multi-grad hook holds the
    autograd nodes it sits on, a cycle the garbage collector cannot see) is removed once
    the backward ends: the autograd nodes alive do not grow with the steps (they did by
    ~5 a step for this model), a graph never backpropagated goes after two backwards,
    and nothing of the model's graphs is left after close()."""
    before = _autograd_nodes()
    model = make_llama(layers=6)
    streamer = offload_adam.stream_params(model, Block, prefetch=1)
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=early, **OPTS)
    train(model, opt, 3)
    early_count = _autograd_nodes()
    llama_loss(model, 99)   # (a forward whose graph is dropped, never backpropagated)
    train(model, opt, 12, start=3)
    assert _autograd_nodes() <= early_count
    opt.close()
    streamer.close()
    del model, opt, streamer
    assert _autograd_nodes() <= before


def test_forwards_never_backpropagated_leave_no_graph_alive(device):
    """An evaluation loop run with grad enabled (no torch.no_grad(), no backward) drops
    each forward's graph, as without the streamer: the release hook on each block's
    inputs holds no autograd node (torch's "all" multi-grad hook held the nodes it sits
    on, so every such forward's graph, its activations with it, stayed alive until two
    backwards had ended)."""
    model = make_llama(layers=6)
    streamer = offload_adam.stream_params(model, Block, prefetch=1)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 2)
    settled = _autograd_nodes()
    for k in range(20):
        llama_loss(model, 50 + k)   # (its graph dropped)
    assert _autograd_nodes() <= settled
    assert len(streamer._input_hooks) <= 6   # (the hooks of the graphs gone are let go)
    train(model, opt, 2, start=2)   # (and the releases in backward still come)
    assert _autograd_nodes() <= settled
    opt.close()
    streamer.close()

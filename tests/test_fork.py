"""A child forked from a process that uses an optimizer (by hand, a fork-based
checkpoint, a DataLoader worker): os.fork copies the calling thread only, so the
engine's worker, the I/O threads and any other thread inside step() are not in the
child. What would wait on them is refused naming both processes; nothing hangs; what
is the child's own (the hooks on its params) it can let go of; the parent trains on."""
import threading

import pytest
import torch

import offload_adam
from forked import in_child, refused_in_child
from models import BF16


def _mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4)).to(dtype)


def _train(model, opt, steps, start=0):
    for it in range(start, start + steps):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(it)).to(
            next(model.parameters()).dtype)
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()


def _values(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def test_a_forked_child_is_refused_not_hung(kernels):
    """A child forked after the optimizer was built has none of the engine's threads:
    its step waited on them for ever (found from outside). Its backward and step() are
    refused naming both processes, and the parent trains on."""
    model = _mlp(BF16)
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True)   # (the engine)
    _train(model, opt, 1)
    x = torch.randn(3, 8).to(BF16)
    said = in_child([lambda: model(x).float().sum().backward(), opt.step])
    assert len(said) == 2
    for line in said:
        assert refused_in_child(line), line
    _train(model, opt, 1, start=1)
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {2.0}
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])   # in place, the engine
def test_a_child_forked_while_another_thread_is_inside_step_is_refused(kernels, dtype):
    """A fork while another thread of the parent is inside step() (a fork-based async
    checkpoint beside a training thread): that thread holds the optimizer's step lock,
    for good in the child, whose state_dict() and step() waited on it (found from
    outside: every child hung). They are refused naming both processes, as the state
    in the child's memory is half stepped; the parent's step ends as it would have."""
    model = _mlp(dtype)
    opt = offload_adam.AdamW(model.parameters())
    _train(model, opt, 1)
    inside, go_on = threading.Event(), threading.Event()
    real = opt._step

    def held_step(closure):   # (inside the step's lock, before its kernels)
        inside.set()
        assert go_on.wait(60)
        return real(closure)
    opt._step = held_step
    model(torch.randn(3, 8).to(dtype)).float().sum().backward()
    stepping = threading.Thread(target=opt.step)
    stepping.start()
    try:
        assert inside.wait(60)
        said = in_child([opt.state_dict, opt.step, opt.close])
    finally:
        go_on.set()
        stepping.join()
    assert len(said) == 3
    for line, what in zip(said, ("state_dict", "step", "close")):
        assert refused_in_child(line) and f"{what}() in a child" in line, line
        assert "inside this optimizer's step()" in line, line
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {2.0}
    del opt._step
    opt.zero_grad()
    _train(model, opt, 1, start=5)
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {3.0}
    opt.close()


def test_a_forked_child_lets_go_of_the_parents_hooks(kernels):
    """In a child, the parent's engine hooks on the params refused every backward, and
    stayed: neither close() nor a new optimizer built in the child over the same params
    removed them (found from outside). close() lets go of them there (a plain backward
    then fills .grad), and a new optimizer takes the params over and trains as in a
    process of its own (bitwise); the parent's engine is untouched."""
    model = _mlp(BF16)
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True)
    _train(model, opt, 2)
    twin = _mlp(BF16)   # the reference: the same values, a new optimizer, 2 steps
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 8).to(BF16)

    def close_then_backward():
        opt.close()
        model(x).float().sum().backward()
        return f"grads {sum(p.grad is not None for p in model.parameters())}"

    def new_optimizer_trains():
        new = offload_adam.AdamW(model.parameters(), step_in_backward=True)
        _train(model, new, 2, start=7)
        return " ".join(map(repr, _values(model).tolist()))
    said = in_child([close_then_backward])
    assert said == [f"ran: grads {len(list(model.parameters()))}"], said
    said = in_child([new_optimizer_trains])
    assert said[0].startswith("ran: "), said
    got = torch.tensor([float(v) for v in said[0][len("ran: "):].split()])
    ref = offload_adam.AdamW(twin.parameters(), step_in_backward=True)
    _train(twin, ref, 2, start=7)
    assert torch.equal(got, _values(twin))
    ref.close()
    _train(model, opt, 1, start=2)   # the parent's own optimizer, hooks and all
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {3.0}
    opt.close()


def test_an_engine_optimizer_sent_to_another_process_is_refused(kernels, tmp_path):
    """Sent through multiprocessing (a spawn Process's args, a Queue: ForkingPickler),
    torch's optimizer shares its params and state with the other process. The engine's
    state and the files' cannot be shared: the params went shared and the state copied,
    the two processes training one model with moments of their own, silently (found from
    outside). Refused, naming why; the in-place path's state is shared as torch's is."""
    from multiprocessing.reduction import ForkingPickler
    for kw in (dict(step_in_backward=True), dict(state_dirs=[str(tmp_path)])):
        model = _mlp(BF16)
        opt = offload_adam.AdamW(model.parameters(), **kw)
        _train(model, opt, 1)
        with pytest.raises(RuntimeError, match="sent to another process through "
                           "multiprocessing.*cannot be shared"):
            ForkingPickler.dumps(opt)
        opt.close()
    model = _mlp(torch.float32)   # in place: shared, as torch's
    opt = offload_adam.AdamW(model.parameters())
    _train(model, opt, 1)
    other = ForkingPickler.loads(ForkingPickler.dumps(opt))
    first = next(model.parameters())
    theirs = next(iter(other.state.values()))["exp_avg"]
    assert torch.equal(theirs, opt.state[first]["exp_avg"])
    theirs.add_(1.0)   # (the other process's step, say)
    assert torch.equal(theirs, opt.state[first]["exp_avg"])

"""Host buffers (offload_adam/engine/host_memory.py): the free-memory check, and
pinning through the device with its failure path."""
import io

import pytest
import torch

from offload_adam.engine import host_memory
from offload_adam.engine.host_memory import HostArenas, available_host_bytes, check_host_memory


def test_host_memory_check_names_both_numbers():
    with pytest.raises(MemoryError, match=r"needs .*\(1000 bytes\).*only .*\(10 bytes\)"):
        check_host_memory(1000, available=10)
    check_host_memory(10, available=1000)


def test_host_memory_check_names_the_largest_parts():
    """The roles that take the most are named, the grad ring with its option (a
    grad_ring_mb= given too large was blamed on the master weights: found from outside)."""
    parts = {"master": 3 << 30, "grad ring": 40 << 30, "exp_avg": 2 << 30, "staging": 1 << 30}
    with pytest.raises(MemoryError, match=r"the most: grad ring 40\.00 GiB, master 3\.00 GiB, "
                                          r"exp_avg 2\.00 GiB \(the grad ring's size is "
                                          r"grad_ring_mb=\), but only"):
        check_host_memory(46 << 30, available=10 << 30, parts=parts)


def test_available_host_bytes_unreadable_or_missing(monkeypatch):
    """No /proc/meminfo (or no MemAvailable line): unknown, so no check."""
    def unreadable(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(host_memory, "open", unreadable, raising=False)
    assert available_host_bytes() is None
    check_host_memory(1 << 62)  # unknown: not refused
    monkeypatch.setattr(host_memory, "open", lambda *a, **k: io.StringIO("MemTotal: 1 kB\n"),
                        raising=False)
    assert available_host_bytes() is None
    monkeypatch.setattr(host_memory, "open",
                        lambda *a, **k: io.StringIO("MemTotal: 9 kB\nMemAvailable: 3 kB\n"),
                        raising=False)
    assert available_host_bytes() == 3 * 1024
    with pytest.raises(MemoryError, match=r"\(3072 bytes\) is available"):
        check_host_memory(4096)


class PinningDevice:
    """Records pin/unpin; the `fail_on`-th pin (from 1) raises."""

    pins_memory = True

    def __init__(self, fail_on=None):
        self.fail_on, self.pinned, self.unpinned = fail_on, [], []

    def pin(self, t):
        if len(self.pinned) + 1 == self.fail_on:
            raise RuntimeError("cudaHostRegister failed with error 2")
        self.pinned.append(t.data_ptr())
        return True

    def unpin(self, t):
        self.unpinned.append(t.data_ptr())


def _arenas(device):
    arenas = HostArenas(device)
    offsets = (arenas.reserve("state", torch.float32, 10),
               arenas.reserve("grad", torch.bfloat16, 5),
               arenas.reserve("empty", torch.float16, 0))  # nothing to pin
    return arenas, offsets


def test_pinning_registers_each_arena_and_releases_all():
    device = PinningDevice()
    arenas, (a, b, _) = _arenas(device)
    arenas.allocate()
    assert arenas.pinned and len(device.pinned) == 2
    v = arenas.view("state", a, (2, 5))
    v.fill_(2.0)
    assert float(arenas.view("state", a, (10,)).sum()) == 20.0
    assert arenas.view("grad", b, (5,)).dtype == torch.bfloat16
    arenas.release()
    assert sorted(device.unpinned) == sorted(device.pinned) and not arenas.pinned
    arenas.release()  # nothing left to unpin
    assert len(device.unpinned) == 2


def test_failed_pinning_falls_back_to_pageable_with_a_warning():
    device = PinningDevice(fail_on=2)
    arenas, (a, _, _) = _arenas(device)
    with pytest.warns(RuntimeWarning, match=r"could not pin .*error 2.*pageable"):
        arenas.allocate()
    assert not arenas.pinned
    assert len(device.pinned) == 1 and device.unpinned == device.pinned
    arenas.view("state", a, (10,)).fill_(1.0)  # pageable, still usable


def test_arenas_refuse_two_dtypes_in_one_role():
    arenas = HostArenas(PinningDevice())
    arenas.reserve("state", torch.float32, 4)
    with pytest.raises(ValueError, match="holds torch.float32"):
        arenas.reserve("state", torch.bfloat16, 4)


def test_every_view_is_a_whole_number_of_cache_lines_apart():
    arenas = HostArenas(PinningDevice())
    offsets = [arenas.reserve("x", torch.bfloat16, n) for n in (1, 33, 32, 100)]
    assert offsets == [0, 32, 96, 128]  # 33 elements take two lines
    arenas.allocate()
    assert all(arenas.view("x", o, (1,)).data_ptr() % 64 == 0 for o in offsets)


def test_only_the_roles_asked_are_pinned():
    device = PinningDevice()
    arenas, (a, b, _) = _arenas(device)
    arenas.allocate(pin=["grad"])
    assert arenas.pinned and device.pinned == [arenas.view("grad", b, (5,)).data_ptr()]
    arenas.release()
    device = PinningDevice()
    arenas, _ = _arenas(device)
    arenas.allocate(pin=[])
    assert arenas.pinned and device.pinned == []   # nothing asked: nothing failed


def _pinned_roles(opt, sim):
    spans = sim.pinned()
    out = set()
    for arenas in opt._engine._state_arenas:
        for role, t in arenas._arenas.items():
            lo = t.data_ptr()
            hi = lo + t.numel() * t.element_size()
            if any(s[1] <= lo and hi <= s[2] for s in spans):
                out.add(role)
    return out


@pytest.mark.parametrize("where", ["ram", "files", "compact"])
@pytest.mark.parametrize("early", [False, True], ids=["at-step", "in-backward"])
@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32-head"])
def test_the_state_pins_only_what_a_copy_uses_and_no_copy_is_pageable(sim, early, fp32, where,
                                                                      tmp_path):
    """In RAM the state arenas pin an fp32 param's master (its copy to the device reads
    it, the master rule's copy back writes it) and nothing else; in files the ring
    buffers are pinned through the engine's device. Every copy the engine makes, through
    steps, accumulation and a param edited by the user, has pinned host memory on its
    side (the simulated device counts those that do not)."""
    import offload_adam
    from models import OPTS, TinyTransformer, fp32_head, loss_of
    from offload_adam.testing import ring_buffers

    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    if fp32:
        fp32_head(model)
    files = {} if where == "ram" else dict(
        state_dirs=[str(tmp_path)], state_footprint="compact" if where == "compact" else "two_generations")
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=early, **files, **OPTS)
    micro = 1 if early else 2   # (accumulation: not with steps in backward)
    for it in range(3):
        for m in range(micro):
            loss_of(model, 10 * it + m).backward()
        opt.step()
        opt.zero_grad()
        if it == 1:   # the master rule: the edited params' masters start again from them
            with torch.no_grad():
                model.head.weight.add_(0.25)
                model.embed.weight.mul_(0.5)
    counters = sim.sim.counters()
    assert counters["h2d_bytes"] > 0 and counters["d2h_bytes"] > 0
    # (compact, at step(): the master rule's reads of the edited params for the redo log
    # go to a temporary, copied synchronously on a GPU: a rare path, once per edit)
    edited = sum(p.numel() * p.element_size() for p in (model.head.weight, model.embed.weight))
    assert counters["pageable_bytes"] == (edited if where == "compact" and not early else 0)
    assert opt.pinned()
    if where == "ram":
        assert _pinned_roles(opt, sim.sim) == ({"master"} if fp32 else set())
    else:
        spans = sim.sim.pinned()
        for b in ring_buffers(opt):
            lo = b.tensor.data_ptr()
            assert any(s[1] <= lo and lo + b.nbytes <= s[2] for s in spans)
    opt.close()   # (unpinned after the copies: the simulated device checks)


@pytest.mark.parametrize("state_dtype", ["float32", "8bit"])
def test_a_fresh_state_is_zeroed_in_its_arenas_without_a_temporary(sim, monkeypatch,
                                                                   state_dtype):
    """A param's first step zeroes its moments (and 8-bit scales) where they live: no
    zero tensor the moment's size is made to be copied (StateFormat.zeros is not called),
    and arenas holding garbage before start from zero: two steps are bit for bit the
    in-place stepper's (which makes its zeros)."""
    import copy

    import offload_adam
    from models import OPTS, TinyTransformer, assert_same, loss_of, run
    from offload_adam import state_format

    def refused(*args, **kwargs):
        raise AssertionError("a zero moment was made to be copied")

    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    opt = offload_adam.AdamW(model.parameters(), state_dtype=state_dtype, **OPTS)
    for rec in opt._engine.recs:   # garbage where the state will be: zeroing must clear it
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            if getattr(rec, key, None) is not None:
                getattr(rec, key).view(torch.uint8).fill_(0x7F)
    with monkeypatch.context() as m:
        m.setattr(state_format.StateFormat, "zeros", refused)
        run(model, opt, 2, loss=loss_of)
    with sim.outside():
        ref = offload_adam.AdamW(twin.parameters(), state_dtype=state_dtype, **OPTS)
        run(twin, ref, 2, loss=loss_of)
    assert_same((model, opt), (twin, ref))
    opt.close()


def _cgroup_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_limit_is_the_least_of_the_cgroup_and_its_parents(tmp_path):
    """In a container /proc/meminfo is the host's: the memory cgroup's limit (here its
    parent's, the smaller) caps the RAM, and its usage less its page cache is not
    available."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/jobs/run1\n")
    _cgroup_tree(tmp_path / "fs", {
        "jobs/memory.max": f"{8 << 30}\n",
        "jobs/run1/memory.max": "max\n",
        "jobs/run1/memory.current": f"{3 << 30}\n",
        "jobs/memory.current": f"{5 << 30}\n",
        "jobs/memory.stat": f"anon 1\nfile {1 << 30}\n",
    })
    got = host_memory.cgroup_memory(str(tmp_path / "fs"), str(proc))
    assert got == (8 << 30, (8 << 30) - (5 << 30) + (1 << 30))


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/x\n")
    fs = tmp_path / "fs"
    _cgroup_tree(fs, {"memory/x/memory.limit_in_bytes": str(9223372036854771712)})
    assert host_memory.cgroup_memory(str(fs), str(proc)) is None   # (2^63 - 4096: none)
    _cgroup_tree(fs, {"memory/memory.limit_in_bytes": str(6 << 30),   # a namespaced mount
                      "memory/memory.usage_in_bytes": str(2 << 30),
                      "memory/memory.stat": f"total_cache {1 << 29}\ntotal_rss 5\n"})
    assert host_memory.cgroup_memory(str(fs), str(proc)) == (6 << 30, (4 << 30) + (1 << 29))
    assert host_memory.cgroup_memory(str(fs), str(tmp_path / "absent")) is None


def test_host_bytes_take_the_cgroup_limit_when_smaller(monkeypatch):
    """The planner's `--machine here` and the engine's free-memory check read these."""
    monkeypatch.setattr(host_memory, "_meminfo", {"MemTotal": 64 << 30,
                                                  "MemAvailable": 60 << 30}.get)
    monkeypatch.setattr(host_memory, "cgroup_memory", lambda: (16 << 30, 10 << 30))
    assert host_memory.total_host_bytes() == 16 << 30
    assert host_memory.available_host_bytes() == 10 << 30
    with pytest.raises(MemoryError, match=r"only 10.00 GiB"):
        check_host_memory(11 << 30)
    monkeypatch.setattr(host_memory, "cgroup_memory", lambda: None)
    assert host_memory.total_host_bytes() == 64 << 30
    assert host_memory.available_host_bytes() == 60 << 30

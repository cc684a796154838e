"""Params larger than a file bucket, in parts (nvme_tier._lay_out): an engine param whose
state exceeds bucket_mb is cut into runs of its engine pieces, each a bucket's flat state
of its own, so that no bucket, spare extent or pipeline buffer is sized by the largest param.

On the asynchronous simulated device: bitwise the state in RAM (both layouts, step at
step() and in backward, params edited whole or in part between steps), a state dict that
joins the parts and loads into parts, a resume from the files, and files laid out before
parts existed still resumed."""
import gc
import os
import warnings

import pytest
import torch

import offload_adam
from offload_adam.testing import AsyncSimDevice, simulated, state_files
from nvme_model import assert_same

BUCKET_MB = 0.01   # engine pieces of 32768 elements (the least), file buckets of ~10 KB


class Wide(torch.nn.Module):
    """A bf16 model with two params of several engine pieces (3 and 3, the last short) and
    small ones, and an fp32 head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1024, 96)             # 98304: 3 pieces
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(96))
        self.up = torch.nn.Parameter(torch.randn(96, 700) / 96 ** 0.5)   # 67200: 3
        self.head = torch.nn.Parameter(torch.randn(700) / 700 ** 0.5)

    def forward(self, tokens):
        x = self.embed(tokens) * self.norm
        x = torch.tanh(x @ self.up)
        return (x.float() * self.head).sum(-1)


def wide(seed=3):
    torch.manual_seed(seed)
    m = Wide().to(torch.bfloat16)
    m.head.data = m.head.data.float()
    return m


def loss(m, k):
    g = torch.Generator().manual_seed(500 + k)
    tokens = torch.randint(0, 1024, (4, 32), generator=g)
    return ((m(tokens) - 0.5) ** 2).mean()


def params(m):
    return list(m.parameters())


def edit(m, k, how):
    """Between steps: a param changed whole (every part's master starts from it) or in
    part (only the pieces changed do; the rest keep their masters)."""
    with torch.no_grad():
        if k == 2 and how == "whole":
            m.embed.weight.mul_(0.5)
        elif k == 2 and how == "part":
            m.embed.weight[900:].mul_(0.5)   # the last piece only
            m.up[:5].add_(0.25)              # the first piece only


def train(pairs, first, count, how=None):
    for k in range(first, first + count):
        for m, opt in pairs:
            edit(m, k, how)
            loss(m, k).backward()
            opt.step()
            opt.zero_grad()


def part_names(opt):
    return [t.name for b in state_files(opt).spec.buckets for t in b.tensors if "#" in t.name]


@pytest.mark.parametrize("fmt", ["float32", "8bit"])
@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "step_in_backward"])
@pytest.mark.parametrize("how", ["whole", "part"])
def test_params_in_parts_step_bitwise_as_in_ram(kernels, tmp_path, fmt, footprint,
                                                in_backward, how):
    sim = AsyncSimDevice(seed=4)
    try:
        with simulated(sim), sim.watch():
            ref, m = wide(), wide()
            ram = offload_adam.AdamW(ref.parameters(), lr=3e-3, bucket_mb=BUCKET_MB,
                                     state_dtype=fmt)
            opt = offload_adam.AdamW(m.parameters(), lr=3e-3, bucket_mb=BUCKET_MB,
                                     state_dtype=fmt, state_dirs=str(tmp_path),
                                     state_footprint=footprint, step_in_backward=in_backward)
            names = part_names(opt)
            # up and embed (params 1, 3) in 3 parts each, one piece each, named by their start
            assert {n.rsplit(".", 1)[0] for n in names} == {
                "0:1#0", "0:1#32768", "0:1#65536", "0:3#0", "0:3#32768", "0:3#65536"}
            largest = max(b.nbytes for b in state_files(opt).spec.buckets)
            whole = 98304 * (4 + 2 * (4 if fmt == "float32" else 1))
            assert largest < whole / 2   # no bucket holds the embedding's whole state
            train([(ref, ram), (m, opt)], 0, 4, how)
            assert_same(params(ref), params(m), ram, opt)
            opt.close()
        sim.check()
    finally:
        sim.close()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_state_in_parts_saves_loads_and_resumes_bitwise(kernels, tmp_path, footprint):
    """state_dict() joins each param's parts (torch's shapes and keys, equal to RAM's); a
    files optimizer loads a RAM one's state dict into parts; and one built again with
    state_resume=True restores the params from the parts and goes on bitwise."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    sim = AsyncSimDevice(seed=1)
    try:
        with simulated(sim), sim.watch():
            ms = [wide() for _ in range(3)]
            ram = offload_adam.AdamW(ms[0].parameters(), lr=3e-3, bucket_mb=BUCKET_MB,
                                     state_dtype="8bit")
            opts = dict(lr=3e-3, bucket_mb=BUCKET_MB, state_dtype="8bit",
                        state_footprint=footprint)
            a = offload_adam.AdamW(ms[1].parameters(), state_dirs=str(tmp_path / "a"), **opts)
            train([(ms[0], ram), (ms[1], a)], 0, 2)
            assert_same(params(ms[0]), params(ms[1]), ram, a)   # (state dicts too)
            b = offload_adam.AdamW(ms[2].parameters(), state_dirs=str(tmp_path / "b"), **opts)
            with torch.no_grad():
                for p, q in zip(params(ms[2]), params(ms[0])):
                    p.copy_(q)
            b.load_state_dict(ram.state_dict())
            assert_same(params(ms[0]), params(ms[2]), ram, b)
            train([(ms[0], ram), (ms[2], b)], 2, 2)
            assert_same(params(ms[0]), params(ms[2]), ram, b)
            a.close()
            del a
            gc.collect()
            resumed = wide(seed=9)   # other values: the files set them
            c = offload_adam.AdamW(resumed.parameters(), state_dirs=str(tmp_path / "a"),
                                   state_resume=True, **opts)
            assert c.step_count == 2
            train([(resumed, c)], 2, 2)   # the steps ram took with b
            assert_same(params(ms[0]), params(resumed), ram, c)
            b.close()
            c.close()
        sim.check()
    finally:
        sim.close()


def test_files_laid_out_before_parts_resume_as_they_are(kernels, tmp_path, monkeypatch):
    """State files made with every param whole in one bucket (before parts existed) are
    resumed in that layout, bitwise; new files get parts."""
    from offload_adam import nvme_tier
    lay_out = nvme_tier._lay_out
    sim = AsyncSimDevice(seed=0)
    try:
        with simulated(sim), sim.watch():
            ref, m = wide(), wide()
            ram = offload_adam.AdamW(ref.parameters(), lr=3e-3, bucket_mb=BUCKET_MB)
            monkeypatch.setattr(nvme_tier, "_lay_out",
                                lambda *a, **k: lay_out(*a[:-1], split=False, **k))
            old = offload_adam.AdamW(m.parameters(), lr=3e-3, bucket_mb=BUCKET_MB,
                                     state_dirs=str(tmp_path))
            assert not part_names(old)
            train([(ref, ram), (m, old)], 0, 2)
            old.close()
            del old
            gc.collect()
            monkeypatch.setattr(nvme_tier, "_lay_out", lay_out)
            again = wide(seed=5)
            new = offload_adam.AdamW(again.parameters(), lr=3e-3, bucket_mb=BUCKET_MB,
                                     state_dirs=str(tmp_path), state_resume=True)
            assert not part_names(new) and new.step_count == 2
            train([(ref, ram), (again, new)], 2, 2)
            assert_same(params(ref), params(again), ram, new)
            new.close()
            (tmp_path / "new").mkdir()
            fresh = offload_adam.AdamW(wide().parameters(), lr=3e-3, bucket_mb=BUCKET_MB,
                                       state_dirs=str(tmp_path / "new"))
            assert part_names(fresh)
            fresh.close()
        sim.check()
    finally:
        sim.close()


def mapped_file(t):
    """The file whose pages hold tensor t's first element (/proc/self/maps), or None."""
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def trained_8bit(folder, footprint):
    """The wide model and its optimizer (8-bit state in `folder`) after two steps."""
    m = wide()
    opt = offload_adam.AdamW(m.parameters(), lr=3e-3, bucket_mb=BUCKET_MB,
                             state_dtype="8bit", state_dirs=str(folder),
                             state_footprint=footprint)
    train([(m, opt)], 0, 2)
    return m, opt


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_the_state_dict_maps_a_param_in_parts_from_the_files(kernels, tmp_path, footprint):
    """A param in parts shows its master and moments in state_dict() as one tensor whose
    pages are its parts' pages in the state file, side by side (no copy in RAM, as a whole
    param's views), copy-on-write: writing into it changes neither the files nor the next
    state_dict()."""
    sim = AsyncSimDevice(seed=2)
    try:
        with simulated(sim), sim.watch():
            m, opt = trained_8bit(tmp_path, footprint)
            data = os.path.realpath(str(tmp_path / "offload_adam_state.bin"))
            sd = opt.state_dict()
            st = sd["state"][3]   # the embedding, in 3 parts
            for key in ("master_param", "exp_avg_codes", "exp_avg_sq_codes"):
                t = st[key]
                assert t.shape == m.embed.weight.shape
                for k in (0, 32768, 65536, t.numel() - 1):   # each part's pages
                    assert mapped_file(t.view(-1)[k:]) == data, (key, k)
            before = st["exp_avg_codes"].clone()
            st["exp_avg_codes"].add_(1)
            st["master_param"].zero_()
            again = opt.state_dict()["state"][3]
            assert torch.equal(again["exp_avg_codes"], before)
            assert torch.equal(again["master_param"].to(torch.bfloat16), m.embed.weight.detach())
            opt.close()
        sim.check()
    finally:
        sim.close()


@pytest.mark.parametrize("edit", [None, "scale", "codes"])
def test_its_own_state_dict_of_parts_loads_without_a_write_unless_edited(kernels, tmp_path,
                                                                         edit):
    """Accelerate loads the optimizer's own state_dict() at every start: untouched, a
    param in parts' too (its moments mapped from the files side by side, its 8-bit scales
    a copy joined end to end) writes nothing; an edit of either, in place, is loaded."""
    sim = AsyncSimDevice(seed=2)
    try:
        with simulated(sim), sim.watch():
            m, opt = trained_8bit(tmp_path, "compact")
            before = contents(tmp_path)
            sd = opt.state_dict()
            st = sd["state"][3]   # the embedding, in 3 parts
            if edit == "scale":
                st["exp_avg_scale"].mul_(2)
            elif edit == "codes":
                st["exp_avg_codes"].view(-1)[70000] += 1
            with warnings.catch_warnings():
                if edit is None:
                    warnings.simplefilter("error")
                opt.load_state_dict(sd)
            assert (contents(tmp_path) == before) == (edit is None)
            if edit is not None:
                again = opt.state_dict()["state"][3]
                key = "exp_avg_scale" if edit == "scale" else "exp_avg_codes"
                assert torch.equal(again[key], st[key])
            opt.close()
        sim.check()
    finally:
        sim.close()


def contents(folder):
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))
            if not n.endswith(".lock")}


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
def test_damaged_parts_are_refused_at_resume(kernels, tmp_path, footprint, fault):
    """The data file of a state in parts, a byte flipped inside a part's committed extent,
    cut short or gone: state_resume=True refuses it, naming it, and changes neither the
    files nor the params (never a fresh start over them)."""
    from nvme_adam import flip_byte
    folder = tmp_path / "state"
    folder.mkdir()
    sim = AsyncSimDevice(seed=3)
    try:
        with simulated(sim), sim.watch():
            m = wide()
            opts = dict(lr=3e-3, bucket_mb=BUCKET_MB, state_dtype="8bit",
                        state_dirs=str(folder), state_footprint=footprint)
            opt = offload_adam.AdamW(m.parameters(), **opts)
            train([(m, opt)], 0, 2)
            st = state_files(opt)
            i = next(k for k, b in enumerate(st.spec.buckets)
                     if any("#" in t.name for t in b.tensors))   # a bucket holding a part
            at, nbytes = st._at(i), st.spec.buckets[i].nbytes
            opt.close()
            data = folder / "offload_adam_state.bin"
            if fault == "flip":
                flip_byte(data, at + nbytes // 3)
            elif fault == "truncate":
                os.truncate(data, at + nbytes // 2)
            else:
                data.unlink()
            before = contents(folder)
            again = wide(seed=7)
            with pytest.raises((ValueError, RuntimeError, OSError), match="offload_adam"):
                offload_adam.AdamW(again.parameters(), state_resume=True, **opts)
            assert contents(folder) == before
            assert all(torch.equal(p, q) for p, q in zip(params(again), params(wide(seed=7))))
        sim.check()
    finally:
        sim.close()

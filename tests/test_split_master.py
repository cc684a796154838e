"""Split masters (offload_adam/split_master.py, csrc/split_master.h): an fp32 master kept as
its bf16 value, low 16 bits and a tie bit comes back bit for bit, and a step of it is the
step of the fp32 master, bit for bit, on every ISA variant. The reference here is the
formula written again in torch's integer ops (as bench/split_master_study.py writes it)."""
import pytest
import torch

from offload_adam import split_master


def ref_encode(m):
    """(bf16 value by torch's rounding, low half as int32, tie bool) of fp32 masters."""
    bits = m.view(torch.int32)
    lo = bits & 0xFFFF
    tie = (lo == 0x8000) & (((bits >> 16) & 1) == 1)
    return m.to(torch.bfloat16), lo, tie


def ref_decode(p, lo, tie):
    pb = p.view(torch.int16).to(torch.int32) & 0xFFFF
    up = (lo > 0x8000) | ((lo == 0x8000) & tie)
    hi = (pb - up.to(torch.int32)) & 0xFFFF
    return ((hi << 16) | lo).to(torch.int32).view(torch.float32)


def unpack(tie, n):
    bits = (tie.to(torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1
    return bits.view(-1)[:n].bool()


def structured_patterns():
    """Every high half with the low halves where the rounding turns, every low half with
    high halves of both parities, both signs, zero, the largest finite, inf and NaN."""
    hi = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], dtype=torch.int64)
    a = (hi.unsqueeze(1) << 16 | lows).view(-1)
    highs = torch.tensor([0, 1, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80, 0x7FC0, 0x7FFF, 0x8000,
                          0x8001, 0xBF80, 0xBF81, 0xFF7F, 0xFF80, 0xFFFF], dtype=torch.int64)
    b = (highs.unsqueeze(1) << 16 | torch.arange(1 << 16, dtype=torch.int64)).view(-1)
    bits = torch.cat([a, b, torch.tensor([0x3F808000])])   # odd length: unused tie bits
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    return bits.view(torch.float32)


def each_isa(kernels):
    active = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            yield isa
    finally:
        kernels.set_isa(active)


def test_round_trip_and_the_reference_on_every_variant(kernels):
    m = structured_patterns()
    want_p, want_lo, want_tie = ref_encode(m)
    nan = torch.isnan(m)
    for isa in each_isa(kernels):
        p, lo, tie = split_master.encode(m, num_threads=2)
        assert tie.numel() == (m.numel() + 7) // 8 and int(tie[-1]) >> (m.numel() % 8) == 0, isa
        assert torch.equal(p[~nan].view(torch.int16), want_p[~nan].view(torch.int16)), isa
        assert torch.isnan(p[nan]).all(), isa
        assert torch.equal(lo.to(torch.int32) & 0xFFFF, want_lo), isa
        assert torch.equal(unpack(tie, m.numel()), want_tie), isa
        back = split_master.decode(p, lo, tie, num_threads=2)
        assert torch.equal(back[~nan].view(torch.int32), m[~nan].view(torch.int32)), isa
        assert torch.isnan(back[nan]).all(), isa
        # decode is defined on every triple, consistent or not: the formula's value
        g = torch.Generator().manual_seed(3)
        rp = torch.randint(-(1 << 15), 1 << 15, (100003,), generator=g, dtype=torch.int16)
        rlo = torch.randint(-(1 << 15), 1 << 15, (100003,), generator=g, dtype=torch.int16)
        rlo[::7] = -(1 << 15)   # 0x8000: the tie
        rtie = torch.randint(0, 256, ((100003 + 7) // 8,), generator=g, dtype=torch.uint8)
        got = split_master.decode(rp.view(torch.bfloat16), rlo, rtie)
        ref = ref_decode(rp.view(torch.bfloat16), rlo.to(torch.int32) & 0xFFFF,
                         unpack(rtie, rp.numel()))
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), isa


def test_a_nan_master_decodes_to_a_nan_whatever_its_low_half():
    bits = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7FC08000, 0x7F80FFFF, -0x007F0001],
                        dtype=torch.int32)
    m = bits.view(torch.float32)
    assert torch.isnan(m).all()
    assert torch.isnan(split_master.decode(*split_master.encode(m))).all()


def state(n, fmt, gen):
    """Moments after a few steps would do; zeros and nonzeros both matter little here:
    the step reads them as it reads any, and the split changes only the master."""
    if fmt == "8bit":
        blocks = (n + 255) // 256
        return {"m": torch.zeros(n, dtype=torch.uint8), "v": torch.zeros(n, dtype=torch.uint8),
                "ms": torch.zeros(blocks), "vs": torch.zeros(blocks)}
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    return {"m": (torch.randn(n, generator=gen) * 1e-3).to(dtype),
            "v": (torch.rand(n, generator=gen) * 1e-6).to(dtype),
            "vmax": (torch.rand(n, generator=gen) * 2e-6).to(dtype)}


@pytest.mark.parametrize("fmt,amsgrad", [("fp32", False), ("fp32", True), ("bf16", False),
                                         ("bf16", True), ("8bit", False)])   # (8-bit: no amsgrad)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_a_split_master_steps_as_its_fp32_master_bitwise(kernels, fmt, grad_dtype, amsgrad):
    n, cut = 70001, 65536   # two ranges: [0, cut) and the rest (first_indices), tails of 8
    gen = torch.Generator().manual_seed(1)
    master0 = torch.randn(n, generator=gen) * 0.02
    master0[:64] = torch.tensor([0.0, -0.0]).repeat(32)
    grads = [(torch.randn(n, generator=gen) * 1e-3).to(grad_dtype) for _ in range(3)]
    for isa in each_isa(kernels):
        results = []
        for split in (False, True):
            s = {k: v.clone() for k, v in state(n, fmt, torch.Generator().manual_seed(2)).items()}
            master = master0.clone()
            lp = torch.empty(n, dtype=torch.bfloat16)
            if split:
                lp, lo, tie = split_master.encode(master)
            for k, g in enumerate(grads):
                pieces = [(0, cut), (cut, n)]
                sl = [slice(a, b) for a, b in pieces]
                steps = [torch.tensor(float(k)) for _ in pieces]
                kw = dict(first_indices=[a for a, _ in pieces], grad_mul=1.0)
                if fmt == "8bit":
                    kw.update(exp_avg_scales=[s["ms"][a // 256:(b + 255) // 256] for a, b in pieces],
                              exp_avg_sq_scales=[s["vs"][a // 256:(b + 255) // 256]
                                                 for a, b in pieces])
                if split:
                    kw.update(master_los=[lo[x] for x in sl],
                              master_ties=[tie[a // 8:(b + 7) // 8] for a, b in pieces])
                kernels.adam_step(
                    [] if split else [master[x] for x in sl], [g[x] for x in sl],
                    [s["m"][x] for x in sl], [s["v"][x] for x in sl],
                    [s["vmax"][x] for x in sl] if amsgrad else [], [lp[x] for x in sl], steps,
                    1e-3, 0.9, 0.999, 1e-8, 0.1, True, False, 1.0, 2, **kw)
            if split:
                master = split_master.decode(lp, lo, tie)
            results.append((master, lp, s))
        (m0, lp0, s0), (m1, lp1, s1) = results
        assert torch.equal(m0.view(torch.int32), m1.view(torch.int32)), isa
        assert torch.equal(lp0.view(torch.int16), lp1.view(torch.int16)), isa
        for key in s0:
            assert torch.equal(s0[key].view(torch.uint8), s1[key].view(torch.uint8)), (isa, key)
        assert not torch.equal(m0, master0)   # it stepped


def test_bad_split_masters_are_refused_naming_them(kernels):
    n = 10
    p, lo, tie = split_master.encode(torch.randn(n))
    g = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)

    def step(**kw):
        args = dict(params=[], grads=[g], exp_avgs=[m], exp_avg_sqs=[v], max_exp_avg_sqs=[],
                    lp_params=[p], steps=[torch.tensor(0.0)], lr=1e-3, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False, grad_scale=1.0,
                    num_threads=1, master_los=[lo], master_ties=[tie])
        args.update(kw)
        kernels.adam_step(**args)

    with pytest.raises(ValueError, match="params must be empty"):
        step(params=[torch.zeros(n)])
    with pytest.raises(ValueError, match="needs lp_params"):
        step(lp_params=[])
    with pytest.raises(TypeError, match=r"lp_params\[0\] must be bfloat16"):
        step(lp_params=[p.half()])
    with pytest.raises(TypeError, match=r"master_los\[0\] must be int16"):
        step(master_los=[lo.float()])
    with pytest.raises(ValueError, match=r"master_ties\[0\] has 1 elements"):
        step(master_ties=[tie[:1]])
    with pytest.raises(ValueError, match="master_ties has 0 tensors"):
        step(master_ties=[])
    with pytest.raises(TypeError, match="master must be torch.float32"):
        split_master.encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="tie ceil"):
        kernels.split_master_decode(p, lo, tie[:1], torch.empty(n))
    with pytest.raises(ValueError, match="out must be contiguous"):
        split_master.decode(p, lo, tie, out=torch.empty(2 * n)[::2])
    step()   # and the well-formed call steps


def test_the_step_benchmark_runs_and_prints_every_variant():
    """bench/split_master_step.py at a toy size: a row per variant, format and master."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(repo / "bench" / "split_master_step.py"),
                          "--numel", "100003", "--rounds", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, cwd=repo)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[3:]]
    from offload_adam.kernel_step import kernels
    assert len(rows) == 4 * len(kernels().supported_isas()), out.stdout
    assert all(float(r[3]) > 0 for r in rows), out.stdout


def test_kernel_args_step_split_states_as_fp32_masters_bitwise():
    """kernel_step.KernelArgs, what every stepper calls the kernel through: records with a
    split master (param_state.ParamState's master_lo/master_tie, the bf16 param as the
    output) step bit for bit as records with the fp32 master, parts of a param included
    (first_index: the rounding's element indices, the tie bits' byte)."""
    from offload_adam.kernel_step import Hyper, KernelArgs
    from offload_adam.param_state import ParamState
    gen = torch.Generator().manual_seed(4)
    sizes, cut = [1000, 70001], 32768
    masters0 = [torch.randn(n, generator=gen) * 0.02 for n in sizes]
    grads = [[(torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16) for n in sizes]
             for _ in range(3)]
    hyper = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False,
                  maximize=False, decoupled_weight_decay=True)
    out = {}
    for split in (False, True):
        ms = [m.clone() for m in masters0]
        mom = [(torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16))
               for n in sizes]
        steps = [torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0.0)]
        if split:
            coded = [split_master.encode(m) for m in ms]
        lps = [c[0] for c in coded] if split else [torch.empty(n, dtype=torch.bfloat16)
                                                  for n in sizes]
        # pieces: param 0 whole; param 1 in two parts [0, cut) and [cut, n)
        pieces = [(0, 0, sizes[0]), (1, 0, cut), (1, cut, sizes[1])]
        for g in grads:
            args = KernelArgs()
            for k, (i, a, b) in enumerate(pieces):
                st = ParamState(steps[k], mom[i][0][a:b], mom[i][1][a:b])
                if split:
                    st.master_lo = coded[i][1][a:b]
                    st.master_tie = coded[i][2][a // 8:(b + 7) // 8]
                else:
                    st.master = ms[i][a:b]
                args.add(st, lps[i][a:b], a)
            args.run([g[i][a:b] for i, a, b in pieces], hyper, 1.0, 2)
        if split:
            ms = [split_master.decode(*c) for c in coded]
        out[split] = (ms, lps, mom)
    for x, y in zip(out[False][0] + out[False][1], out[True][0] + out[True][1]):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    for (a, b), (c, d) in zip(out[False][2], out[True][2]):
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(b.view(torch.uint8), d.view(torch.uint8))
    # one call's masters are all split or none; a split one needs its bf16 param
    lo_st = ParamState(torch.tensor(0.0), torch.zeros(8), torch.zeros(8),
                       master_lo=torch.zeros(8, dtype=torch.int16),
                       master_tie=torch.zeros(1, dtype=torch.uint8))
    args = KernelArgs()
    args.add(ParamState(torch.tensor(0.0), torch.zeros(8), torch.zeros(8), torch.zeros(8)),
             torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="all split or none"):
        args.add(lo_st, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 param as its high half"):
        KernelArgs().add(lo_st, torch.zeros(8, dtype=torch.float16))

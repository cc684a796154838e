"""Where each offloaded element lives (offload_adam/engine/layout.py): pieces,
buckets, host buffers."""
import torch

from offload_adam.engine.device import HostDevice
from offload_adam.engine.layout import (PACK_BELOW_BYTES, SPLIT_ALIGN, ParamRec,
                                        allocate_state, allocate_transfers, cut, make_buckets,
                                        state_roles)
from offload_adam.state_format import FLOAT32

BF16 = torch.bfloat16
HOST = HostDevice(torch.device("cpu"))


def rec(shape, dtype=BF16, group=0, position=0, contiguous=True):
    t = torch.zeros(shape, dtype=dtype)
    if not contiguous:
        t = t.t()
    return ParamRec(torch.nn.Parameter(t), group, position)


def test_a_large_param_is_cut_into_bucket_sized_pieces():
    r = rec((5 * SPLIT_ALIGN + 7,))
    pieces = cut(r, bucket_bytes=2 * SPLIT_ALIGN * 2)  # two chunks of bf16 per bucket
    assert [(p.start, p.stop) for p in pieces] == [
        (0, 2 * SPLIT_ALIGN), (2 * SPLIT_ALIGN, 4 * SPLIT_ALIGN), (4 * SPLIT_ALIGN, r.numel)]
    assert not any(p.packed for p in pieces)
    # never below one chunk, whatever the bucket size
    assert [p.numel for p in cut(rec((2 * SPLIT_ALIGN,)), bucket_bytes=10)] == [SPLIT_ALIGN] * 2


def test_small_params_are_packed_and_a_non_contiguous_one_is_whole():
    assert cut(rec((PACK_BELOW_BYTES // 2 - 1,)), 1 << 30)[0].packed
    assert not cut(rec((PACK_BELOW_BYTES // 2,)), 1 << 30)[0].packed
    odd = rec((3 * SPLIT_ALIGN, 2), contiguous=False)
    (piece,) = cut(odd, bucket_bytes=1024)
    assert not piece.packed and piece.numel == odd.numel
    t = torch.arange(6.0).view(2, 3).t()
    assert piece.of(t) is t  # its own shape: the device copies handle the strides


def test_buckets_follow_the_order_and_split_by_group_and_dtype():
    recs = [rec((100,), position=0), rec((100,), position=1),
            rec((100,), dtype=torch.float32, position=2), rec((100,), group=1, position=3),
            rec((100,), position=4)]
    pieces = [p for r in recs for p in cut(r, 1 << 30)]
    buckets = make_buckets(pieces, bucket_bytes=400)  # two bf16 params of 100
    assert [[recs.index(p.rec) for p in b.pieces] for b in buckets] == [[0, 1], [2], [3], [4]]
    assert all(p.bucket is b for b in buckets for p in b.pieces)


def test_host_buffers_are_aligned_apart_and_skewed():
    recs = [rec((1000,)), rec((3, 7)), rec((SPLIT_ALIGN * 3,))]
    state = allocate_state(recs, HOST, None, state_roles(FLOAT32, False))
    for r in recs:
        for role in ("master", "exp_avg", "exp_avg_sq"):
            view = getattr(r, role)
            assert view.shape == r.shape and view.dtype == torch.float32
            assert view.data_ptr() % 64 == 0
    starts = {role: a.data_ptr() % 4096 for role, a in state._arenas.items()}
    assert len(set(starts.values())) == len(starts)  # no two roles alias modulo a page
    for r in recs:
        r.pieces = cut(r, 1 << 20)
    buckets = make_buckets([p for r in recs for p in r.pieces], 1 << 20)
    transfers = allocate_transfers(buckets, HOST, None)
    ptrs = sorted((p.grad.data_ptr(), p.grad.data_ptr() + 2 * p.numel)
                  for b in buckets for p in b.pieces)
    assert all(a[1] <= b[0] for a, b in zip(ptrs, ptrs[1:]))  # no overlap
    assert transfers.nbytes() >= 2 * 2 * sum(r.numel for r in recs)  # grad + staging
    pieces = [p for b in buckets for p in b.pieces]
    assert all(p.staging is not None and p.staging.dtype == BF16 for p in pieces)


def test_a_buckets_packed_buffers_lie_side_by_side():
    """Grads come small, large, small, non-contiguous, small (hook order): the
    bucket's packed pieces' grad and staging buffers abut, no padding and no
    other piece between them, so that a pack is one copy of exactly their
    bytes (issue 25: a pack's span covered three weights' grads). An fp32
    packed piece is staged too: its pack goes back from there, not from
    masters spread over the state."""
    for dtype in (BF16, torch.float32):
        recs = [rec((100,), dtype), rec((PACK_BELOW_BYTES,), dtype), rec((7,), dtype),
                rec((3, 5), dtype, contiguous=False), rec((33,), dtype)]
        for r in recs:
            r.pieces = cut(r, 1 << 30)
        (bucket,) = make_buckets([p for r in recs for p in r.pieces], 1 << 30)
        allocate_transfers([bucket], HOST, None)
        packed = [p for p in bucket.pieces if p.packed]
        assert [p.rec for p in packed] == [recs[0], recs[2], recs[4]]
        for role in ("grad", "staging"):
            views = sorted((getattr(p, role) for p in packed), key=lambda v: v.data_ptr())
            ends = [v.data_ptr() + v.numel() * v.element_size() for v in views]
            assert ends[:-1] == [v.data_ptr() for v in views[1:]], (dtype, role)
        unpacked = [p for p in bucket.pieces if not p.packed]
        assert all(p.staging is not None for p in packed)
        assert all((p.staging is None) == (dtype == torch.float32) for p in unpacked)

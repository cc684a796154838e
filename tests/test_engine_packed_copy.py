"""One transfer of a list of tensors (offload_adam/engine/packed_copy.py): which
host bytes move through which temporary, and the copies that move them."""
import pytest
import torch

from offload_adam.engine.packed_copy import PACK_BELOW_BYTES, plan_copy, run_plan


def _plan(views):
    return plan_copy(views, [torch.zeros(v.shape) for v in views])


def test_abutting_small_views_share_one_temporary_of_exactly_their_bytes():
    base = torch.arange(100.0)
    views = [base[14:20], base[10:14], base[20:30]]   # side by side, listed out of order
    (run,) = _plan(views)
    assert run.items == (1, 0, 2) and run.offsets == (0, 4, 10)
    assert run.host.data_ptr() == base[10:].data_ptr() and run.host.numel() == 20


def test_a_gap_splits_a_pack_so_no_copy_moves_other_bytes():
    """base[8:40] is another buffer (a large grad between two packed ones): no
    copy's host side covers it, so no D2H writes it and no H2D reads it or
    allocates a temporary for it."""
    base = torch.arange(100.0)
    views = [base[41:50], base[0:4], base[40:41], base[4:8]]
    runs = _plan(views)
    assert [r.items for r in runs] == [(1, 3), (2, 0)]
    assert [(r.host.data_ptr(), r.host.numel()) for r in runs] == [
        (base.data_ptr(), 8), (base[40:].data_ptr(), 10)]


def test_large_strided_and_lone_pairs_go_straight():
    big = PACK_BELOW_BYTES // 4   # fp32 elements in PACK_BELOW_BYTES
    base = torch.zeros(2 * big + 40)
    strided = torch.zeros(6, 4).t()
    views = [base[:4], base[4:4 + big], base[4 + big:8 + big], base[100 + big:104 + big],
             strided]
    runs = _plan(views)
    assert all(not r.packed for r in runs) and sorted(r.items for r in runs) == [
        (0,), (1,), (2,), (3,), (4,)]
    assert next(r for r in runs if r.items == (4,)).host is strided
    with pytest.raises(ValueError, match="3 host tensors for 2 device tensors"):
        plan_copy(views[:3], views[:2])


@pytest.mark.parametrize("to_host", [True, False])
def test_the_copies_move_every_piece_and_no_other_byte(to_host):
    """Through the temporary (filled with NaN, as uninitialised memory): a
    gather and one copy to the host, or one copy and a scatter; a device
    tensor of any strides; the bytes between the runs untouched."""
    host = torch.full((40,), -1.0)
    views = [host[3:8], host[0:3], host[8:14], host[20:21]]
    device = [torch.arange(5.0), torch.arange(3.0) + 10,
              (torch.arange(6.0) + 20).view(3, 2).t(), torch.tensor([30.0])]
    if not to_host:
        for v, d in zip(views, device):
            v.copy_(d.reshape(-1))
            d.zero_()
    runs = plan_copy(views, device)
    assert [r.items for r in runs] == [(1, 0, 2), (3,)]
    run_plan(runs, views, device, to_host, non_blocking=False,
             empty=lambda like: torch.full(like.shape, float("nan"), dtype=like.dtype))
    for v, d in zip(views, device):
        assert torch.equal(v, d.reshape(-1))
    untouched = torch.cat([host[14:20], host[21:]])
    assert torch.equal(untouched, torch.full_like(untouched, -1.0))

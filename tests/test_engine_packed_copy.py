"""One transfer of a list of tensors (offload_adam/engine/packed_copy.py): the
plan of which bytes move through which temporary, and its copies."""
import torch

from offload_adam.engine.packed_copy import plan_copy, run_plan


def test_a_pack_covers_views_of_one_buffer():
    base = torch.arange(100.0)
    views = [base[10:14], base[40:41], base[20:30]]
    (run,) = plan_copy(views, [torch.zeros(v.shape) for v in views])
    assert run.host.data_ptr() == base[10:].data_ptr() and run.host.numel() == 31
    assert run.offsets == (0, 30, 10)
    for i, o in zip(run.items, run.offsets):
        assert torch.equal(run.host[o:o + views[i].numel()], views[i])

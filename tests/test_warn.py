"""Each warning names the user's line (warnings.warn's filename and lineno), whatever depth
of offload_adam, torch's optimizer wrappers and subclasses (AdamW over Adam) it came
from: the line a user reads first, and the one the default filter's once-per-location
bookkeeping keys on."""
import inspect
import warnings

import pytest
import torch

import offload_adam
from offload_adam.warn import warn


def _line_below() -> int:
    """The number of the line after the caller's."""
    return inspect.currentframe().f_back.f_lineno + 1


def test_step_in_backward_that_changes_nothing_names_the_users_line():
    p = torch.nn.Parameter(torch.zeros(4))   # fp32 in host memory: stepped in place
    with pytest.warns(UserWarning, match="none of these params is stepped") as said:
        line = _line_below()
        offload_adam.AdamW([p], step_in_backward=True)
    assert (said[0].filename, said[0].lineno) == (__file__, line)


def test_defer_blocks_without_streaming_names_the_users_line():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="nothing is deferred") as said:
        line = _line_below()
        offload_adam.AdamW([p], step_in_backward=True, defer_blocks=1)
    assert (said[0].filename, said[0].lineno) == (__file__, line)


def test_a_resume_with_no_step_names_the_users_line(kernels, tmp_path):
    p = torch.nn.Parameter(torch.zeros(64))
    with pytest.warns(RuntimeWarning, match="hold no completed step") as said:
        line = _line_below()
        opt = offload_adam.AdamW([p], state_dirs=[tmp_path], state_resume=True)
    assert (said[0].filename, said[0].lineno) == (__file__, line)
    opt.close()


def test_warn_called_from_user_code_names_its_line():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        line = _line_below()
        warn("from here", RuntimeWarning)
    assert (said[0].filename, said[0].lineno) == (__file__, line)

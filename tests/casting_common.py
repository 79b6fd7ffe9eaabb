"""Checks and constants shared by the tests/test_casting_*.py files (imported, not collected)."""
import pytest
import torch

import amp.casting

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# Tolerances of one low-precision rounding of inputs, weights and result, against fp32.
TOLERANCES = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def check_against_fp32(fn, x, in_dtype, expected_dtype, tolerances):
    """Run ``fn`` under the engine on ``x`` cast to ``in_dtype``; compare with plain fp32.

    Checks the output dtype, that the input gradient keeps the input dtype, and that output and
    gradient match ``fn`` run without casts on the fp32 input.
    """
    xi = x.detach().to(in_dtype).requires_grad_()
    y = fn(xi)
    assert y.dtype == expected_dtype
    y.backward(torch.ones_like(y))
    assert xi.grad.dtype == in_dtype
    with amp.casting.disable_casts():
        xr = xi.detach().float().requires_grad_()
        yr = fn(xr)
        yr.backward(torch.ones_like(yr))
    torch.testing.assert_close(y.float(), yr, **tolerances)
    torch.testing.assert_close(xi.grad.float(), xr.grad, **tolerances)

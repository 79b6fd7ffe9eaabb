"""Apex's test_promotion: mixed-type calls run in the widest type; in-place ops by spelling."""
import itertools

import pytest
import torch

import amp.casting
from casting_common import TOLERANCES


def _leaf(t, dtype):
    return t.detach().to(dtype, copy=True).requires_grad_()


def _pairs(low):
    return list(itertools.product((torch.float32, low), repeat=2))


@pytest.mark.parametrize("fn", [torch.atan2, torch.Tensor.atan2, torch.mul, torch.Tensor.mul],
                         ids=["torch.atan2", "Tensor.atan2", "torch.mul", "Tensor.mul"])
def test_binary_op_runs_in_widest_type(handle, low, device, fn):
    torch.manual_seed(0)
    a, b = torch.randn(8, device=device), torch.randn(8, device=device)
    for ta, tb in _pairs(low):
        xa, xb = _leaf(a, ta), _leaf(b, tb)
        y = fn(xa, xb)
        assert y.dtype == (torch.float32 if torch.float32 in (ta, tb) else low)
        y.backward(torch.ones_like(y))
        assert xa.grad.dtype == ta and xb.grad.dtype == tb
        ra, rb = _leaf(xa, torch.float32), _leaf(xb, torch.float32)
        yr = fn(ra, rb)
        yr.backward(torch.ones_like(yr))
        torch.testing.assert_close(y.float(), yr, **TOLERANCES[low])
        torch.testing.assert_close(xa.grad.float(), ra.grad, **TOLERANCES[low])
        torch.testing.assert_close(xb.grad.float(), rb.grad, **TOLERANCES[low])


def test_float_double_mix_promotes_to_double(handle, device):
    x, y = torch.randn(4, device=device), torch.randn(4, device=device, dtype=torch.float64)
    assert torch.atan2(x, y).dtype == torch.float64
    assert torch.addcmul(x, x, y).dtype == torch.float64


def test_half_bfloat16_mix_promotes_to_float(handle, device):
    x = torch.randn(4, device=device)
    assert torch.atan2(x.half(), x.bfloat16()).dtype == torch.float32


def test_cat_runs_in_widest_type(handle, low, device):
    parts = [_leaf(torch.randn(2, device=device), low) for _ in range(5)]
    assert torch.cat(parts).dtype == low
    wide = torch.randn(2, device=device).requires_grad_()
    y = torch.cat(parts + [wide])
    assert y.dtype == torch.float32
    y.sum().backward()
    assert all(p.grad.dtype == low for p in parts) and wide.grad.dtype == torch.float32
    assert torch.stack((parts[0], wide)).dtype == torch.float32


def test_inplace_exp_is_error_for_low_precision(handle, low, device):
    x = torch.randn(4, device=device)
    expected = x.exp()
    torch.testing.assert_close(x.clone().exp_(), expected)
    with pytest.raises(NotImplementedError, match="exp_"):
        x.to(low).exp_()
    with pytest.raises(NotImplementedError, match="exp_"):
        torch.exp_(x.to(low))


def test_inplace_add_keeps_self_type(handle, low, device):
    torch.manual_seed(0)
    a, b = torch.randn(8, device=device), torch.randn(8, device=device)
    for ta, tb in _pairs(low):
        xa, xb = _leaf(a, ta), _leaf(b, tb)
        y = xa.clone()
        y.add_(xb)
        assert y.dtype == ta
        with amp.casting.disable_casts():  # Apex: the other operand is cast to self's type
            torch.testing.assert_close(y, a.to(ta) + b.to(tb).to(ta))
        y.backward(torch.ones_like(y))
        assert xa.grad.dtype == ta and xb.grad.dtype == tb


def test_augmented_add_widens_and_rebinds(handle, low, device):
    x = torch.randn(4, device=device).to(low)
    before = x
    x += torch.ones(4, device=device)
    assert x.dtype == torch.float32 and x is not before
    torch.testing.assert_close(x, before.float() + 1)


def test_zero_dim_float_widens_low_precision_tensor(handle, low, device):
    # torch alone would keep `low` here (0-dim operands do not widen); amp widens, as Apex did.
    x, scale = torch.randn(4, device=device).to(low), torch.tensor(2.0, device=device)
    assert (x * scale).dtype == torch.float32
    assert torch.add(x, scale).dtype == torch.float32
    assert (x * scale.to(low)).dtype == low

"""Apex's test_cache and the torch 2.x weight-cast cache: one cast per weight per iteration."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp.casting
from casting_common import TOLERANCES


class LowPrecisionUse(nn.Module):
    """The weight is used twice by a low-precision function (a cache hit in fp32)."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 16).view(4, 4).to(dtype))

    def forward(self, x):
        return x.mm(self.weight).mm(self.weight).sum()


class Fp32Use(nn.Module):
    """The weight goes through fp32-list functions twice."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 16).view(4, 4).to(dtype))

    def forward(self, x):
        return (torch.pow(x * self.weight, 2) + torch.pow(self.weight, 2)).sum()


class PromoteUse(nn.Module):
    """The weight goes through a chain of promote functions."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 16).view(4, 4).to(dtype))

    def forward(self, x):
        return (x * self.weight * self.weight).sum()


def _reference_grad(model, x):
    with amp.casting.disable_casts():
        w = model.weight.detach().float().requires_grad_()
        clone = type(model)(torch.float32)
        clone.weight = nn.Parameter(w)
        clone(x.float()).backward()
    return clone.weight.grad


def _train_step(model, x, handle, low):
    model.weight.grad = None
    model(x).backward()
    assert model.weight.grad.dtype == model.weight.dtype
    torch.testing.assert_close(model.weight.grad.float(), _reference_grad(model, x),
                               **TOLERANCES[low])
    handle._clear_cache()  # as amp.scale_loss does at exit


@pytest.mark.parametrize("module", [LowPrecisionUse, Fp32Use, PromoteUse])
@pytest.mark.parametrize("param_dtype", ["fp32", "low"])
def test_train_eval_train(handle, low, device, module, param_dtype):
    model = module(torch.float32 if param_dtype == "fp32" else low).to(device)
    x = torch.linspace(-1, 1, 16, device=device).view(4, 4)
    _train_step(model, x, handle, low)
    with torch.no_grad():
        model(x)  # fills the cache with copies that carry no gradient
    _train_step(model, x, handle, low)
    _train_step(model, x, handle, low)


def test_weight_used_twice_is_cast_once(low, device, fresh_state, caplog):
    amp.casting.init(patch_type=low, verbose=True)
    w = nn.Parameter(torch.randn(4, 4, device=device))
    x = torch.randn(4, 4, device=device).to(low)
    with caplog.at_level(logging.INFO, logger="amp"):
        F.linear(F.linear(x, w), w)
    assert caplog.messages == [f"Float->{amp.casting._cast.TYPE_NAMES[low]} (linear)"]


def test_cached_gradient_equals_cast_at_every_use(low, device, fresh_state):
    # Small integers: every product and sum is exact in fp16 and bf16, so any difference would
    # come from the cache, not from rounding.
    torch.manual_seed(0)
    w0 = torch.randint(-2, 3, (4, 4), device=device).float()
    x = torch.randint(-2, 3, (4, 4), device=device).float()
    grads = []
    for caching in (True, False):
        handle = amp.casting.init(patch_type=low, enable_caching=caching)
        w = nn.Parameter(w0.clone())
        x.mm(w).mm(w).float().sum().backward()
        assert bool(handle.cache) == caching
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])
    torch.testing.assert_close(grads[0], torch.func.grad(lambda v: x.mm(v).mm(v).sum())(w0))


def test_inplace_update_without_clear_is_not_stale(handle, low, device):
    w = nn.Parameter(torch.ones(2, 2, device=device))
    x = torch.ones(2, 2, device=device)
    assert x.mm(w).float().sum().item() == 8
    with torch.no_grad():
        w.mul_(2)  # an optimizer step that no scale_loss exit followed
    assert x.mm(w).float().sum().item() == 16


def test_inference_mode_copies_are_not_cached(handle, device):
    w = nn.Parameter(torch.ones(2, 2, device=device))
    with torch.inference_mode():
        torch.ones(2, 2, device=device).mm(w)
    assert not handle.cache
    x = torch.ones(2, 2, device=device)
    x.mm(w).float().sum().backward()
    assert torch.equal(w.grad, torch.full((2, 2), 2.0, device=device))


def test_clear_cache_empties_it(handle, device):
    w = nn.Parameter(torch.ones(2, 2, device=device))
    torch.ones(2, 2, device=device).mm(w)
    assert w in handle.cache
    handle._clear_cache()
    assert not handle.cache

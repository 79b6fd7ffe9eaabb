"""Apex's test_basic_casts: which functions run in low precision, fp32, or the input's type."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp.casting
from casting_common import TOLERANCES, check_against_fp32


def _inputs(low, *shape, device):
    torch.manual_seed(0)
    return torch.randn(*shape, device=device), (torch.float32, low)


def test_linear_module_is_low_precision(handle, low, device):
    x, dtypes = _inputs(low, 4, 8, device=device)
    lin = nn.Linear(8, 6).to(device)
    for dt in dtypes:
        check_against_fp32(lin, x, dt, low, TOLERANCES[low])


def test_functional_linear_with_kwargs_is_low_precision(handle, low, device):
    x, dtypes = _inputs(low, 4, 8, device=device)
    w, b = torch.randn(6, 8, device=device), torch.randn(6, device=device)
    for dt in dtypes:
        check_against_fp32(lambda t: F.linear(t, weight=w, bias=b), x, dt, low, TOLERANCES[low])


def test_conv2d_is_low_precision(handle, low, device):
    x, dtypes = _inputs(low, 2, 3, 8, 8, device=device)
    conv = nn.Conv2d(3, 4, 3).to(device)
    for dt in dtypes:
        check_against_fp32(conv, x, dt, low, TOLERANCES[low])
        check_against_fp32(lambda t: F.conv2d(t, conv.weight), x, dt, low, TOLERANCES[low])


def test_bmm_is_low_precision_on_every_build(handle, low, device):
    x, dtypes = _inputs(low, 2, 4, 4, device=device)
    for dt in dtypes:
        check_against_fp32(lambda t: torch.bmm(t, t), x, dt, low, TOLERANCES[low])


def test_scaled_dot_product_attention_is_low_precision_with_its_float_mask(handle, low, device):
    x, dtypes = _inputs(low, 2, 3, 5, 8, device=device)
    mask = torch.randn(5, 5, device=device)
    for dt in dtypes:
        check_against_fp32(lambda t: F.scaled_dot_product_attention(t, t, t, attn_mask=mask),
                           x, dt, low, TOLERANCES[low])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_multihead_attention_with_a_mask_runs_in_low_precision(handle, low, device, mask_dtype):
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True).to(device)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool, device=device), 1)
    mask = causal if mask_dtype is torch.bool else torch.zeros(5, 5, device=device).masked_fill(
        causal, float("-inf"))
    x = torch.randn(2, 5, 8, device=device)
    check_against_fp32(lambda t: attention(t, t, t, attn_mask=mask, need_weights=False)[0],
                       x, torch.float32, low, TOLERANCES[low])


def test_softmax_is_float(handle, low, device):
    x, dtypes = _inputs(low, 4, 8, device=device)
    for dt in dtypes:
        check_against_fp32(nn.Softmax(dim=1), x, dt, torch.float32, TOLERANCES[low])
        check_against_fp32(lambda t: F.softmax(t, dim=1), x, dt, torch.float32, TOLERANCES[low])


def test_group_norm_is_float(handle, low, device):
    x, dtypes = _inputs(low, 2, 4, 5, device=device)
    gn = nn.GroupNorm(2, 4).to(device)
    for dt in dtypes:
        check_against_fp32(gn, x, dt, torch.float32, TOLERANCES[low])


def test_mse_loss_is_float(handle, low, device):
    x, dtypes = _inputs(low, 4, 8, device=device)
    target = torch.randn(4, 8, device=device)
    for dt in dtypes:
        check_against_fp32(lambda t: nn.MSELoss()(t, target), x, dt, torch.float32,
                           TOLERANCES[low])


def test_relu_matches_input(handle, low, device):
    x, dtypes = _inputs(low, 4, 8, device=device)
    for dt in dtypes:
        check_against_fp32(nn.ReLU(), x, dt, dt, TOLERANCES[low])


def test_batch_norm_matches_input(handle, low, device):
    x, dtypes = _inputs(low, 2, 3, 4, 4, device=device)
    bn = nn.BatchNorm2d(3).to(device)
    for dt in dtypes:
        check_against_fp32(bn, x, dt, dt, TOLERANCES[low])
        bn.eval()
        with torch.no_grad():
            assert bn(x.to(dt)).dtype == dt
            assert F.batch_norm(x.to(dt), bn.running_mean, bn.running_var).dtype == dt
        bn.train()


def test_matmul_method_and_operator_are_low_precision(handle, low, device):
    x, dtypes = _inputs(low, 4, 4, device=device)
    other = torch.randn(4, 4, device=device)
    for dt in dtypes:
        check_against_fp32(lambda t: t.matmul(other), x, dt, low, TOLERANCES[low])
        check_against_fp32(lambda t: other.matmul(t), x, dt, low, TOLERANCES[low])
        check_against_fp32(lambda t: t @ other, x, dt, low, TOLERANCES[low])
        check_against_fp32(lambda t: other @ t, x, dt, low, TOLERANCES[low])


def test_pow_method_and_operator_are_float(handle, low, device):
    x, dtypes = _inputs(low, 4, 4, device=device)
    for dt in dtypes:
        check_against_fp32(lambda t: t.pow(2.0), x, dt, torch.float32, TOLERANCES[low])
        check_against_fp32(lambda t: t ** 2.0, x, dt, torch.float32, TOLERANCES[low])


def test_sum_is_float(handle, low, device):
    x, dtypes = _inputs(low, 4, 4, device=device)
    for dt in dtypes:
        check_against_fp32(lambda t: t.sum(), x, dt, torch.float32, TOLERANCES[low])


def test_cpu_is_float(handle, low, device):
    x = torch.randn(4, device=device)
    for dt in (torch.float32, low):
        y = x.to(dt).cpu()
        assert y.dtype == torch.float32 and y.device.type == "cpu"


def test_binary_cross_entropy_raises_by_default(handle, low, device):
    p = torch.rand(4, device=device).to(low)
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(p, torch.ones_like(p))
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        nn.BCELoss()(p, torch.ones_like(p))


def test_binary_cross_entropy_is_float_with_allow_banned(low, device, fresh_state):
    amp.casting.init(patch_type=low, allow_banned=True)
    p = torch.rand(4, device=device)
    for dt in (torch.float32, low):
        check_against_fp32(lambda t: F.binary_cross_entropy(t, torch.ones_like(t)),
                           p * 0.8 + 0.1, dt, torch.float32, TOLERANCES[low])

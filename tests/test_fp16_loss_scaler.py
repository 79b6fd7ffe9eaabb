"""fp16_utils' legacy LossScaler and DynamicLossScaler keep their scales finite, with finite inverses."""
import pytest
import torch

from fp16_utils import DynamicLossScaler, LossScaler

FP32_MAX = torch.finfo(torch.float32).max


@pytest.mark.filterwarnings("ignore::fp16_utils.DeprecatedFeatureWarning")
@pytest.mark.parametrize("make,name", [
    (lambda: LossScaler(1e-46), "scale"),
    (lambda: LossScaler(1e39), "scale"),
    (lambda: DynamicLossScaler(init_scale=1e-46), "init_scale"),
    (lambda: DynamicLossScaler(init_scale=1e39), "init_scale"),
])
def test_a_scale_outside_fp32s_normal_range_is_rejected_naming_it(make, name):
    with pytest.raises(ValueError, match=f"{name} must be in \\[2\\*\\*-126"):
        make()


def test_growth_stops_at_fp32s_largest_number_and_one_overflow_brings_the_scale_back():
    scaler = DynamicLossScaler(init_scale=2.0**126, scale_window=1)
    expected = 2.0**126
    for _ in range(1100):  # Apex's scale reached Python's inf here, and inf / 2 stays inf
        scaler.update_scale(False)
        expected = min(expected * 2, FP32_MAX)
        assert scaler.loss_scale == expected
    assert torch.isfinite(torch.ones(1) * scaler.loss_scale).all()
    scaler.update_scale(True)
    assert scaler.loss_scale == FP32_MAX / 2

"""A loss scaler's state on the device of its gradients: the scale and its counters, updated there.

The scale, its inverse, the growth and hysteresis trackers and the overflow flag are 1-element
tensors, so that one kernel (``update_scale_hysteresis``) decides the skip and updates the scale
without synchronising with the host. They are made on the CPU, and moved where the gradients are
when the scaler first meets them.
"""
from __future__ import annotations

import torch

from amp.multi_tensor_apply import update_scale_hysteresis

from ._host_scale import as_fp32

__all__ = ["DeviceScale"]


class DeviceScale:
    """The tensors of one scaler, all on ``device`` (None until ``place`` first moves them)."""

    def __init__(self, initial: float, hysteresis: int) -> None:
        self.device: torch.device | None = None
        self.scale = torch.full((1,), initial, dtype=torch.float32)
        # 1 / scale, divided in fp64 and rounded to fp32 (see LossScaler._ratio), kept beside the
        # scale by every write so that unscaling needs no op to compute it.
        self.inv_scale = torch.full((1,), 1.0 / as_fp32(initial), dtype=torch.float32)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32)
        self.hysteresis_tracker = torch.full((1,), hysteresis, dtype=torch.int32)
        self.overflow = torch.zeros(1, dtype=torch.float32)

    def place(self, device: torch.device | str) -> bool:
        """Keep the state on ``device``, moving it there if it lives elsewhere; whether it moved."""
        device = torch.device(device)
        if device == self.device:
            return False
        self.scale = self.scale.to(device)
        self.inv_scale = self.inv_scale.to(device)
        self.growth_tracker = self.growth_tracker.to(device)
        self.hysteresis_tracker = self.hysteresis_tracker.to(device)
        self.overflow = self.overflow.to(device)
        self.device = self.scale.device
        return True

    def write(self, value: float) -> None:
        self.scale.fill_(value)
        self.inv_scale.fill_(1.0 / as_fp32(value))

    def update(self, growth_factor: float, backoff_factor: float, growth_interval: int, hysteresis: int,
               scale_range: tuple[float, float]) -> torch.Tensor:
        """Update the scale from the overflow flag; returns 1.0 (skip this step) or 0.0, on the device."""
        should_skip = torch.empty(1, dtype=torch.float32, device=self.scale.device)
        # One call (one kernel) does it all: the step, the clamp into the range (the host keeps
        # the scale within it, so clamping what the update did suffices), 1/scale for the next
        # unscale, and the skip decision.
        update_scale_hysteresis(self.scale, self.growth_tracker, self.hysteresis_tracker, self.overflow,
                                growth_factor, backoff_factor, growth_interval, hysteresis, *scale_range,
                                self.inv_scale, should_skip)
        return should_skip

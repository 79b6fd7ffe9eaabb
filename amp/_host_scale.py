"""What the host knows about a loss scale that lives on the device, learnt without waiting for it.

After each update a non-blocking copy of the scale goes to (pinned) host memory; once it has
landed (a CUDA event says so, queried, never waited for) its value is known. Aged by the updates
since, it bounds the scale from below, because an update multiplies the scale by
``backoff_factor`` at the least; the bound tells ``LossScaler`` when unscaling cannot overflow.
From each value it learns, the host also knows whether the scale sits at a floor below 1
(``at_floor``), and it warns, once, when the scale fell below 1.
"""
from __future__ import annotations

import math
import struct
import warnings
from typing import Any

import torch

__all__ = ["HostScale", "UNDERFLOW_WARNING_SCALE", "as_fp32"]

# Below a scale of 1 the scaler shrinks gradients instead of protecting them: fp16 gradients
# smaller than 2**-24 / scale flush to zero. This is warned about once per scaler.
UNDERFLOW_WARNING_SCALE = 1.0


def as_fp32(value: float) -> float:
    """``value`` rounded to fp32 as ``LossScaler._ratio`` rounds the kernels' factors (inf if too large)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


class HostScale:
    """The host's view of one scaler's scale: the lagged copy, the floor it watches, the warning.

    ``floor`` is the scale's lower bound (``min_loss_scale``); ``dynamic`` says whether the scale
    can move at all.
    """

    def __init__(self, value: float, floor: float, dynamic: bool) -> None:
        self.value, self.at_update = value, 0
        self.floor, self.dynamic = floor, dynamic
        self.warned_low = False
        # Whether the host last saw the scale sitting at a floor below 1 (``LossScaler.stuck_at_floor``).
        self.at_floor = False
        self.place(torch.device("cpu"))

    def place(self, device: torch.device) -> None:
        self.device = device
        on_cuda = device.type == "cuda"
        # On the CPU the scale itself is host memory: it is read in place, nothing is copied.
        self.buffer = torch.zeros(1, dtype=torch.float32, pin_memory=True) if on_cuda else None
        self.copied = torch.cuda.Event() if on_cuda else None
        self.pending_at: int | None = None
        # What poll reads: a numpy view, made once, of the buffer (CUDA) or of the scale (CPU).
        self.source = self.buffer
        self.view = self.buffer.numpy() if self.buffer is not None else None

    def set(self, value: float, updates: int) -> None:
        """The host wrote ``value`` itself: known exactly, and any copy in flight is stale."""
        self.value, self.at_update, self.pending_at = value, updates, None
        # The device clamps to the floor rounded to fp32 (a floor of 0.1 is 0.10000000149...).
        self.at_floor = self.dynamic and self.floor < UNDERFLOW_WARNING_SCALE and value <= as_fp32(self.floor)

    def read(self, value: float, updates: int) -> None:
        """The host read ``value`` from the device (a sync): known exactly."""
        self.set(value, updates)
        self._warn_if_low(value)

    def enqueue(self, scale: torch.Tensor, updates: int) -> None:
        if self.copied is None:
            if scale is not self.source:
                self.source, self.view = scale, scale.numpy()
        else:
            assert self.buffer is not None  # made with the event
            self.buffer.copy_(scale, non_blocking=True)
            # The copy runs on the scale's device's stream, which need not be the current device's.
            self.copied.record(torch.cuda.current_stream(scale.device))
        self.pending_at = updates

    def poll(self) -> None:
        """Take in the copy in flight if it has landed."""
        if self.pending_at is None or (self.copied is not None and not self.copied.query()):
            return
        assert self.view is not None  # a copy is pending, so there is something to read
        self.read(float(self.view[0]), self.pending_at)

    def inverse_bound(self, updates: int, backoff_factor: float) -> float:
        """An upper bound on 1/scale after ``updates`` updates, known on the host without a sync."""
        self.poll()
        lower = max(self.floor, self.value * backoff_factor ** (updates - self.at_update))
        # Rounding is monotonic: a scale at or above the bound has an fp32 inverse at or below this.
        return as_fp32(1.0 / lower)

    def _warn_if_low(self, value: float) -> None:
        if value < UNDERFLOW_WARNING_SCALE and not self.warned_low:
            self.warned_low = True
            warnings.warn(
                f"amp: the dynamic loss scale fell to {value!r}, below {UNDERFLOW_WARNING_SCALE}: gradients are "
                f"now scaled down, and fp16 gradients smaller than 2**-24 / scale flush to zero "
                f"(the floor is min_loss_scale={self.floor!r}). The gradients overflow even "
                "unscaled: look for an inf/NaN or an exploding value in the forward pass or the loss, "
                "or train in bfloat16 (opt_level O4/O5)."
            )

    def __getstate__(self) -> dict[str, Any]:
        # CUDA events cannot be copied or pickled: a copy gets its own buffer and event instead.
        return {"value": self.value, "at_update": self.at_update, "floor": self.floor, "dynamic": self.dynamic,
                "warned_low": self.warned_low, "at_floor": self.at_floor, "device": self.device}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.place(state["device"])

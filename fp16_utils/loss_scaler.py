"""The legacy loss scalers of ``fp16_utils``: static ``LossScaler`` and ``DynamicLossScaler``.

``FP16_Optimizer`` does not use these (it uses ``amp.scaler.LossScaler``, as Apex did); they are
kept for hand-written loops that scale, check and update the scale themselves.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

import torch

from ._deprecation import deprecated_warning
from .fp16util import to_python_float  # noqa: F401  (Apex's module held it too)

__all__ = ["LossScaler", "DynamicLossScaler"]

_FP32 = torch.finfo(torch.float32)


def _check_positive_number(value: Any, name: str, where: str, minimum: float = 0.0,
                           inclusive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{where}: {name} must be a finite real number, got {value!r}.")
    if value < minimum or (value == minimum and not inclusive):
        bound = ">=" if inclusive else ">"
        raise ValueError(f"{where}: {name} must be {bound} {minimum}, got {value!r}.")


def _is_integer(value: object) -> bool:
    # A function, not an inline isinstance: type checkers take an int for never a numbers.Integral.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_scale(value: Any, name: str, where: str) -> None:
    """A scale outside fp32's normal range scales the loss to inf, or unscales by an infinite 1/scale."""
    _check_positive_number(value, name, where)
    if not _FP32.tiny <= value <= _FP32.max:
        raise ValueError(f"{where}: {name} must be in [2**-126, {_FP32.max:.6g}], so that it and its "
                         f"reciprocal are finite in fp32, got {value!r}.")


class _ScalerBase:
    """What both scalers share: scaling the loss, the grads of a backward hook, and the scale."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: torch.nn.Module, grad_in: Iterable[torch.Tensor],
                       grad_out: Any) -> tuple[torch.Tensor, ...]:
        """A module backward hook that multiplies the incoming grads by the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Run ``(loss * scale).backward()``; the grads come out multiplied by the scale."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward expects the loss tensor, got {type(loss).__name__}.")
        scaled_loss = loss * self.loss_scale
        scaled_loss.backward(retain_graph=retain_graph)


class LossScaler(_ScalerBase):
    """A static loss scale: ``cur_scale`` never changes and overflow is never reported."""

    def __init__(self, scale: float = 1) -> None:
        deprecated_warning("fp16_utils.LossScaler is deprecated and will be removed. "
                           "Use amp.initialize and amp.scale_loss instead.")
        _check_scale(scale, "scale", "LossScaler")
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass


class DynamicLossScaler(_ScalerBase):
    """A loss scale that is divided by ``scale_factor`` (never below 1) when the grads overflow,
    and multiplied by it (never above fp32's largest number) after ``scale_window`` iterations
    without overflow. Apex let it grow to inf in a run whose grads stayed zero, and inf / 2 is
    still inf: every later step overflowed.

    As in Apex the first growth comes at iteration ``scale_window - 1`` (counting from 0), because
    the last overflow is taken to have happened at iteration -1.
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2., scale_window: int = 1000) -> None:
        where = "DynamicLossScaler"
        _check_scale(init_scale, "init_scale", where)
        _check_positive_number(scale_factor, "scale_factor", where, minimum=1.0)
        if not _is_integer(scale_window):
            raise TypeError(f"{where}: scale_window must be an int, got {scale_window!r}.")
        if scale_window < 1:
            raise ValueError(f"{where}: scale_window must be >= 1 (iterations between growths), "
                             f"got {scale_window}.")
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """True if any param's grad holds an inf or a NaN."""
        return any(p.grad is not None and DynamicLossScaler._has_inf_or_nan(p.grad) for p in params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        # isfinite rather than Apex's float sum: a sum of large finite bf16 values can itself
        # overflow fp32 and would be mistaken for an overflow of the grads.
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale = min(self.cur_scale * self.scale_factor, _FP32.max)
        self.cur_iter += 1

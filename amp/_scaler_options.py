"""A ``LossScaler``'s options, checked once, where they become an object (``ScalerOptions``).

Two options have two names, Apex's and torch's: ``scale_factor`` / ``growth_factor`` and
``scale_window`` / ``growth_interval``; at most one of each pair may be given, and errors name the
option as it was passed. Constructing the options has no side effect, so it also serves to
validate them.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

__all__ = ["DEFAULT_MIN_LOSS_SCALE", "ScalerOptions", "FP32", "INT32", "in_range", "is_int", "require"]

FP32 = torch.finfo(torch.float32)
# The trackers are int32 device tensors.
INT32 = torch.iinfo(torch.int32)

# The floor of a dynamic scale when ``min_loss_scale`` is None. Without a floor, overflows that are
# not consecutive (so never stopped by ``max_consecutive_skips``) halve the scale into fp32's
# denormals, where 1/scale is inf and unscaling turns every gradient into inf or NaN (GradScaler
# collapses the same way). 2**-24 is fp16's smallest subnormal: at this scale only gradients of
# about 1 or more survive in fp16, so a smaller scale rescues nothing, and its reciprocal 2**24
# keeps every unscaled fp16 gradient below 2**40, far inside fp32.
DEFAULT_MIN_LOSS_SCALE = 2.0**-24

_WHERE = "LossScaler"
_SCALES = f"a number in [2**-126, {FP32.max:.6g}] (finite in fp32, with a finite reciprocal)"


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require(ok: bool, where: str, name: str, valid: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{where}: {name} must be {valid}, got {value!r}")


def in_range(value: Any, low: float, high: float) -> bool:
    # Also False for NaN, inf and non-numbers.
    return _is_real(value) and low <= value <= high


def _one_name(apex_name: str, apex_value: Any, torch_name: str, torch_value: Any,
              default: float) -> tuple[str, Any]:
    """``(name, value)`` of an option that has Apex's name and torch's name; at most one may be given."""
    if apex_value is not None and torch_value is not None:
        raise TypeError(f"{_WHERE}: {torch_name} and {apex_name} are the same option (torch's and Apex's "
                        "name for it); pass only one of them")
    if apex_value is not None:
        return apex_name, apex_value
    return torch_name, default if torch_value is None else torch_value


@dataclasses.dataclass(frozen=True)
class ScalerOptions:
    """``LossScaler``'s arguments as given, checked; ``__post_init__`` resolves the fields below them.

    See ``LossScaler`` for what each option means.
    """

    loss_scale: float | str
    init_scale: float = 2.0**16
    scale_factor: float | None = None
    scale_window: int | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float | None = 2.0**24
    growth_factor: float | None = None
    growth_interval: int | None = None
    backoff_factor: float | None = None
    hysteresis: int = 1
    # Resolved: the growth factor and interval under either name, the backoff factor, where the
    # scale is kept ([floor, cap] for a dynamic scale), and the first scale.
    dynamic: bool = dataclasses.field(init=False)
    growth: float = dataclasses.field(init=False)
    interval: int = dataclasses.field(init=False)
    backoff: float = dataclasses.field(init=False)
    scale_range: tuple[float, float] = dataclasses.field(init=False)
    initial_scale: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        factor_name, factor = _one_name("scale_factor", self.scale_factor, "growth_factor",
                                        self.growth_factor, 2.0)
        interval_name, interval = _one_name("scale_window", self.scale_window, "growth_interval",
                                            self.growth_interval, 2000)
        loss_scale, init_scale, backoff_factor = self.loss_scale, self.init_scale, self.backoff_factor
        min_loss_scale, max_loss_scale, hysteresis = self.min_loss_scale, self.max_loss_scale, self.hysteresis
        dynamic = loss_scale == "dynamic"
        if not dynamic:
            require(in_range(loss_scale, FP32.tiny, FP32.max), _WHERE, "loss_scale", f'"dynamic" or {_SCALES}',
                    loss_scale)
        require(in_range(init_scale, FP32.tiny, FP32.max), _WHERE, "init_scale", _SCALES, init_scale)
        require(_is_real(factor) and 1 < factor <= FP32.max, _WHERE, factor_name, "a finite number > 1", factor)
        if backoff_factor is None:
            backoff_factor = 1.0 / factor
        require(_is_real(backoff_factor) and 0 < backoff_factor < 1, _WHERE, "backoff_factor", "in (0, 1)",
                backoff_factor)
        require(is_int(interval) and 1 <= interval <= INT32.max, _WHERE, interval_name,
                f"an int in [1, {INT32.max}]", interval)
        require(is_int(hysteresis) and 1 <= hysteresis <= INT32.max, _WHERE, "hysteresis",
                f"an int in [1, {INT32.max}]", hysteresis)
        require(min_loss_scale is None or in_range(min_loss_scale, FP32.tiny, FP32.max), _WHERE,
                "min_loss_scale", f"None (a floor of {DEFAULT_MIN_LOSS_SCALE!r}, 2**-24) or {_SCALES}",
                min_loss_scale)
        require(max_loss_scale is None or in_range(max_loss_scale, FP32.tiny, FP32.max), _WHERE,
                "max_loss_scale", f"None (no cap below fp32's largest number) or {_SCALES}", max_loss_scale)
        floor = DEFAULT_MIN_LOSS_SCALE if min_loss_scale is None else float(min_loss_scale)
        cap = FP32.max if max_loss_scale is None else float(max_loss_scale)
        if floor > cap:
            if min_loss_scale is None:
                raise ValueError(f"{_WHERE}: max_loss_scale ({max_loss_scale}) is below the default floor "
                                 f"min_loss_scale={DEFAULT_MIN_LOSS_SCALE!r} (2**-24); pass a smaller "
                                 "min_loss_scale as well")
            raise ValueError(f"{_WHERE}: min_loss_scale ({min_loss_scale}) must not exceed "
                             f"max_loss_scale ({max_loss_scale})")
        if dynamic:
            scale_range = (floor, cap)
            initial = min(max(float(init_scale), floor), cap)
        else:
            scale_range = (FP32.tiny, FP32.max)
            initial = float(loss_scale)
        for name, value in (("dynamic", dynamic), ("growth", float(factor)), ("interval", interval),
                            ("backoff", float(backoff_factor)), ("scale_range", scale_range),
                            ("initial_scale", initial)):
            object.__setattr__(self, name, value)

    def range_text(self) -> str:
        """What a scale must be, for an error message."""
        low, high = self.scale_range
        if self.dynamic:
            return f"a number in [{low!r}, {high!r}] (this scaler's min_loss_scale and max_loss_scale)"
        return f"a number in [2**-126, {high:.6g}] (finite in fp32, with a finite reciprocal)"

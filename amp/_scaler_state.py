"""Checking a ``LossScaler`` state dict against the scaler that is to load it.

Everything is validated before anything changes: a rejected dict leaves the scaler as it was.
Apex's two-key dicts (``loss_scale``, ``unskipped``) are accepted too.
"""
from __future__ import annotations

from typing import Any

from ._scaler_options import INT32, ScalerOptions, in_range, is_int, require

__all__ = ["STATE_KEYS", "checked_state"]

STATE_KEYS = ("loss_scale", "unskipped", "hysteresis_tracker", "dynamic")


def checked_state(state_dict: dict[str, Any], options: ScalerOptions) -> tuple[float, int, int]:
    """``(loss_scale, unskipped, hysteresis_tracker)`` of ``state_dict``, checked against a scaler of
    ``options``; an Apex dict's hysteresis tracker restarts at ``hysteresis``."""
    where = "LossScaler.load_state_dict"
    if not isinstance(state_dict, dict):
        raise TypeError(f"{where} expects a dict, got {type(state_dict).__name__}")
    unexpected = sorted(set(state_dict) - set(STATE_KEYS))
    missing = [key for key in ("loss_scale", "unskipped") if key not in state_dict]
    if unexpected or missing:
        raise ValueError(
            f"{where}: unexpected keys {unexpected}, missing keys {missing}; "
            f"expected a dict from LossScaler.state_dict() with keys {list(STATE_KEYS)}"
        )
    loss_scale = state_dict["loss_scale"]
    unskipped = state_dict["unskipped"]
    hysteresis_tracker = state_dict.get("hysteresis_tracker", options.hysteresis)
    dynamic = state_dict.get("dynamic", options.dynamic)

    if "dynamic" in state_dict:
        require(isinstance(dynamic, bool), where, "dynamic", "a bool", dynamic)
    if dynamic != options.dynamic:
        kinds = {True: "dynamic", False: "static"}
        raise ValueError(
            f"{where}: the state was saved from a {kinds[dynamic]} scaler but this "
            f"scaler is {kinds[options.dynamic]}; construct it with the same loss_scale setting"
        )
    low, high = options.scale_range
    require(in_range(loss_scale, low, high), where, "loss_scale", options.range_text(), loss_scale)
    # A static scaler counts without bound (as Apex's did); a dynamic one restarts at the interval.
    interval = options.interval
    most = INT32.max if not options.dynamic else interval - 1
    require(is_int(unskipped) and 0 <= unskipped <= most, where, "unskipped",
            f"an int in [0, {most}] (clean steps since the last growth, below this scaler's "
            f"growth_interval={interval}; resume with the saved run's growth_interval)",
            unskipped)
    # The tracker counts down from hysteresis, one per consecutive overflow.
    hysteresis = options.hysteresis
    require(is_int(hysteresis_tracker) and INT32.min <= hysteresis_tracker <= hysteresis, where,
            "hysteresis_tracker", f"an int in [{INT32.min}, {hysteresis}] (at most this scaler's "
            "hysteresis)", hysteresis_tracker)
    return float(loss_scale), unskipped, hysteresis_tracker

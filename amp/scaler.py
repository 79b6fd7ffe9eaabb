"""The loss scaler behind ``amp.scale_loss``."""
from __future__ import annotations

import math
import numbers
import struct
import warnings
from typing import Any, Sequence

import torch

from amp.multi_tensor_apply import (
    Scalar,
    multi_tensor_applier,
    multi_tensor_axpby,
    multi_tensor_scale,
    update_scale_hysteresis,
)

__all__ = ["LossScaler", "DEFAULT_MIN_LOSS_SCALE"]

_STATE_KEYS = ("loss_scale", "unskipped", "hysteresis_tracker", "dynamic")
_FP32 = torch.finfo(torch.float32)
# The trackers are int32 device tensors.
_INT32 = torch.iinfo(torch.int32)

# The floor of a dynamic scale when ``min_loss_scale`` is None. Without a floor, overflows that are
# not consecutive (so never stopped by ``max_consecutive_skips``) halve the scale into fp32's
# denormals, where 1/scale is inf and unscaling turns every gradient into inf or NaN (GradScaler
# collapses the same way). 2**-24 is fp16's smallest subnormal: at this scale only gradients of
# about 1 or more survive in fp16, so a smaller scale rescues nothing, and its reciprocal 2**24
# keeps every unscaled fp16 gradient below 2**40, far inside fp32.
DEFAULT_MIN_LOSS_SCALE = 2.0**-24
# Below a scale of 1 the scaler shrinks gradients instead of protecting them: fp16 gradients
# smaller than 2**-24 / scale flush to zero. This is warned about once per scaler.
UNDERFLOW_WARNING_SCALE = 1.0


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require(ok: bool, where: str, name: str, valid: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{where}: {name} must be {valid}, got {value!r}")


def _in_range(value: Any, low: float, high: float) -> bool:
    # Also False for NaN, inf and non-numbers.
    return _is_real(value) and low <= value <= high


def _one_name(where: str, apex_name: str, apex_value: Any, torch_name: str, torch_value: Any,
              default: float) -> tuple[str, Any]:
    """``(name, value)`` of an option that has Apex's name and torch's name; at most one may be given."""
    if apex_value is not None and torch_value is not None:
        raise TypeError(f"{where}: {torch_name} and {apex_name} are the same option (torch's and Apex's "
                        "name for it); pass only one of them")
    if apex_value is not None:
        return apex_name, apex_value
    return torch_name, default if torch_value is None else torch_value


def _may_overflow(in_dtype: torch.dtype, factor_bound: float | None, out_dtype: torch.dtype) -> bool:
    """Whether ``factor * x`` can leave ``out_dtype``'s range although ``x`` (of ``in_dtype``) is
    finite; ``factor_bound`` bounds the fp32 factor the kernel uses, None if unknown.

    The kernels flag non-finite *inputs* only, so such products need a check of their own. The
    product, in doubles, errs far less than an fp32 or fp16 rounding, so one found in range is
    also in range after the kernel rounds.
    """
    return factor_bound is None or torch.finfo(in_dtype).max * factor_bound > torch.finfo(out_dtype).max


def _as_fp32(value: float) -> float:
    """``value`` rounded to fp32 as ``LossScaler._ratio`` rounds the kernels' factors (inf if too large)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


def _factor_bound(numerator: Scalar, denominator: Scalar) -> float | None:
    """The fp32 factor ``numerator / denominator`` for host numbers, None (unknown) for tensors."""
    if isinstance(numerator, torch.Tensor) or isinstance(denominator, torch.Tensor):
        return None
    return abs(_as_fp32(float(numerator) / float(denominator)))


class _LaggedHostScale:
    """What the host knows about the device scale, learnt without ever waiting for the device.

    After each update a non-blocking copy of the scale goes to (pinned) host memory; once it has
    landed (a CUDA event says so, queried, never waited for) its value is known. Aged by the
    updates since, it bounds the scale from below, because an update multiplies the scale by
    ``backoff_factor`` at the least.
    """

    def __init__(self, value: float) -> None:
        self.value, self.at_update = value, 0
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

    def poll(self) -> float | None:
        """Take in the copy in flight if it has landed; returns its value, or None."""
        if self.pending_at is None or (self.copied is not None and not self.copied.query()):
            return None
        assert self.view is not None  # a copy is pending, so there is something to read
        self.set(float(self.view[0]), self.pending_at)
        return self.value

    def lower_bound(self, updates: int, backoff_factor: float, floor: float) -> float:
        return max(floor, self.value * backoff_factor ** (updates - self.at_update))

    def __getstate__(self) -> dict[str, Any]:
        # CUDA events cannot be copied or pickled: a copy gets its own buffer and event instead.
        return {"value": self.value, "at_update": self.at_update, "device": self.device}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.value, self.at_update = state["value"], state["at_update"]
        self.place(state["device"])


class LossScaler:
    """Scales the loss so that small fp16 gradients do not flush to zero, and unscales them again.

    ``amp.initialize`` makes one per loss and ``amp.scale_loss`` drives it; code that manages its own
    fp16 training can drive it directly::

        scaler = LossScaler("dynamic")
        for data, target in loader:
            scaler.clear_overflow_state()
            loss = loss_fn(model(data), target)
            (loss.float() * scaler.scale_tensor(loss.device)).backward()
            model_grads = [p.grad for p in model.parameters()]   # fp16 / bf16
            master_grads = [p.grad for p in master_params]       # fp32
            scaler.unscale(model_grads, master_grads, scaler.loss_scale())
            if not scaler.update_scale():   # True: this step overflowed, skip it
                optimizer.step()

    Why dynamic scaling works: gradients of a loss multiplied by S are the true gradients times S,
    so a large S lifts tiny gradients above fp16's underflow threshold; unscaling in fp32 divides
    S out again before the optimizer sees them. Too large an S overflows to inf/NaN instead. A
    dynamic scaler therefore watches the gradients: a non-finite value means the step is skipped
    and S is reduced by ``backoff_factor``; ``growth_interval`` consecutive clean steps mean S can
    probably grow, and it is multiplied by ``growth_factor``. S settles just below the largest
    value that does not overflow. A static scaler (a number for ``loss_scale``) never changes S and
    never checks for overflow.

    S never leaves ``[min_loss_scale, max_loss_scale]``, and the floor defaults to
    ``DEFAULT_MIN_LOSS_SCALE`` (2**-24), so overflows that keep recurring cannot shrink S until
    1/S is inf. Once S drops below 1 (gradients are then scaled down, and small fp16 ones flush to
    zero) a warning is given, once. Unscaling by 1/S > 1 can itself overflow; whenever the host
    cannot rule that out, the unscaled gradients are checked too.

    State (scale, growth tracker, hysteresis tracker and overflow flag) is kept in tensors on the
    device of the gradients, so ``update_scale_()`` decides and updates without synchronising with
    the host; ``update_scale()`` is the same plus one host read of the skip decision.

    Args:
        loss_scale: ``"dynamic"``, or a number for a static scale.
        init_scale (float, default ``2.**16``): first dynamic scale, clamped into
            ``[min_loss_scale, max_loss_scale]``.
        scale_factor (float, default ``2.``): Apex's name for ``growth_factor``.
        scale_window (int, default ``2000``): Apex's name for ``growth_interval``.
        min_loss_scale (float or None, default None): floor of a dynamic scale; ``None`` means
            ``DEFAULT_MIN_LOSS_SCALE``. Must be at least 2**-126 (fp32's smallest normal number:
            the reciprocal of anything smaller is inf in fp32).
        max_loss_scale (float or None, default ``2.**24``): cap of a dynamic scale; ``None`` means
            fp32's largest number.
        growth_factor (float, keyword-only, default ``2.``): growth factor, > 1.
        growth_interval (int, keyword-only, default ``2000``): consecutive clean steps before the
            scale grows, >= 1.
        backoff_factor (float, keyword-only, default ``1 / growth_factor``): in (0, 1).
        hysteresis (int, keyword-only, default ``1``): how many *consecutive* overflowing steps are
            tolerated before backing off. Each overflow still skips its step; the first
            ``hysteresis - 1`` of a run leave the scale unchanged, the ``hysteresis``-th (and every
            later one, until a clean step) multiplies it by ``backoff_factor``. A clean step resets
            the count. ``1`` is Apex's behaviour: every overflow backs off.

    Errors name the option as it was passed (``growth_factor`` or ``scale_factor``). Constructing
    a scaler has no side effect, so it also serves to validate these options.
    """

    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_factor: float | None = None,
        scale_window: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = 2.0**24,
        *,
        growth_factor: float | None = None,
        growth_interval: int | None = None,
        backoff_factor: float | None = None,
        hysteresis: int = 1,
    ) -> None:
        where = "LossScaler"
        scales = f"a number in [2**-126, {_FP32.max:.6g}] (finite in fp32, with a finite reciprocal)"
        factor_name, factor = _one_name(where, "scale_factor", scale_factor, "growth_factor", growth_factor, 2.0)
        interval_name, interval = _one_name(
            where, "scale_window", scale_window, "growth_interval", growth_interval, 2000
        )
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic:
            _require(_in_range(loss_scale, _FP32.tiny, _FP32.max), where, "loss_scale", f'"dynamic" or {scales}',
                     loss_scale)
        _require(_in_range(init_scale, _FP32.tiny, _FP32.max), where, "init_scale", scales, init_scale)
        _require(_is_real(factor) and 1 < factor <= _FP32.max, where, factor_name, "a finite number > 1", factor)
        if backoff_factor is None:
            backoff_factor = 1.0 / factor
        _require(_is_real(backoff_factor) and 0 < backoff_factor < 1, where, "backoff_factor", "in (0, 1)",
                 backoff_factor)
        _require(_is_int(interval) and 1 <= interval <= _INT32.max, where, interval_name,
                 f"an int in [1, {_INT32.max}]", interval)
        _require(_is_int(hysteresis) and 1 <= hysteresis <= _INT32.max, where, "hysteresis",
                 f"an int in [1, {_INT32.max}]", hysteresis)
        _require(min_loss_scale is None or _in_range(min_loss_scale, _FP32.tiny, _FP32.max), where,
                 "min_loss_scale", f"None (a floor of {DEFAULT_MIN_LOSS_SCALE!r}, 2**-24) or {scales}",
                 min_loss_scale)
        _require(max_loss_scale is None or _in_range(max_loss_scale, _FP32.tiny, _FP32.max), where,
                 "max_loss_scale", f"None (no cap below fp32's largest number) or {scales}", max_loss_scale)
        floor = DEFAULT_MIN_LOSS_SCALE if min_loss_scale is None else float(min_loss_scale)
        cap = _FP32.max if max_loss_scale is None else float(max_loss_scale)
        if floor > cap:
            if min_loss_scale is None:
                raise ValueError(f"{where}: max_loss_scale ({max_loss_scale}) is below the default floor "
                                 f"min_loss_scale={DEFAULT_MIN_LOSS_SCALE!r} (2**-24); pass a smaller "
                                 "min_loss_scale as well")
            raise ValueError(f"{where}: min_loss_scale ({min_loss_scale}) must not exceed "
                             f"max_loss_scale ({max_loss_scale})")

        self._growth_factor = float(factor)
        self._backoff_factor = float(backoff_factor)
        self._scale_seq_len = interval
        self._hysteresis = hysteresis
        # Apex's attributes, as given; the scale itself is kept within _scale_range.
        self._min_loss_scale = min_loss_scale
        self._max_loss_scale = max_loss_scale
        if self.dynamic:
            self._scale_range = (floor, cap)
            initial = min(max(float(init_scale), floor), cap)
        else:
            self._scale_range = (_FP32.tiny, _FP32.max)
            initial = float(loss_scale)
        # Host copy of a static scale, so the "nothing to do" test in unscale() needs no sync.
        self._static_scale = initial
        self._updates = 0
        self._host_scale = _LaggedHostScale(initial)
        self._warned_low_scale = False
        # Whether the host last saw the scale sitting at a floor below 1 (see ``stuck_at_floor``).
        self._at_floor = False
        # Created on the CPU; _place moves it to the device where it is used (normally once).
        self._device: torch.device | None = None
        self._scale = torch.full((1,), initial, dtype=torch.float32)
        # 1 / scale, divided in fp64 and rounded to fp32 (see _ratio), kept beside the scale by
        # every write so that unscaling needs no op to compute it.
        self._inv_scale = torch.full((1,), 1.0 / _as_fp32(initial), dtype=torch.float32)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        self._hysteresis_tracker = torch.full((1,), hysteresis, dtype=torch.int32)
        self._overflow_buf = torch.zeros(1, dtype=torch.float32)

    def _place(self, device: torch.device | str) -> torch.device:
        """Keep the state on ``device``, moving it there if it lives elsewhere; returns the device."""
        device = torch.device(device)
        if device != self._device:
            self._scale = self._scale.to(device)
            self._inv_scale = self._inv_scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)
            self._hysteresis_tracker = self._hysteresis_tracker.to(device)
            self._overflow_buf = self._overflow_buf.to(device)
            self._device = self._scale.device
            self._host_scale.place(self._device)
        return self._device

    def loss_scale(self) -> float:
        """The current scale as a Python float (a dynamic scale is read from the device: a sync)."""
        if not self.dynamic:
            return self._static_scale
        value = self._scale.item()
        self._host_scale.set(value, self._updates)
        self._warn_if_low(value)
        self._note_host_scale(value)
        return value

    def get_scale(self) -> float:
        """The current scale as a Python float (torch's name for ``loss_scale()``)."""
        return self.loss_scale()

    def set_scale(self, value: float) -> None:
        """Replace the scale, e.g. to reset one that shrank while the gradients were broken.

        ``value`` must lie in ``[min_loss_scale, max_loss_scale]`` (any finite fp32 scale with a
        finite reciprocal for a static scaler). The growth and hysteresis counters are kept.
        """
        low, high = self._scale_range
        _require(_in_range(value, low, high), "LossScaler.set_scale", "the scale", self._range_text(), value)
        self._write_scale(float(value))

    def _range_text(self) -> str:
        low, high = self._scale_range
        if self.dynamic:
            return f"a number in [{low!r}, {high!r}] (this scaler's min_loss_scale and max_loss_scale)"
        return f"a number in [2**-126, {high:.6g}] (finite in fp32, with a finite reciprocal)"

    def _write_scale(self, value: float) -> None:
        self._scale.fill_(value)
        self._inv_scale.fill_(1.0 / _as_fp32(value))
        self._static_scale = value
        self._host_scale.set(value, self._updates)
        self._note_host_scale(value)

    def _note_host_scale(self, value: float) -> None:
        """Take in a value of the scale that the host has learnt (without waiting for the device)."""
        floor = self._scale_range[0]
        # The device clamps to the floor rounded to fp32 (a floor of 0.1 is 0.10000000149...).
        self._at_floor = self.dynamic and floor < UNDERFLOW_WARNING_SCALE and value <= _as_fp32(floor)

    def stuck_at_floor(self) -> bool:
        """Whether the scale, as the host last learnt it, sits at its floor and that floor is below 1.

        Read without a sync (on CUDA the host learns the scale a step or so late). A scale held
        there by recurring overflows scales the gradients down so far that small fp16 ones flush
        to zero, and applied steps stop changing the weights.
        """
        return self._at_floor

    def _warn_if_low(self, value: float) -> None:
        if value < UNDERFLOW_WARNING_SCALE and not self._warned_low_scale:
            self._warned_low_scale = True
            warnings.warn(
                f"amp: the dynamic loss scale fell to {value!r}, below {UNDERFLOW_WARNING_SCALE}: gradients are "
                f"now scaled down, and fp16 gradients smaller than 2**-24 / scale flush to zero "
                f"(the floor is min_loss_scale={self._scale_range[0]!r}). The gradients overflow even "
                "unscaled: look for an inf/NaN or an exploding value in the forward pass or the loss, "
                "or train in bfloat16 (opt_level O4/O5)."
            )

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self.set_scale(value)

    @property
    def _unskipped(self) -> int:
        return int(self._growth_tracker.item())

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._growth_tracker.fill_(int(value))

    def scale_tensor(self, device: torch.device | str) -> torch.Tensor:
        """The scale as a 0-dim float32 tensor on ``device`` (where the state then lives).

        It is the scaler's own state, to be read: change the scale with ``set_scale``, which also
        updates the inverse that unscaling uses.
        """
        self._place(device)
        return self._scale.view(())

    def scale_tensor_copy(self) -> torch.Tensor:
        """A copy of the current scale: 0-dim float32, on the device where it lives, read without a sync."""
        return self._scale.detach().clone().view(())

    def found_inf(self) -> torch.Tensor:
        """The overflow flag of the current backward: 1-element float32, > 0 once grads overflowed."""
        return self._overflow_buf

    def clear_overflow_state(self) -> None:
        self._overflow_buf.zero_()

    def _as_float64(self, value: Scalar) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.to(device=self._device, dtype=torch.float64).reshape(1)
        return torch.full((1,), float(value), dtype=torch.float64, device=self._device)

    def _ratio(self, numerator: Scalar, denominator: Scalar) -> torch.Tensor:
        # Divided in fp64 and then rounded to fp32, as GradScaler does: fp32 division can be
        # imprecise under some compiler flags, and Apex computed these ratios in Python doubles.
        if not isinstance(numerator, torch.Tensor) and float(numerator) == 1.0:
            # The common case (unscaling): one op fewer on the per-step path.
            return self._as_float64(denominator).reciprocal().to(torch.float32)
        return (self._as_float64(numerator) / self._as_float64(denominator)).to(torch.float32)

    def _check_buffer(self) -> torch.Tensor:
        # Static scalers never check for overflow: their flag is a throwaway.
        if self.dynamic:
            return self._overflow_buf
        return torch.zeros(1, dtype=torch.float32, device=self._device)

    def _inverse_scale_bound(self) -> float:
        """An upper bound on 1/scale known on the host without a sync."""
        self._poll_host_scale()
        floor = self._scale_range[0]
        # Rounding is monotonic: a scale at or above the bound has an fp32 inverse at or below this.
        return _as_fp32(1.0 / self._host_scale.lower_bound(self._updates, self._backoff_factor, floor))

    def _poll_host_scale(self) -> None:
        value = self._host_scale.poll()
        if value is not None:
            self._warn_if_low(value)
            self._note_host_scale(value)

    def _check_outputs(self, inputs: Sequence[torch.Tensor], factor_bound: float | None,
                       outputs: Sequence[torch.Tensor]) -> None:
        """Flag non-finite ``outputs`` if ``factor * inputs`` may overflow them (see ``_may_overflow``)."""
        if _may_overflow(inputs[0].dtype, factor_bound, outputs[0].dtype):
            multi_tensor_applier(multi_tensor_scale, self._overflow_buf, [outputs, outputs], 1.0)

    def unscale(self, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                unused_scale: object, models_are_masters: bool = False,
                scale_override: Scalar | None = None) -> None:
        """``master_grads[i] = model_grads[i] / scale`` in one fused pass, flagging non-finite model grads.

        ``scale_override`` (a float or a tensor) replaces the scale, not its inverse.
        ``unused_scale`` is accepted for Apex compatibility.
        """
        if len(model_grads) == 0:
            return
        if models_are_masters and not self.dynamic:
            value = self._static_scale if scale_override is None else scale_override
            if not isinstance(value, torch.Tensor) and float(value) == 1.0:
                return
        self._place(model_grads[0].device)
        inv_scale = self._inv_scale if scale_override is None else self._ratio(1.0, scale_override)
        multi_tensor_applier(multi_tensor_scale, self._check_buffer(), [model_grads, master_grads], inv_scale)
        if self.dynamic:
            bound = self._inverse_scale_bound() if scale_override is None else _factor_bound(1.0, scale_override)
            self._check_outputs(model_grads, bound, master_grads)

    def unscale_with_stashed(self, model_grads: Sequence[torch.Tensor],
                             stashed_master_grads: Sequence[torch.Tensor],
                             master_grads: Sequence[torch.Tensor],
                             scale_override: tuple[Scalar, Scalar, Scalar] | None = None) -> None:
        """``master = model * (out_scale / grads_have_scale) + stashed * (out_scale / stashed_have_scale)``.

        ``scale_override`` is ``(grads_have_scale, stashed_have_scale, out_scale)``, by default
        ``(scale, 1, 1)``. As in Apex only the incoming model grads are checked for overflow (a
        non-finite stash was flagged by the backward that made it). Where unscaling them can itself
        overflow (a scale below 1), the results are checked as well, so a non-finite stash then
        counts too: an extra skip, never a missed one.
        """
        if len(model_grads) == 0:
            return
        self._place(model_grads[0].device)
        grads_have_scale: Scalar
        stashed_have_scale: Scalar
        out_scale: Scalar
        if scale_override is None:
            grads_have_scale, stashed_have_scale, out_scale = self._scale, 1.0, 1.0
            model_factor = self._inv_scale
        else:
            grads_have_scale, stashed_have_scale, out_scale = scale_override
            model_factor = self._ratio(out_scale, grads_have_scale)
        multi_tensor_applier(
            multi_tensor_axpby,
            self._check_buffer(),
            [model_grads, stashed_master_grads, master_grads],
            model_factor,
            self._ratio(out_scale, stashed_have_scale),
            0,
        )
        if self.dynamic:
            model_bound = (self._inverse_scale_bound() if scale_override is None
                           else _factor_bound(out_scale, grads_have_scale))
            self._check_outputs(model_grads, model_bound, master_grads)

    def update_scale_(self) -> torch.Tensor:
        """Update the scale from the overflow flag on the device, without a host sync.

        Returns a new 1-element float32 tensor: 1.0 if this backward overflowed and its step must be
        skipped, else 0.0. The flag itself is left for ``clear_overflow_state()``.
        """
        if not self.dynamic:
            return torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        should_skip = torch.empty(1, dtype=torch.float32, device=self._scale.device)
        # One call (one kernel) does it all: the step, the clamp into the range (the host keeps
        # the scale within it, so clamping what the update did suffices), 1/scale for the next
        # unscale, and the skip decision.
        update_scale_hysteresis(
            self._scale,
            self._growth_tracker,
            self._hysteresis_tracker,
            self._overflow_buf,
            self._growth_factor,
            self._backoff_factor,
            self._scale_seq_len,
            self._hysteresis,
            *self._scale_range,
            self._inv_scale,
            should_skip,
        )
        self._updates += 1
        self._host_scale.enqueue(self._scale, self._updates)
        self._poll_host_scale()
        return should_skip

    def update_scale(self) -> bool:
        """Apex's API: update the scale and return whether this step must be skipped (one host read)."""
        if not self.dynamic:
            return False
        return bool(self.update_scale_().item())

    def state_dict(self) -> dict[str, Any]:
        """The scale and counters as Python numbers (loadable with ``torch.load(weights_only=True)``)."""
        return {
            "loss_scale": self.loss_scale(),
            "unskipped": self._unskipped,
            "hysteresis_tracker": int(self._hysteresis_tracker.item()),
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s values; everything is validated before anything changes.

        Apex's two-key dicts (``loss_scale``, ``unskipped``) load too; the hysteresis tracker then
        restarts at ``hysteresis``.
        """
        where = "LossScaler.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where} expects a dict, got {type(state_dict).__name__}")
        unexpected = sorted(set(state_dict) - set(_STATE_KEYS))
        missing = [key for key in ("loss_scale", "unskipped") if key not in state_dict]
        if unexpected or missing:
            raise ValueError(
                f"{where}: unexpected keys {unexpected}, missing keys {missing}; "
                f"expected a dict from LossScaler.state_dict() with keys {list(_STATE_KEYS)}"
            )
        loss_scale = state_dict["loss_scale"]
        unskipped = state_dict["unskipped"]
        hysteresis_tracker = state_dict.get("hysteresis_tracker", self._hysteresis)
        dynamic = state_dict.get("dynamic", self.dynamic)

        if "dynamic" in state_dict:
            _require(isinstance(dynamic, bool), where, "dynamic", "a bool", dynamic)
        if dynamic != self.dynamic:
            kinds = {True: "dynamic", False: "static"}
            raise ValueError(
                f"{where}: the state was saved from a {kinds[dynamic]} scaler but this "
                f"scaler is {kinds[self.dynamic]}; construct it with the same loss_scale setting"
            )
        low, high = self._scale_range
        _require(_in_range(loss_scale, low, high), where, "loss_scale", self._range_text(), loss_scale)
        # A static scaler counts without bound (as Apex's did); a dynamic one restarts at the interval.
        most = _INT32.max if not self.dynamic else self._scale_seq_len - 1
        _require(_is_int(unskipped) and 0 <= unskipped <= most, where, "unskipped",
                 f"an int in [0, {most}] (clean steps since the last growth, below this scaler's "
                 f"growth_interval={self._scale_seq_len}; resume with the saved run's growth_interval)",
                 unskipped)
        # The tracker counts down from hysteresis, one per consecutive overflow.
        _require(_is_int(hysteresis_tracker) and _INT32.min <= hysteresis_tracker <= self._hysteresis, where,
                 "hysteresis_tracker", f"an int in [{_INT32.min}, {self._hysteresis}] (at most this scaler's "
                 "hysteresis)", hysteresis_tracker)
        self._write_scale(float(loss_scale))
        self._unskipped = unskipped
        self._hysteresis_tracker.fill_(hysteresis_tracker)

"""The loss scaler behind ``amp.scale_loss``."""
import math
import numbers

import torch

from amp.multi_tensor_apply import (
    multi_tensor_applier,
    multi_tensor_axpby,
    multi_tensor_scale,
    update_scale_hysteresis,
)

__all__ = ["LossScaler"]

_STATE_KEYS = ("loss_scale", "unskipped", "hysteresis_tracker", "dynamic")


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require(ok, argument, valid, value):
    if not ok:
        raise ValueError(f"LossScaler: {argument} must be {valid}, got {value!r}")


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
    dynamic scaler therefore watches the unscaled gradients: a non-finite value means the step is
    skipped and S is reduced by ``backoff_factor``; ``scale_window`` consecutive clean steps mean S
    can probably grow, and it is multiplied by ``scale_factor``. S settles just below the largest
    value that does not overflow. A static scaler (a number for ``loss_scale``) never changes S and
    never checks for overflow.

    State (scale, growth tracker, hysteresis tracker and overflow flag) is kept in tensors on the
    device of the gradients, so ``update_scale_()`` decides and updates without synchronising with
    the host; ``update_scale()`` is the same plus one host read of the skip decision.

    Args:
        loss_scale: ``"dynamic"``, or a positive number for a static scale.
        init_scale (float, default ``2.**16``): first dynamic scale (capped at ``max_loss_scale``).
        scale_factor (float, default ``2.``): growth factor, > 1.
        scale_window (int, default ``2000``): consecutive clean steps before the scale grows, >= 1.
        min_loss_scale (float or None, default None): floor for backoff; ``None`` means no floor,
            ``0`` is a floor of 0 (unlike Apex, where 0 also meant no floor).
        max_loss_scale (float or None, default ``2.**24``): cap for growth; ``None`` means no cap.
        backoff_factor (float, keyword-only, default ``1 / scale_factor``): in (0, 1).
        hysteresis (int, keyword-only, default ``1``): how many *consecutive* overflowing steps are
            tolerated before backing off. Each overflow still skips its step; the first
            ``hysteresis - 1`` of a run leave the scale unchanged, the ``hysteresis``-th (and every
            later one, until a clean step) multiplies it by ``backoff_factor``. A clean step resets
            the count. ``1`` is Apex's behaviour: every overflow backs off.
    """

    def __init__(
        self,
        loss_scale,
        init_scale=2.0**16,
        scale_factor=2.0,
        scale_window=2000,
        min_loss_scale=None,
        max_loss_scale=2.0**24,
        *,
        backoff_factor=None,
        hysteresis=1,
    ):
        self.dynamic = loss_scale == "dynamic"
        if backoff_factor is None and _is_real(scale_factor) and scale_factor != 0:
            backoff_factor = 1.0 / scale_factor
        if not self.dynamic:
            _require(
                _is_real(loss_scale) and 0 < loss_scale < math.inf,
                "loss_scale",
                '"dynamic" or a finite number > 0',
                loss_scale,
            )
        _require(
            _is_real(init_scale) and 0 < init_scale < math.inf, "init_scale", "finite and > 0", init_scale
        )
        _require(_is_real(scale_factor) and scale_factor > 1, "scale_factor", "> 1", scale_factor)
        _require(
            _is_real(backoff_factor) and 0 < backoff_factor < 1, "backoff_factor", "in (0, 1)", backoff_factor
        )
        _require(_is_int(scale_window) and scale_window >= 1, "scale_window", "an int >= 1", scale_window)
        _require(_is_int(hysteresis) and hysteresis >= 1, "hysteresis", "an int >= 1", hysteresis)
        _require(
            min_loss_scale is None or (_is_real(min_loss_scale) and min_loss_scale >= 0),
            "min_loss_scale",
            "None or a number >= 0",
            min_loss_scale,
        )
        _require(
            max_loss_scale is None or (_is_real(max_loss_scale) and max_loss_scale > 0),
            "max_loss_scale",
            "None or a number > 0",
            max_loss_scale,
        )
        if min_loss_scale is not None and max_loss_scale is not None and min_loss_scale > max_loss_scale:
            raise ValueError(
                f"LossScaler: min_loss_scale ({min_loss_scale}) must not exceed "
                f"max_loss_scale ({max_loss_scale})"
            )

        self._scale_factor = float(scale_factor)
        self._backoff_factor = float(backoff_factor)
        self._scale_seq_len = scale_window
        self._hysteresis = hysteresis
        self._min_loss_scale = min_loss_scale
        self._max_loss_scale = max_loss_scale
        if self.dynamic:
            initial = init_scale if max_loss_scale is None else min(max_loss_scale, init_scale)
        else:
            initial = loss_scale
        # Host copy of a static scale, so the "nothing to do" test in unscale() needs no sync.
        self._static_scale = float(initial)
        # Created on the CPU; _place moves it to the device where it is used (normally once).
        self._device = None
        self._scale = torch.full((1,), float(initial), dtype=torch.float32)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        self._hysteresis_tracker = torch.full((1,), hysteresis, dtype=torch.int32)
        self._overflow_buf = torch.zeros(1, dtype=torch.float32)

    def _place(self, device):
        """Keep the state on ``device``, moving it there if it lives elsewhere; returns the device."""
        device = torch.device(device)
        if device != self._device:
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)
            self._hysteresis_tracker = self._hysteresis_tracker.to(device)
            self._overflow_buf = self._overflow_buf.to(device)
            self._device = self._scale.device
        return self._device

    def loss_scale(self):
        """The current scale as a Python float (a dynamic scale is read from the device: a sync)."""
        if not self.dynamic:
            return self._static_scale
        return self._scale.item()

    @property
    def _loss_scale(self):
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value):
        self._scale.fill_(float(value))
        self._static_scale = float(value)

    @property
    def _unskipped(self):
        return int(self._growth_tracker.item())

    @_unskipped.setter
    def _unskipped(self, value):
        self._growth_tracker.fill_(int(value))

    def scale_tensor(self, device):
        """The scale as a 0-dim float32 tensor on ``device`` (where the state then lives)."""
        self._place(device)
        return self._scale.view(())

    def found_inf(self):
        """The overflow flag of the current backward: 1-element float32, > 0 once grads overflowed."""
        return self._overflow_buf

    def clear_overflow_state(self):
        self._overflow_buf.zero_()

    def _as_float64(self, value):
        if isinstance(value, torch.Tensor):
            return value.to(device=self._device, dtype=torch.float64).reshape(1)
        return torch.full((1,), float(value), dtype=torch.float64, device=self._device)

    def _ratio(self, numerator, denominator):
        # Divided in fp64 and then rounded to fp32, as GradScaler does: fp32 division can be
        # imprecise under some compiler flags, and Apex computed these ratios in Python doubles.
        if not isinstance(numerator, torch.Tensor) and float(numerator) == 1.0:
            # The common case (unscaling): one op fewer on the per-step path.
            return self._as_float64(denominator).reciprocal().to(torch.float32)
        return (self._as_float64(numerator) / self._as_float64(denominator)).to(torch.float32)

    def _check_buffer(self):
        # Static scalers never check for overflow: their flag is a throwaway.
        if self.dynamic:
            return self._overflow_buf
        return torch.zeros(1, dtype=torch.float32, device=self._device)

    def unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False, scale_override=None):
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
        inv_scale = self._ratio(1.0, self._scale if scale_override is None else scale_override)
        multi_tensor_applier(multi_tensor_scale, self._check_buffer(), [model_grads, master_grads], inv_scale)

    def unscale_with_stashed(self, model_grads, stashed_master_grads, master_grads, scale_override=None):
        """``master = model * (out_scale / grads_have_scale) + stashed * (out_scale / stashed_have_scale)``.

        ``scale_override`` is ``(grads_have_scale, stashed_have_scale, out_scale)``, by default
        ``(scale, 1, 1)``. Only the incoming model grads are checked for overflow.
        """
        if len(model_grads) == 0:
            return
        self._place(model_grads[0].device)
        if scale_override is None:
            grads_have_scale, stashed_have_scale, out_scale = self._scale, 1.0, 1.0
        else:
            grads_have_scale, stashed_have_scale, out_scale = scale_override
        multi_tensor_applier(
            multi_tensor_axpby,
            self._check_buffer(),
            [model_grads, stashed_master_grads, master_grads],
            self._ratio(out_scale, grads_have_scale),
            self._ratio(out_scale, stashed_have_scale),
            0,
        )

    def update_scale_(self):
        """Update the scale from the overflow flag on the device, without a host sync.

        Returns a new 1-element float32 tensor: 1.0 if this backward overflowed and its step must be
        skipped, else 0.0. The flag itself is left for ``clear_overflow_state()``.
        """
        if not self.dynamic:
            return torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        should_skip = (self._overflow_buf > 0).to(torch.float32)
        previous = self._scale.clone()
        update_scale_hysteresis(
            self._scale,
            self._growth_tracker,
            self._hysteresis_tracker,
            self._overflow_buf,
            self._scale_factor,
            self._backoff_factor,
            self._scale_seq_len,
            self._hysteresis,
        )
        # The clamps apply only to a scale that just moved, as in Apex: a scale the user poked
        # outside [min, max] is left alone until it backs off or grows.
        if self._min_loss_scale is not None:
            self._scale.copy_(
                torch.where(self._scale < previous, self._scale.clamp(min=self._min_loss_scale), self._scale)
            )
        if self._max_loss_scale is not None:
            self._scale.copy_(
                torch.where(self._scale > previous, self._scale.clamp(max=self._max_loss_scale), self._scale)
            )
        return should_skip

    def update_scale(self):
        """Apex's API: update the scale and return whether this step must be skipped (one host read)."""
        if not self.dynamic:
            return False
        return bool(self.update_scale_().item())

    def state_dict(self):
        """The scale and counters as Python numbers (loadable with ``torch.load(weights_only=True)``)."""
        return {
            "loss_scale": self.loss_scale(),
            "unskipped": self._unskipped,
            "hysteresis_tracker": int(self._hysteresis_tracker.item()),
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state_dict):
        """Restore ``state_dict()``'s values; everything is validated before anything changes.

        Apex's two-key dicts (``loss_scale``, ``unskipped``) load too; the hysteresis tracker then
        restarts at ``hysteresis``.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"LossScaler.load_state_dict expects a dict, got {type(state_dict).__name__}")
        unexpected = sorted(set(state_dict) - set(_STATE_KEYS))
        missing = [key for key in ("loss_scale", "unskipped") if key not in state_dict]
        if unexpected or missing:
            raise ValueError(
                f"LossScaler.load_state_dict: unexpected keys {unexpected}, missing keys {missing}; "
                f"expected a dict from LossScaler.state_dict() with keys {list(_STATE_KEYS)}"
            )
        loss_scale = state_dict["loss_scale"]
        unskipped = state_dict["unskipped"]
        hysteresis_tracker = state_dict.get("hysteresis_tracker", self._hysteresis)
        dynamic = state_dict.get("dynamic", self.dynamic)

        def require(ok, key, valid):
            if not ok:
                raise ValueError(
                    f"LossScaler.load_state_dict: {key} must be {valid}, got {state_dict[key]!r}"
                )

        require(_is_real(loss_scale) and 0 <= loss_scale < math.inf, "loss_scale", "a finite number >= 0")
        require(_is_int(unskipped) and unskipped >= 0, "unskipped", "an int >= 0")
        if "hysteresis_tracker" in state_dict:
            require(_is_int(hysteresis_tracker), "hysteresis_tracker", "an int")
        if "dynamic" in state_dict:
            require(isinstance(dynamic, bool), "dynamic", "a bool")
        if dynamic != self.dynamic:
            kinds = {True: "dynamic", False: "static"}
            raise ValueError(
                f"LossScaler.load_state_dict: the state was saved from a {kinds[dynamic]} scaler but this "
                f"scaler is {kinds[self.dynamic]}; construct it with the same loss_scale setting"
            )
        self._loss_scale = loss_scale
        self._unskipped = unskipped
        self._hysteresis_tracker.fill_(hysteresis_tracker)

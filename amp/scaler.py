"""The loss scaler behind ``amp.scale_loss``: it scales the loss, unscales the grads, and updates the scale.

Its options are checked where they become an object (``_scaler_options.ScalerOptions``); its
state lives on the device of the gradients (``_device_scale.DeviceScale``); what the host knows of
the scale without a sync is ``_host_scale.HostScale``; a state dict is checked by ``_scaler_state``.
The multi-tensor kernels it runs are chosen by ``amp.multi_tensor_apply``.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from amp.multi_tensor_apply import Scalar, multi_tensor_applier, multi_tensor_axpby, multi_tensor_scale

from ._apex_compat import ApexLossScalerNames
from ._apex_compat import axpby_check_overflow_python, scale_check_overflow_python  # noqa: F401  (Apex's names)
from ._device_scale import DeviceScale
from ._host_scale import HostScale, as_fp32
from ._scaler_options import DEFAULT_MIN_LOSS_SCALE, ScalerOptions, in_range, require
from ._scaler_state import checked_state

__all__ = ["LossScaler", "DEFAULT_MIN_LOSS_SCALE", "ScaledBy", "Unscaler"]


def _may_overflow(in_dtype: torch.dtype, factor_bound: float | None, out_dtype: torch.dtype) -> bool:
    """Whether ``factor * x`` can leave ``out_dtype``'s range although ``x`` (of ``in_dtype``) is
    finite; ``factor_bound`` bounds the fp32 factor the kernel uses, None if unknown.

    The kernels flag non-finite *inputs* only, so such products need a check of their own. The
    product, in doubles, errs far less than an fp32 or fp16 rounding, so one found in range is
    also in range after the kernel rounds.
    """
    return factor_bound is None or torch.finfo(in_dtype).max * factor_bound > torch.finfo(out_dtype).max


def _check_outputs(flag: torch.Tensor, inputs: Sequence[torch.Tensor], factor_bound: float | None,
                   outputs: Sequence[torch.Tensor]) -> None:
    """Flag non-finite ``outputs`` if ``factor * inputs`` may overflow them (see ``_may_overflow``)."""
    if _may_overflow(inputs[0].dtype, factor_bound, outputs[0].dtype):
        multi_tensor_applier(multi_tensor_scale, flag, [outputs, outputs], 1.0)


def _as_float64(value: Scalar, device: torch.device | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64).reshape(1)
    return torch.full((1,), float(value), dtype=torch.float64, device=device)


def _ratio(numerator: Scalar, denominator: Scalar, device: torch.device | None) -> torch.Tensor:
    """``numerator / denominator`` as a 1-element fp32 tensor on ``device``."""
    # Divided in fp64 and then rounded to fp32, as GradScaler does: fp32 division can be
    # imprecise under some compiler flags, and Apex computed these ratios in Python doubles.
    if not isinstance(numerator, torch.Tensor) and float(numerator) == 1.0:
        # The common case (unscaling): one op fewer on the per-step path.
        return _as_float64(denominator, device).reciprocal().to(torch.float32)
    return (_as_float64(numerator, device) / _as_float64(denominator, device)).to(torch.float32)


def _factor_bound(numerator: Scalar, denominator: Scalar) -> float | None:
    """The fp32 factor ``numerator / denominator`` for host numbers, None (unknown) for tensors."""
    if isinstance(numerator, torch.Tensor) or isinstance(denominator, torch.Tensor):
        return None
    return abs(as_fp32(float(numerator) / float(denominator)))


class LossScaler(ApexLossScalerNames):
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
            scaler.unscale_into(model_grads, master_grads)
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
    a scaler has no side effect, so it also serves to validate these options. Apex's names
    (``unscale``, ``_loss_scale``, ``_unskipped``) come from ``ApexLossScalerNames``.
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
        options = ScalerOptions(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale,
                                max_loss_scale, growth_factor, growth_interval, backoff_factor, hysteresis)
        self._options, self.dynamic = options, options.dynamic
        self._growth_factor, self._backoff_factor = options.growth, options.backoff
        self._scale_seq_len, self._hysteresis = options.interval, hysteresis
        # Apex's attributes, as given; the scale itself is kept within _scale_range.
        self._min_loss_scale, self._max_loss_scale = min_loss_scale, max_loss_scale
        self._scale_range = options.scale_range
        initial = options.initial_scale
        # Host copy of a static scale, so the "nothing to do" test in unscale_into() needs no sync.
        self._static_scale = initial
        self._updates = 0
        self._host_scale = HostScale(initial, self._scale_range[0], self.dynamic)
        self._on_device = DeviceScale(initial, hysteresis)

    def _place(self, device: torch.device | str) -> None:
        """Keep the state on ``device``, moving it there if it lives elsewhere."""
        if self._on_device.place(device):
            self._host_scale.place(self._on_device.scale.device)

    def loss_scale(self) -> float:
        """The current scale as a Python float (a dynamic scale is read from the device: a sync)."""
        if not self.dynamic:
            return self._static_scale
        value = self._on_device.scale.item()
        self._host_scale.read(value, self._updates)
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
        require(in_range(value, low, high), "LossScaler.set_scale", "the scale", self._options.range_text(), value)
        self._write_scale(float(value))

    def _write_scale(self, value: float) -> None:
        self._on_device.write(value)
        self._static_scale = value
        self._host_scale.set(value, self._updates)

    def stuck_at_floor(self) -> bool:
        """Whether the scale, as the host last learnt it (without a sync: on CUDA a step or so late),
        sits at its floor and that floor is below 1, where small fp16 gradients flush to zero."""
        return self._host_scale.at_floor

    def scale_tensor(self, device: torch.device | str) -> torch.Tensor:
        """The scale as a 0-dim float32 tensor on ``device`` (where the state then lives).

        It is the scaler's own state, to be read: change the scale with ``set_scale``, which also
        updates the inverse that unscaling uses.
        """
        self._place(device)
        return self._on_device.scale.view(())

    def scale_tensor_copy(self) -> torch.Tensor:
        """A copy of the current scale: 0-dim float32, on the device where it lives, read without a sync."""
        return self._on_device.scale.detach().clone().view(())

    def grads_scale(self) -> Scalar:
        """The scale the grads of a backward ending now carry: a copy of a dynamic scale, or the static one."""
        return self.scale_tensor_copy() if self.dynamic else self.loss_scale()

    def found_inf(self) -> torch.Tensor:
        """The overflow flag of the current backward: 1-element float32, > 0 once grads overflowed."""
        return self._on_device.overflow

    def clear_overflow_state(self) -> None:
        self._on_device.overflow.zero_()

    def _ratio(self, numerator: Scalar, denominator: Scalar) -> torch.Tensor:
        return _ratio(numerator, denominator, self._on_device.device)

    def _check_buffer(self) -> torch.Tensor:
        # Static scalers never check for overflow: their flag is a throwaway.
        if self.dynamic:
            return self._on_device.overflow
        return torch.zeros(1, dtype=torch.float32, device=self._on_device.device)

    def _inverse_bound(self) -> float:
        return self._host_scale.inverse_bound(self._updates, self._backoff_factor)

    def unscale_into(self, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                     models_are_masters: bool = False, scale_override: Scalar | None = None) -> None:
        """``master_grads[i] = model_grads[i] / scale`` in one fused pass, flagging non-finite model grads.

        ``models_are_masters``: the two lists are the same tensors (unscaled in place, and not at
        all by a static scale of 1). ``scale_override`` (a float or a tensor) replaces the scale,
        not its inverse.
        """
        if len(model_grads) == 0:
            return
        if models_are_masters and not self.dynamic:
            value = self._static_scale if scale_override is None else scale_override
            if not isinstance(value, torch.Tensor) and float(value) == 1.0:
                return
        self._place(model_grads[0].device)
        inv_scale = self._on_device.inv_scale if scale_override is None else self._ratio(1.0, scale_override)
        multi_tensor_applier(multi_tensor_scale, self._check_buffer(), [model_grads, master_grads], inv_scale)
        if self.dynamic:
            bound = self._inverse_bound() if scale_override is None else _factor_bound(1.0, scale_override)
            _check_outputs(self._on_device.overflow, model_grads, bound, master_grads)

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
        grads_have_scale, stashed_have_scale, out_scale = scale_override or (self._on_device.scale, 1.0, 1.0)
        model_factor = self._on_device.inv_scale if scale_override is None else self._ratio(out_scale, grads_have_scale)
        multi_tensor_applier(multi_tensor_axpby, self._check_buffer(),
                             [model_grads, stashed_master_grads, master_grads], model_factor,
                             self._ratio(out_scale, stashed_have_scale), 0)
        if self.dynamic:
            model_bound = (self._inverse_bound() if scale_override is None
                           else _factor_bound(out_scale, grads_have_scale))
            _check_outputs(self._on_device.overflow, model_grads, model_bound, master_grads)

    def update_scale_(self) -> torch.Tensor:
        """Update the scale from the overflow flag on the device, without a host sync.

        Returns a new 1-element float32 tensor: 1.0 if this backward overflowed and its step must be
        skipped, else 0.0. The flag itself is left for ``clear_overflow_state()``.
        """
        if not self.dynamic:
            return torch.zeros(1, dtype=torch.float32, device=self._on_device.scale.device)
        should_skip = self._on_device.update(self._growth_factor, self._backoff_factor, self._scale_seq_len,
                                             self._hysteresis, self._scale_range)
        self._updates += 1
        self._host_scale.enqueue(self._on_device.scale, self._updates)
        self._host_scale.poll()
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
            "unskipped": int(self._on_device.growth_tracker.item()),
            "hysteresis_tracker": int(self._on_device.hysteresis_tracker.item()),
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s values; everything is validated before anything changes.

        Apex's two-key dicts (``loss_scale``, ``unskipped``) load too; the hysteresis tracker then
        restarts at ``hysteresis``.
        """
        loss_scale, unskipped, hysteresis_tracker = checked_state(state_dict, self._options)
        self._write_scale(loss_scale)
        self._on_device.growth_tracker.fill_(unskipped)
        self._on_device.hysteresis_tracker.fill_(hysteresis_tracker)


class ScaledBy:
    """``scaler``, unscaling grads that were multiplied by ``scale`` (a tensor) instead of its current scale.

    A ``scale_loss`` block nested in an open one of the same thread and scaler updates the scale
    at its exit; the enclosing block's grads still carry the scale from before.
    """

    def __init__(self, scaler: LossScaler, scale: torch.Tensor) -> None:
        self.scaler, self.scale = scaler, scale

    def grads_scale(self) -> torch.Tensor:
        return self.scale

    def unscale_into(self, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                     models_are_masters: bool = False) -> None:
        self.scaler.unscale_into(model_grads, master_grads, models_are_masters, scale_override=self.scale)

    def unscale_with_stashed(self, model_grads: Sequence[torch.Tensor],
                             stashed_master_grads: Sequence[torch.Tensor],
                             master_grads: Sequence[torch.Tensor]) -> None:
        self.scaler.unscale_with_stashed(model_grads, stashed_master_grads, master_grads,
                                         scale_override=(self.scale, 1.0, 1.0))


#: What unscales a backward's grads: a scaler, or a scaler by the scale a nested block left behind.
Unscaler = Union[LossScaler, ScaledBy]

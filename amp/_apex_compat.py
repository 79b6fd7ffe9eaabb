"""What amp keeps only because code written for NVIDIA Apex reads or calls it.

amp's own modules speak amp; the Apex names they must still answer to are gathered here, each
working exactly as in Apex (and as before this module existed):

* ``warn_or_err``: Apex's ``hard_override`` leniency (``amp._amp_state.hard_override``) turns an
  option that does not fit its opt level into a warning; ``amp.initialize`` reads the flag and
  passes it down, so nothing below it reads amp's state.
* ``ApexLossScalerNames``: ``LossScaler.unscale`` with Apex's unused scale argument, and Apex's
  ``_loss_scale``, ``_unskipped`` and ``_overflow_buf`` attributes.
* ``ApexStashFields``: Apex's field names on ``optimizer._amp_stash`` (``all_fp16_params``,
  ``fp16_groups``, ``in_scale_loss``, ...), each read through to where amp's controller keeps it.
* ``APEX_METHODS`` and ``attach_apex_methods``: the methods Apex attached to an optimizer
  (``_lazy_init_maybe_master_weights``, ``_post_amp_backward``, ...).
* ``scale_check_overflow_python``, ``axpby_check_overflow_python`` (``apex.amp.scaler``) and
  ``O2StateDictHook`` (``apex.amp._initialize``): Apex's helpers of those modules, which amp's
  modules of the same name keep for code that imported them.

The protocols below say what each piece reads of the class it serves, so this module imports none
of amp's.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Protocol, Sequence

import torch

__all__ = ["APEX_METHODS", "ApexLossScalerNames", "ApexStashFields", "attach_apex_methods", "warn_or_err",
           "scale_check_overflow_python", "axpby_check_overflow_python", "O2StateDictHook"]

#: The methods Apex attached to an optimizer; ``amp.initialize`` refuses one that has any already.
APEX_METHODS = ("_lazy_init_maybe_master_weights", "_master_params_to_model_params",
                "_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init")


def warn_or_err(msg: str, lenient: bool) -> None:
    """Raise ``RuntimeError(msg)``, or only warn when ``lenient`` (Apex's ``hard_override``)."""
    if lenient:
        warnings.warn(msg, stacklevel=3)
    else:
        raise RuntimeError(msg)


class _OnDevice(Protocol):
    growth_tracker: torch.Tensor


class _Scaler(Protocol):
    """What ``ApexLossScalerNames`` reads of ``LossScaler``."""

    @property
    def _on_device(self) -> _OnDevice: ...

    def loss_scale(self) -> float: ...

    def found_inf(self) -> torch.Tensor: ...

    def set_scale(self, value: float) -> None: ...

    def unscale_into(self, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                     models_are_masters: bool = False,
                     scale_override: float | torch.Tensor | None = None) -> None: ...


class ApexLossScalerNames:
    """Apex's names on ``LossScaler``, each working as in Apex."""

    def unscale(self: _Scaler, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                unused_scale: object, models_are_masters: bool = False,
                scale_override: float | torch.Tensor | None = None) -> None:
        """``master_grads[i] = model_grads[i] / scale`` (``LossScaler.unscale_into``); Apex passed the
        scale itself too, which is not needed."""
        self.unscale_into(model_grads, master_grads, models_are_masters, scale_override)

    @property
    def _loss_scale(self: _Scaler) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self: _Scaler, value: float) -> None:
        self.set_scale(value)

    @property
    def _unskipped(self: _Scaler) -> int:
        """Clean steps since the scale last grew (or backed off)."""
        return int(self._on_device.growth_tracker.item())

    @_unskipped.setter
    def _unskipped(self: _Scaler, value: int) -> None:
        self._on_device.growth_tracker.fill_(int(value))

    @property
    def _overflow_buf(self: _Scaler) -> torch.Tensor:
        return self.found_inf()

    @_overflow_buf.setter
    def _overflow_buf(self: _Scaler, flag: torch.Tensor) -> None:
        """Apex-era code that checks gradients itself hands its flag over before ``update_scale()``
        (NVIDIA's BERT, which all-reduces the grads after accumulation): its value, taken now, is
        this scaler's overflow flag (nonzero: the step overflowed)."""
        if not isinstance(flag, torch.Tensor) or flag.numel() != 1:
            raise TypeError("_overflow_buf takes a one-element tensor (nonzero: overflow), got "
                            f"{flag.shape if isinstance(flag, torch.Tensor) else type(flag).__name__}")
        self.found_inf().copy_(flag.detach().reshape(1))


def _non_finite(grad: torch.Tensor) -> bool:
    return not bool(torch.isfinite(grad).all())


def scale_check_overflow_python(model_grad: torch.Tensor, master_grad: torch.Tensor, scale: float,
                                check_overflow: bool = False) -> bool:
    """``master_grad = model_grad * scale`` for one tensor; with ``check_overflow``, a non-finite
    ``model_grad`` returns True and writes nothing (one host read)."""
    if check_overflow and _non_finite(model_grad):
        return True
    if master_grad is not model_grad:
        master_grad.copy_(model_grad)
    if scale != 1.0:
        master_grad.mul_(scale)
    return False


def axpby_check_overflow_python(model_grad: torch.Tensor, stashed_grad: torch.Tensor, master_grad: torch.Tensor,
                                a: float, b: float, check_overflow: bool = False) -> bool:
    """``master_grad = a * model_grad + b * stashed_grad`` (in ``master_grad``'s dtype) for one
    tensor; with ``check_overflow``, a non-finite ``model_grad`` returns True and writes nothing."""
    if check_overflow and _non_finite(model_grad):
        return True
    if stashed_grad.dtype != master_grad.dtype:
        raise TypeError(f"stashed_grad ({stashed_grad.dtype}) and master_grad ({master_grad.dtype}) "
                        "must have one dtype")
    master_grad.copy_(a * model_grad.detach().to(master_grad.dtype) + b * stashed_grad)
    return False


class O2StateDictHook:
    """A module state-dict hook that saves fp16/bf16 entries as fp32 (amp registers its own at O2/O5)."""

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        self.fn = fn  # unused, as in Apex

    def __call__(self, module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
                state_dict[key] = value.to(torch.float32)


def _params_already_built() -> None:
    """Apex's lazy init of an optimizer's param lists and masters, which amp did at initialize."""


def attach_apex_methods(optimizer: Any, set_grads_aside: Callable[[], None], unscale_grads: Callable[[Any], None],
                        copy_masters_to_model: Callable[[], None] | None) -> None:
    """Give ``optimizer`` Apex's methods (``copy_masters_to_model``: under master weights only)."""
    # Apex built the param lists and the masters lazily: at the first backward, or when Apex-era
    # code asked (NVIDIA's BERT resume calls _lazy_init_maybe_master_weights() before loading a
    # checkpoint). amp builds them at initialize, so these find them built and change nothing,
    # whatever _amp_stash.lazy_init_called says: building them again from param groups that hold
    # the masters by then would cut the model's params off from training.
    optimizer._amp_lazy_init = optimizer._lazy_init_maybe_master_weights = _params_already_built
    optimizer._prepare_amp_backward = set_grads_aside
    optimizer._post_amp_backward = unscale_grads
    if copy_masters_to_model is not None:
        optimizer._master_params_to_model_params = copy_masters_to_model


class _Field:
    """Apex's name for ``stash.weights.<path>`` on amp's controller (``stash``).

    ``masters``: the field exists only on a stash with (True) or without (False) master weights.
    """

    def __init__(self, path: str, masters: bool | None = None) -> None:
        self.path, self.masters = path.split("."), masters

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, stash: Any, owner: type | None = None) -> Any:
        if stash is None:
            return self
        if self.masters is not None and stash.master_weights != self.masters:
            raise AttributeError(f"'{type(stash).__name__}' object has no attribute '{self.name}'")
        value = stash.weights
        for name in self.path:
            value = getattr(value, name)
        return value


class _Stash(Protocol):
    """What ``ApexStashFields``' flags read of amp's controller."""

    @property
    def in_backward(self) -> bool: ...

    @property
    def grads_still_scaled(self) -> bool: ...


class ApexStashFields:
    """Apex's ``optimizer._amp_stash`` fields, on amp's controller; each is amp's own list (or flag).

    Those of one kind of stash only (``fp16_groups`` under master weights, ``all_fp32_params``
    without) are missing from the other, as in Apex.
    """

    # Apex patched step again after every overflow, and said so here; amp wraps it once.
    already_patched = False
    all_fp16_params = _Field("low_params")
    all_fp16_grad_stash = _Field("low_slots")
    all_fp32_params = _Field("fp32.params", masters=False)
    all_fp32_grad_stash = _Field("fp32.slots", masters=False)
    all_fp32_from_fp32_params = _Field("fp32.params", masters=True)
    all_fp32_from_fp32_grad_stash = _Field("fp32.slots", masters=True)
    all_fp32_from_fp16_params = _Field("masters.masters", masters=True)
    fp16_groups = _Field("masters.model_groups", masters=True)
    fp32_from_fp16_groups = _Field("masters.master_groups", masters=True)
    fp32_from_fp32_groups = _Field("masters.fp32_groups", masters=True)
    # amp's own name from before its controller had parts, not Apex's.
    master_grad_buffers = _Field("master_grads.buffers", masters=True)

    @property
    def in_scale_loss(self: _Stash) -> bool:
        return self.in_backward

    @property
    def params_have_scaled_gradients(self: _Stash) -> bool:
        return self.grads_still_scaled

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

The protocols below say what each piece reads of the class it serves, so this module imports none
of amp's.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch

__all__ = ["APEX_METHODS", "ApexLossScalerNames", "ApexStashFields", "attach_apex_methods", "warn_or_err"]

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
                     scale_override: Union[float, torch.Tensor, None] = None) -> None: ...


class ApexLossScalerNames:
    """Apex's names on ``LossScaler``, each working as in Apex."""

    def unscale(self: _Scaler, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                unused_scale: object, models_are_masters: bool = False,
                scale_override: Union[float, torch.Tensor, None] = None) -> None:
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


def attach_apex_methods(optimizer: Any, lazy_init: Callable[..., None], init_params: Callable[..., None],
                        set_grads_aside: Callable[[], None], unscale_grads: Callable[[Any], None],
                        copy_masters_to_model: Optional[Callable[[], None]]) -> None:
    """Give ``optimizer`` Apex's methods (``copy_masters_to_model``: under master weights only)."""
    optimizer._amp_lazy_init = lazy_init
    # Apex's name, though it builds the param lists again: called after initialize, it finds the
    # masters already in the param groups (amp made them at initialize).
    optimizer._lazy_init_maybe_master_weights = init_params
    optimizer._prepare_amp_backward = set_grads_aside
    optimizer._post_amp_backward = unscale_grads
    if copy_masters_to_model is not None:
        optimizer._master_params_to_model_params = copy_masters_to_model


class _Params(Protocol):
    @property
    def params(self) -> list[torch.Tensor]: ...

    @property
    def slots(self) -> list[Optional[torch.Tensor]]: ...


class _Masters(Protocol):
    @property
    def model_groups(self) -> list[list[torch.Tensor]]: ...

    @property
    def master_groups(self) -> list[list[torch.Tensor]]: ...

    @property
    def fp32_groups(self) -> list[list[torch.Tensor]]: ...

    @property
    def masters(self) -> list[torch.Tensor]: ...


class _MasterGrads(Protocol):
    @property
    def buffers(self) -> list[Optional[torch.Tensor]]: ...


class _Weights(Protocol):
    @property
    def low_params(self) -> list[torch.Tensor]: ...

    @property
    def low_slots(self) -> list[Optional[torch.Tensor]]: ...

    @property
    def fp32(self) -> _Params: ...


class _MasterWeights(_Weights, Protocol):
    @property
    def masters(self) -> _Masters: ...

    @property
    def master_grads(self) -> _MasterGrads: ...


class _Stash(Protocol):
    """What ``ApexStashFields`` reads of amp's controller."""

    @property
    def weights(self) -> Any: ...

    @property
    def master_weights(self) -> bool: ...

    @property
    def in_backward(self) -> bool: ...

    @property
    def grads_still_scaled(self) -> bool: ...


def _weights(stash: _Stash, name: str, masters: bool) -> Any:
    """``stash.weights``, if Apex's stash had the field ``name`` with master weights as ``stash`` has them."""
    if stash.master_weights != masters:
        raise AttributeError(f"'{type(stash).__name__}' object has no attribute '{name}'")
    return stash.weights


class ApexStashFields:
    """Apex's ``optimizer._amp_stash`` fields, on amp's controller; each is amp's own list (or flag).

    Those of one kind of stash only (``fp16_groups`` under master weights, ``all_fp32_params``
    without) are missing from the other, as in Apex.
    """

    # Apex patched step again after every overflow, and said so here; amp wraps it once.
    already_patched = False

    @property
    def in_scale_loss(self: _Stash) -> bool:
        return self.in_backward

    @property
    def params_have_scaled_gradients(self: _Stash) -> bool:
        return self.grads_still_scaled

    @property
    def all_fp16_params(self: _Stash) -> list[torch.Tensor]:
        weights: _Weights = self.weights
        return weights.low_params

    @property
    def all_fp16_grad_stash(self: _Stash) -> list[Optional[torch.Tensor]]:
        weights: _Weights = self.weights
        return weights.low_slots

    @property
    def all_fp32_params(self: _Stash) -> list[torch.Tensor]:
        weights: _Weights = _weights(self, "all_fp32_params", False)
        return weights.fp32.params

    @property
    def all_fp32_grad_stash(self: _Stash) -> list[Optional[torch.Tensor]]:
        weights: _Weights = _weights(self, "all_fp32_grad_stash", False)
        return weights.fp32.slots

    @property
    def all_fp32_from_fp32_params(self: _Stash) -> list[torch.Tensor]:
        weights: _MasterWeights = _weights(self, "all_fp32_from_fp32_params", True)
        return weights.fp32.params

    @property
    def all_fp32_from_fp32_grad_stash(self: _Stash) -> list[Optional[torch.Tensor]]:
        weights: _MasterWeights = _weights(self, "all_fp32_from_fp32_grad_stash", True)
        return weights.fp32.slots

    @property
    def all_fp32_from_fp16_params(self: _Stash) -> list[torch.Tensor]:
        weights: _MasterWeights = _weights(self, "all_fp32_from_fp16_params", True)
        return weights.masters.masters

    @property
    def fp16_groups(self: _Stash) -> list[list[torch.Tensor]]:
        weights: _MasterWeights = _weights(self, "fp16_groups", True)
        return weights.masters.model_groups

    @property
    def fp32_from_fp16_groups(self: _Stash) -> list[list[torch.Tensor]]:
        weights: _MasterWeights = _weights(self, "fp32_from_fp16_groups", True)
        return weights.masters.master_groups

    @property
    def fp32_from_fp32_groups(self: _Stash) -> list[list[torch.Tensor]]:
        weights: _MasterWeights = _weights(self, "fp32_from_fp32_groups", True)
        return weights.masters.fp32_groups

    @property
    def master_grad_buffers(self: _Stash) -> list[Optional[torch.Tensor]]:
        """amp's own name from before its controller had parts (not Apex's)."""
        weights: _MasterWeights = _weights(self, "master_grad_buffers", True)
        return weights.master_grads.buffers

"""What amp keeps only because code written for NVIDIA Apex reads or calls it.

amp's own modules speak amp; the Apex names they must still answer to are gathered here, each
working exactly as in Apex (and as before this module existed):

* ``warn_or_err``: Apex's ``hard_override`` leniency (``amp._amp_state.hard_override``) turns an
  option that does not fit its opt level into a warning; ``amp.initialize`` reads the flag and
  passes it down, so nothing below it reads amp's state.
* ``ApexLossScalerNames``: ``LossScaler.unscale`` with Apex's unused scale argument, and Apex's
  ``_loss_scale``, ``_unskipped`` and ``_overflow_buf`` attributes.

The protocols below say what each piece reads of the class it serves, so this module imports none
of amp's.
"""
from __future__ import annotations

import warnings
from typing import Protocol, Sequence, Union

import torch

__all__ = ["ApexLossScalerNames", "warn_or_err"]


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

"""One ``amp.initialize`` call's run: its options, its loss scalers, and what its optimizers share.

Every optimizer an ``initialize`` returns reaches its run through ``optimizer._amp_stash.context``,
so a later ``initialize`` on other objects never changes how an earlier run scales, unscales or
skips. A run is live while the program still references one of its models (directly, or through a
wrapper such as DDP or ``torch.compile``): amp holds them weakly and makes no reference cycle
through a model, so a model the program drops is freed at once, without waiting for the cycle
collector. Each run also records when it was initialized and when it last stepped, on one clock
for the process; ``_amp_state`` decides from both which runs ``amp.state_dict`` saves.
"""
from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch.distributed as dist

if TYPE_CHECKING:
    from .casting import AmpHandle
    from .options import Options
    from .scaler import LossScaler

__all__ = ["AmpContext"]

# Orders the initialize calls and steps of every run in the process.
_clock = itertools.count()


class AmpContext:
    """What one ``amp.initialize`` call configured: options and loss scalers."""

    def __init__(self, options: Options, loss_scalers: Iterable[LossScaler] = (), verbosity: int = 1,
                 overflow_process_group: dist.ProcessGroup | None = None,
                 min_loss_scale: float | None = None, max_loss_scale: float | None = 2.0**24,
                 max_steps_at_scale_floor: int = 0) -> None:
        self.options = options
        self.loss_scalers = list(loss_scalers)
        self.verbosity = verbosity
        self.overflow_process_group = overflow_process_group
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.max_steps_at_scale_floor = max_steps_at_scale_floor
        # Weak references to the models this call returned (see ``live``).
        self._models: list[weakref.ref[Any]] = []
        self.initialized_at = next(_clock)
        self.stepped_at = -1  # when an optimizer of this run last stepped (-1: never)
        # Its O1/O4 handle (casting.policy), whose weight-cast cache scale_loss clears; else None.
        self.casting_policy: AmpHandle | None = None
        self.sharded_masters = False  # FSDP2 at O2/O5: the sharded fp32 params are the masters
        self.unsharded_models: Sequence[weakref.ref[Any]] = ()  # for amp._fsdp.check_order

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    def track(self, models: Iterable[object]) -> None:
        """Follow the call's ``models`` weakly: the run is live while one of them is referenced."""
        self._models = [weakref.ref(model) for model in models]

    @property
    def live(self) -> bool:
        return any(ref() is not None for ref in self._models)

    def note_step(self) -> None:
        """An optimizer of this run stepped (applied or skipped)."""
        self.stepped_at = next(_clock)

    @property
    def stepped(self) -> bool:
        """Whether an optimizer of this run has stepped since its ``initialize``."""
        return self.stepped_at >= 0

    def loss_scaler(self, loss_id: int) -> LossScaler:
        """The scaler of loss ``loss_id``; an out-of-range id is an error that names ``num_losses``."""
        scalers = self.loss_scalers
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(scalers):
            raise IndexError(f"loss_id={loss_id!r} is out of range: amp.initialize was called with "
                             f"num_losses={len(scalers)}, so loss_id must be in 0..{len(scalers) - 1}.")
        return scalers[loss_id]

"""Per-``initialize`` contexts, and the process-wide view of the latest one (``amp._amp_state``).

Each successful ``amp.initialize`` builds one :class:`AmpContext` (its options and loss scalers)
and every optimizer it returns reaches that context through ``optimizer._amp_stash.context``, so
a later ``initialize`` on other objects never changes how an earlier run scales, unscales or
skips. ``_amp_state`` keeps Apex's fields as a read view of the latest context for code that
pokes it (``amp._amp_state.loss_scalers[0]``). The O1/O4 function patches are process-wide and
their latest handle lives there too (``handle``); each context keeps its own run's casting policy,
which its models apply inside their forward (``casting/policy.py``).

``verbosity`` here is also what messages that belong to no run follow (``_logging.maybe_print``).
"""
from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch.distributed as dist

from ._logging import follow_verbosity

if TYPE_CHECKING:
    from .casting.handle import AmpHandle, NoOpHandle
    from .options import Options
    from .scaler import LossScaler


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
        # Weak references to the models and optimizers this call returned (see ``live``).
        self._owners: list[weakref.ref[Any]] = []
        # Its O1/O4 handle (casting.policy), whose weight-cast cache scale_loss clears; else None.
        self.casting_policy: AmpHandle | None = None
        self.sharded_masters = False  # FSDP2 at O2/O5: the sharded fp32 params are the masters
        self.unsharded_models: Sequence[weakref.ref[Any]] = ()  # for amp._fsdp.check_order

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    def track(self, objects: Iterable[object]) -> None:
        """Follow ``objects`` (the call's models and optimizers) weakly: the run is live while one is."""
        self._owners = [weakref.ref(obj) for obj in objects]

    @property
    def live(self) -> bool:
        return any(ref() is not None for ref in self._owners)

    def loss_scaler(self, loss_id: int) -> LossScaler:
        """The scaler of loss ``loss_id``; an out-of-range id is an error that names ``num_losses``."""
        scalers = self.loss_scalers
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(scalers):
            raise IndexError(f"loss_id={loss_id!r} is out of range: amp.initialize was called with "
                             f"num_losses={len(scalers)}, so loss_id must be in 0..{len(scalers) - 1}.")
        return scalers[loss_id]


class AmpState:
    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1
        self.opt_properties: Options | None = None
        self.loss_scalers: list[LossScaler] = []
        self.handle: AmpHandle | NoOpHandle | None = None
        self.min_loss_scale: float | None = None
        self.max_loss_scale: float | None = 2.0**24
        self.overflow_process_group: dist.ProcessGroup | None = None
        self.context: AmpContext | None = None
        # Optimizers seen by an ``initialize(enabled=False)``: scale_loss passes their loss through.
        self.disabled_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        # Every enabled context, in the order of the initialize calls; see ``live_runs``.
        self.runs: list[AmpContext] = []

    def publish(self, context: AmpContext) -> None:
        """Make ``context`` the latest one, as Apex's global fields show it."""
        self.context = context
        self.opt_properties = context.options
        self.loss_scalers = context.loss_scalers
        self.verbosity = context.verbosity
        self.min_loss_scale = context.min_loss_scale
        self.max_loss_scale = context.max_loss_scale
        self.overflow_process_group = context.overflow_process_group
        if context.enabled:
            self.runs.append(context)

    def live_runs(self, collect: bool = False) -> list[AmpContext]:
        """The enabled contexts whose models or optimizers are still alive, oldest first.

        ``collect``: run the cycle collector even when a single run looks live (it costs a few
        milliseconds, so only rare calls such as ``initialize`` ask for it).
        """
        if sum(context.live for context in self.runs) > (0 if collect else 1):
            # An optimizer and its amp controller reference each other, so a run dropped by the
            # user lingers until the cycle collector runs; it must not be counted as live.
            gc.collect()
        self.runs = [context for context in self.runs if context.live]
        return list(self.runs)


_amp_state = AmpState()
follow_verbosity(lambda: _amp_state.verbosity)


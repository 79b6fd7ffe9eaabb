"""The process-wide view of amp's runs (``amp._amp_state``): the latest one, and every live one.

Each successful ``amp.initialize`` builds one run (``_run.AmpContext``) and publishes it here.
``_amp_state`` keeps Apex's fields as a read view of the latest run for code that pokes it
(``amp._amp_state.loss_scalers[0]``), Apex's switches (``hard_override``,
``allow_incoming_model_not_fp32``), and the runs ``amp.state_dict`` saves (``live_runs``). The
O1/O4 function patches are process-wide; ``handle`` shows the latest ``init``'s handle, which the
patcher keeps (``casting/patcher.py``). Each run keeps its own casting policy, which its models
apply inside their forward (``casting/policy.py``).

Which runs a checkpoint holds is decided by what the program did, never by when the cycle
collector runs (``checkpoint_runs``): of the live runs (a run whose models the program dropped is
gone at once, see ``_run``), those in use: the latest ``initialize`` call's, those initialized
with it (no step of any run in between), and those that stepped since it.

``verbosity`` here is also what messages that belong to no run follow (``_logging.maybe_print``).
Apex's helpers of this module (``maybe_print``, ``warn_or_err``, ``master_params``) are here too,
for code that imported them from ``apex.amp._amp_state``.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from . import _apex_compat, casting
from ._logging import follow_verbosity, maybe_print
from ._master_weights import master_params

if TYPE_CHECKING:
    from ._run import AmpContext
    from .casting import AmpHandle, NoOpHandle
    from .options import Options
    from .scaler import LossScaler

__all__ = ["AmpState", "_amp_state", "maybe_print", "warn_or_err", "master_params"]


class AmpState:
    """Apex's global fields, kept as a view of the latest run, and the runs themselves."""

    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1
        self.opt_properties: Options | None = None
        self.loss_scalers: list[LossScaler] = []
        self.min_loss_scale: float | None = None
        self.max_loss_scale: float | None = 2.0**24
        self.overflow_process_group: dist.ProcessGroup | None = None
        self.context: AmpContext | None = None
        # Optimizers seen by an ``initialize(enabled=False)``: scale_loss passes their loss through.
        self.disabled_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        # Every enabled context, in the order of the initialize calls; see ``live_runs``.
        self.runs: list[AmpContext] = []
        self._last_step_of_gone_runs = -1
        self._last_step_of_gone_others = -1  # the same, leaving out the latest run (``context``)

    @property
    def handle(self) -> AmpHandle | NoOpHandle | None:
        """The handle of the latest O1/O4 ``init``, whose patches are installed (kept by ``casting``)."""
        return casting.installed_handle()

    @handle.setter
    def handle(self, handle: AmpHandle | NoOpHandle | None) -> None:
        casting.set_installed_handle(handle)

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

    def live_runs(self) -> list[AmpContext]:
        """The enabled contexts whose models the program still references, oldest first."""
        gone = [context for context in self.runs if not context.live]
        if gone:
            # A step of a run that is gone still ends the block of runs initialized before it.
            self._last_step_of_gone_runs = max([self._last_step_of_gone_runs,
                                                *(context.stepped_at for context in gone)])
            self._last_step_of_gone_others = max([self._last_step_of_gone_others,
                                                  *(c.stepped_at for c in gone if c is not self.context)])
            self.runs = [context for context in self.runs if context.live]
        return list(self.runs)

    def checkpoint_runs(self) -> list[AmpContext]:
        """The live runs in use, oldest first (what ``amp.state_dict()`` saves, see the module doc).

        An earlier run the program still holds but has not stepped since a later ``initialize``
        (a resume compared with the run it was saved from, a notebook cell run again) is not in use.
        """
        runs = self.live_runs()
        if not runs:
            return []
        latest = runs[-1]
        last_step = max([self._last_step_of_gone_runs, *(context.stepped_at for context in runs)])
        return [context for context in runs if context is latest or context.initialized_at > last_step
                or context.stepped_at > latest.initialized_at]

    def sole_gone_run(self) -> AmpContext | None:
        """With no live run, the latest one if no other run stepped since its ``initialize``, else None.

        That run is what Apex's ``state_dict`` saved (the latest call's scalers) and the only one
        the program could have been training; where another run stepped after it was initialized,
        which of them a checkpoint should hold is ambiguous.
        """
        latest = self.context
        if self.live_runs() or latest is None or not latest.enabled:
            return None
        return latest if self._last_step_of_gone_others < latest.initialized_at else None


_amp_state = AmpState()
follow_verbosity(lambda: _amp_state.verbosity)


def warn_or_err(msg: str) -> None:
    """Apex's form: raise ``RuntimeError(msg)``, or only warn under ``_amp_state.hard_override``."""
    _apex_compat.warn_or_err(msg, _amp_state.hard_override)

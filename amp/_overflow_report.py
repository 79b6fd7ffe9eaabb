"""Skipped-step reporting: one rate-limited reporter, and the errors for runs that stopped training.

Apex printed one line per skipped step from deep inside the optimizer patch; a run that overflows
on every step then filled the log and halved the scale forever. Here every skip is counted, the
first few are printed, later ones only as periodic summaries, and a streak longer than
``max_consecutive_skips`` raises :class:`NonFiniteGradientsError` naming the culprits.

Overflows that alternate with clean steps never make such a streak, yet if they come more often
than once per ``growth_interval`` the scale only shrinks, down to its floor; below 1 the gradients
are scaled down there until small fp16 ones flush to zero and applied steps change nothing. A
scale held at such a floor is warned about (rate-limited), and after ``max_steps_at_scale_floor``
steps raises :class:`LossScaleFloorError`. At any floor (``min_loss_scale=1`` is common in
Apex-era code) a skip rate that stays above what the dynamic scale's probing explains (it grows
after ``growth_interval`` clean steps, then overflows ``hysteresis`` times to back off again) is
warned about too: each skipped step is a batch trained on nothing. The checks use only what the
host already knows.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from ._logging import is_rank_zero
from ._logging import logger as amp_logger

if TYPE_CHECKING:
    from ._skip_counts import SkipCounts
    from .scaler import LossScaler

__all__ = ["LossScaleFloorError", "NonFiniteGradientsError", "OverflowReporter"]

# Log the first few skips verbatim (they are normal while a dynamic scale settles), then one
# summary line every SUMMARY_EVERY skips; at WARNING on the ``amp`` logger, from rank 0.
VERBATIM_SKIPS = 8
SUMMARY_EVERY = 100
# How many parameter names an error lists before it says "and N more".
NAMES_SHOWN = 5
# The skip rate is measured over windows of at least SKIP_RATE_WINDOW steps, each closed by the
# first counts the host learns past its end (on CUDA they come late, but steps and skips come
# together). A rate above twice what probing explains, and above MIN_SKIP_RATE, in two windows in a
# row is sustained: the dynamic scale settling after the start (skips in a row) fills one at most.
SKIP_RATE_WINDOW = 100
MIN_SKIP_RATE = 0.05


class NonFiniteGradientsError(RuntimeError):
    """Raised when the gradients stayed non-finite for too many consecutive steps."""


class LossScaleFloorError(RuntimeError):
    """Raised when recurring overflows held the loss scale at a floor below 1 for too many steps."""


# How the error tells an amp user to raise the limit and to reset the scale.
AMP_REMEDY = ("Raise max_consecutive_skips in amp.initialize (or set it to 0 to disable this "
              "check) if the run really needs more skipped steps. To carry on after fixing the "
              "cause, reset the shrunken loss scale of each loss, e.g. "
              "amp.loss_scaler(0, optimizer=optimizer).set_scale(2.**16) for the first, or "
              "resume from a checkpoint.")


class OverflowReporter:
    """Decides, from one optimizer's skip counters, what to log and when to raise.

    ``logger`` receives the skip messages at WARNING (from rank 0, unless ``verbosity`` is 0);
    ``remedy`` ends the error with what the caller's user can change. The skip rate is watched
    where ``step_counts`` says how many steps the counts that ``report`` gets cover.
    """

    def __init__(self, max_consecutive_skips: int, verbosity: int = 1, logger: logging.Logger = amp_logger,
                 remedy: str = AMP_REMEDY, *, scalers: Sequence[LossScaler] = (),
                 max_steps_at_scale_floor: int = 0, step_counts: SkipCounts | None = None) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.verbosity = verbosity
        self.logger = logger
        self.remedy = remedy
        self.reported_skips = 0
        # The loss scalers whose floor is watched (see the module's docstring), and the bound.
        self.scalers = scalers
        self.max_steps_at_scale_floor = max_steps_at_scale_floor
        self.steps = 0
        self.steps_at_floor = 0
        self.step_counts = step_counts
        self.window_start = (0, 0)  # (steps, skips) where the current skip-rate window began
        self.high_rate_windows = 0  # windows in a row whose skip rate was too high

    def report(self, total_skips: int, consecutive_skips: int, describe_skip: Callable[[], str],
               find_culprits: Callable[[], list[str]]) -> None:
        """Report skips up to ``total_skips``; the callables run only when their text is needed.

        Called once per step whose counts the host knows.
        """
        self._watch_floor(total_skips)
        self._watch_skip_rate(total_skips)
        if self.max_consecutive_skips and consecutive_skips > self.max_consecutive_skips:
            raise NonFiniteGradientsError(self._streak_message(consecutive_skips, find_culprits()))
        previous, self.reported_skips = self.reported_skips, total_skips
        if total_skips <= previous:
            return
        if previous < VERBATIM_SKIPS:
            self._log(describe_skip())
            if total_skips >= VERBATIM_SKIPS:
                self._log(f"Gradient overflow: {total_skips} steps skipped so far; further skips "
                          f"are summarised every {SUMMARY_EVERY} skipped steps.")
        elif total_skips // SUMMARY_EVERY > previous // SUMMARY_EVERY:
            self._log(f"Gradient overflow: {total_skips} steps skipped so far. {describe_skip()}")

    def _watch_floor(self, total_skips: int) -> None:
        self.steps += 1
        stuck = [(loss_id, scaler) for loss_id, scaler in enumerate(self.scalers) if scaler.stuck_at_floor()]
        self.steps_at_floor = self.steps_at_floor + 1 if stuck else 0
        if not stuck:
            return
        bound = self.max_steps_at_scale_floor
        if bound and self.steps_at_floor > bound:
            raise LossScaleFloorError(self._floor_message(stuck, total_skips))
        if self.steps_at_floor % SUMMARY_EVERY == 1:
            self._log(self._floor_message(stuck, total_skips))

    def _watch_skip_rate(self, total_skips: int) -> None:
        if self.step_counts is None:
            return
        steps = self.step_counts.steps
        start_steps, start_skips = self.window_start
        if steps - start_steps < SKIP_RATE_WINDOW:
            return
        self.window_start = (steps, total_skips)
        rate = (total_skips - start_skips) / (steps - start_steps)
        self.high_rate_windows = self.high_rate_windows + 1 if rate > self._skip_rate_bound() else 0
        # Held at a floor below 1, the floor's own warning says as much.
        if self.high_rate_windows >= 2 and not self.steps_at_floor:
            self._log(self._skip_rate_message(total_skips - start_skips, steps - start_steps, total_skips, steps))

    def _skip_rate_bound(self) -> float:
        """Twice the skip rate that the dynamic scales' probing explains, and at least MIN_SKIP_RATE."""
        probing = sum(scaler._hysteresis / (scaler._scale_seq_len + scaler._hysteresis)
                      for scaler in self.scalers if scaler.dynamic)
        return max(MIN_SKIP_RATE, 2 * probing)

    def _skip_rate_message(self, window_skips: int, window_steps: int, total_skips: int, steps: int) -> str:
        # Skips happen only under a dynamic scale.
        scaler = next(scaler for scaler in self.scalers if scaler.dynamic)
        return (
            f"Gradient overflow skipped {window_skips} of the last {window_steps} steps "
            f"({100.0 * window_skips / window_steps:.1f}%; {total_skips} of {steps} in all), far more "
            "than the dynamic loss scale's probing for a larger scale explains (it overflows about "
            f"hysteresis={scaler._hysteresis} time(s) per growth_interval={scaler._scale_seq_len} clean "
            "steps): a skipped step trains nothing on its batch. Find what overflows (the skip "
            "warnings name it; an inf/NaN in the forward pass or the loss), tolerate isolated "
            f"overflows with hysteresis=2 or more, lower min_loss_scale={scaler._scale_range[0]!r} if "
            "the scale sits at it (it cannot back off below), or train in bfloat16 (opt_level O4/O5)."
        )

    def _floor_message(self, stuck: list[tuple[int, LossScaler]], total_skips: int) -> str:
        loss_id, scaler = stuck[0]
        floor = scaler._scale_range[0]
        limit = (f"after max_steps_at_scale_floor={self.max_steps_at_scale_floor} such steps amp "
                 "raises LossScaleFloorError" if self.max_steps_at_scale_floor
                 else "max_steps_at_scale_floor=0, so amp does not stop the run")
        return (
            f"The loss scale of loss {loss_id} has sat at its floor min_loss_scale={floor!r} for "
            f"{self.steps_at_floor} step(s), while {total_skips} of {self.steps} steps "
            f"({100.0 * total_skips / self.steps:.1f}%) were skipped for overflow: overflows recur "
            f"more often than once per growth_interval={scaler._scale_seq_len} clean steps, so the "
            "scale cannot grow, and at this scale small fp16 gradients flush to zero and applied "
            "steps may not change the weights at all. Find what overflows (the skip warnings name "
            "it; an inf/NaN in the forward pass or the loss), tolerate isolated overflows with "
            "hysteresis=2 or more, let the scale recover between them with a smaller "
            "growth_interval, or train in bfloat16 (opt_level O4/O5); then reset the scale, e.g. "
            f"amp.loss_scaler({loss_id}, optimizer=optimizer).set_scale(2.**16). ({limit}; "
            "0 disables the check.)"
        )

    def _log(self, message: str) -> None:
        if self.verbosity > 0 and is_rank_zero():
            self.logger.warning(message)

    def _streak_message(self, consecutive_skips: int, culprits: list[str]) -> str:
        names = ", ".join(culprits[:NAMES_SHOWN])
        if len(culprits) > NAMES_SHOWN:
            names += f" and {len(culprits) - NAMES_SHOWN} more"
        where = (f"The first parameters whose gradients were not finite: {names}."
                 if culprits else "No parameter gradient was non-finite at the last check.")
        return (
            f"The gradients were non-finite for {consecutive_skips} consecutive steps "
            f"(limit max_consecutive_skips={self.max_consecutive_skips}), so every step was skipped "
            f"and the loss scale kept shrinking. {where} This usually means a NaN or inf in the "
            "forward pass or in the loss itself (check the inputs, a log/sqrt/division of zero, an "
            f"exploding learning rate), not a loss scale that is too large. {self.remedy}"
        )


def non_finite_grad_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names, in order, of the tensors in ``(name, tensor)`` pairs whose ``.grad`` is not finite."""
    return [name for name, t in named_tensors if t.grad is not None and not _all_finite(t.grad)]


def _all_finite(grad: torch.Tensor) -> bool:
    values = grad.coalesce()._values() if grad.is_sparse else grad
    return bool(torch.isfinite(values).all())

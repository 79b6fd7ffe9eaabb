"""One optimizer's amp controller (``optimizer._amp_stash``): its phase, and the step it applies or skips.

``amp.initialize`` gives each optimizer one controller (``attach.py``), composed with the part that
says what is stepped (``weights.py``). The controller owns the ``Phase`` that a ``scale_loss``
block moves with ``begin_backward``, ``end_backward`` and ``abort_backward`` (a call out of order
raises from here with what to do), the overflow flags that the block notes, and the skip counts.

``optimizer.step`` is wrapped exactly once and calls ``step`` here, which consults those flags:
with an optimizer that accepts ``found_inf`` (torch's ``fused=True`` Adam, AdamW, SGD, Adagrad)
the flag goes to the optimizer and the host never reads it; otherwise the flag is read once and a
non-finite step is skipped without calling the optimizer at all. Either way a skipped step leaves
parameters, optimizer state and step counters untouched.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .. import casting
from .._apex_compat import ApexStashFields
from .._compat import optimizer_accepts_found_inf, record_step_for_lr_scheduler
from .._overflow_report import OverflowReporter, non_finite_grad_names
from .._skip_counts import SkipCounts
from .param_groups import validated_param_group
from .phase import Phase, combine_flags
from .weights import Weights

if TYPE_CHECKING:
    from .._run import AmpContext
    from ..scaler import LossScaler, Unscaler

__all__ = ["OptimizerController"]


def _param_device(optimizer: Any) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def _describe_skip(scalers: Sequence[LossScaler], overflowed_loss_ids: list[int]) -> Callable[[], str]:
    def describe() -> str:
        return "; ".join(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            f"{scalers[loss_id].loss_scale()}" for loss_id in overflowed_loss_ids)
    return describe


class OptimizerController(ApexStashFields):
    """One optimizer's amp state and its way through backward passes and steps.

    ``weights`` says what is stepped (the model's params, or fp32 masters). Apex's field names
    (``all_fp16_params``, ``fp16_groups``, ...) read through to it (``ApexStashFields``), so code
    that read Apex's stash keeps working.
    """

    def __init__(self, optimizer: Any, context: AmpContext, param_names: dict[torch.Tensor, str],
                 max_consecutive_skips: int, weights: Weights) -> None:
        self.optimizer = optimizer
        self.context = context
        self.weights = weights
        self.patch_torch_functions = context.options.patch_torch_functions
        self.param_names = param_names
        self.lazy_init_called = False
        self.phase = Phase.READY
        self._phase_before_backward = Phase.READY
        self._grads_set_aside = False
        # loss_id -> overflow flag (device tensor) of the backward passes since the last step.
        self.found_inf_by_loss: dict[int, torch.Tensor] = {}
        self.skips = SkipCounts(_param_device(optimizer))
        self.reporter = OverflowReporter(max_consecutive_skips, context.verbosity, scalers=context.loss_scalers,
                                         max_steps_at_scale_floor=context.max_steps_at_scale_floor)
        # Exact host counts, kept by the path that reads the flag anyway.
        self.host_total_skips = 0
        self.host_consecutive_skips = 0
        self.original_step = optimizer.step
        self.original_add_param_group = optimizer.add_param_group

    @property
    def master_weights(self) -> bool:
        return self.weights.master_weights

    @property
    def in_backward(self) -> bool:
        """Inside a ``scale_loss`` block."""
        return self.phase is Phase.IN_BACKWARD

    @property
    def grads_still_scaled(self) -> bool:
        """A ``delay_unscale`` block left the grads scaled (still so inside a later block)."""
        phase = self._phase_before_backward if self.phase is Phase.IN_BACKWARD else self.phase
        return phase is Phase.GRADS_SCALED

    def prepare_master_grads(self) -> None:
        """Called by ``amp.master_params``: make the grads it yields hold this step's gradients."""
        self.weights.prepare_master_grads(self.phase)

    def lazy_init(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Build the param lists once (``fp32_values``: exact initial values for new masters)."""
        if not self.lazy_init_called:
            self.init_params(fp32_values)
            self.lazy_init_called = True

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Build the param lists from the optimizer's groups."""
        self.weights.init_params(fp32_values)

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters this optimizer trains."""
        return self.weights.model_params()

    def set_grads_aside(self) -> None:
        """Before a backward: set aside the grads that exist."""
        self.weights.set_grads_aside()

    def unscale_grads(self, unscaler: Unscaler) -> None:
        """After a backward: unscale the new grads and add back those set aside."""
        self.weights.unscale_grads(unscaler, list(self.found_inf_by_loss.values()))

    def check_can_begin_backward(self) -> None:
        """Raise if this optimizer's ``scale_loss`` block has not exited yet."""
        if self.phase is Phase.IN_BACKWARD:
            raise RuntimeError("amp.scale_loss was entered again for an optimizer whose scale_loss "
                               "block has not exited yet. Nesting scale_loss blocks on the same "
                               "optimizer would unscale its gradients twice: finish the first "
                               "block, or pass several losses' sum to one block.")

    def begin_backward(self, set_aside_grads: bool = True) -> None:
        """Enter a ``scale_loss`` block; set the existing grads aside unless they are still scaled.

        With ``set_aside_grads=False`` (``delay_unscale``, or nothing to unscale) they stay in place.
        """
        self.check_can_begin_backward()
        set_aside_grads = self.weights.sets_grads_aside(set_aside_grads, self.phase)
        self._phase_before_backward = self.phase
        self._grads_set_aside = set_aside_grads and self.phase is not Phase.GRADS_SCALED
        self.phase = Phase.IN_BACKWARD
        if self._grads_set_aside:
            self.set_grads_aside()

    def end_backward(self, unscaler: Unscaler | None) -> None:
        """Leave the block: unscale every grad with ``unscaler``; None (delay_unscale) keeps them scaled."""
        # FusedAdam's int step count learns here whether the last step was skipped on the device, so
        # that an LR scheduler stepped next reads it as Apex's; the wait is for a copy that the last
        # step enqueued, behind which this backward's work is already queued.
        settle_step_counts = getattr(self.optimizer, "_settle_step_counts", None)
        if settle_step_counts is not None:
            settle_step_counts()
        if unscaler is None:
            self.phase = Phase.GRADS_SCALED
        else:
            self.phase = Phase.UNSCALED
            self.unscale_grads(unscaler)

    def abort_backward(self) -> None:
        """Leave the block without unscaling: grads set aside come back, the phase is as before."""
        if self.phase is not Phase.IN_BACKWARD:
            return
        if self._grads_set_aside:
            self.weights.restore_grads()
        self.phase = self._phase_before_backward

    def note_found_inf(self, loss_id: int, found_inf: torch.Tensor) -> None:
        """Keep ``loss_id``'s overflow flag for the next step (the max over its backward passes)."""
        flags = self.found_inf_by_loss
        previous = flags.get(loss_id)
        flags[loss_id] = found_inf if previous is None else torch.maximum(previous, found_inf)

    def _check_phase_for_step(self) -> None:
        """Raise if step() comes before the gradients are unscaled."""
        if self.phase is Phase.IN_BACKWARD:
            raise RuntimeError("optimizer.step() was called inside its amp.scale_loss block: the "
                               "gradients are unscaled when the block exits. Call step() after the "
                               "`with` block.")
        if self.phase is Phase.GRADS_SCALED:
            raise RuntimeError("optimizer.step() was called while the gradients are still scaled: the "
                               "last amp.scale_loss block used delay_unscale=True and no block without "
                               "it followed. Run the last backward of the step in a scale_loss block "
                               "with delay_unscale=False (it unscales everything), then call step().")

    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """The wrapped ``optimizer.step``: applied, or skipped if a grad since the last step overflowed."""
        self.weights.check_step(closure, self.phase)
        self._check_phase_for_step()
        self.phase = Phase.READY
        self.context.note_step()
        self.weights.before_step()
        flags_by_loss, self.found_inf_by_loss = self.found_inf_by_loss, {}
        casts_off = casting.disable_casts() if self.patch_torch_functions else contextlib.nullcontext()
        with casts_off:
            if not flags_by_loss:
                self.skips.record_applied()
                result, copy_masters = self._original_step(closure, args, kwargs), True
            elif optimizer_accepts_found_inf(self.optimizer):
                found_inf = combine_flags(list(flags_by_loss.values()))
                # The masters are unchanged on a skipped step, so copying them again is harmless.
                result, copy_masters = self._step_with_found_inf(found_inf, closure, args, kwargs), True
            else:
                result, copy_masters = self._step_reading_flag(flags_by_loss, closure, args, kwargs)
            self.weights.after_step(copy_masters)
        return result

    def _original_step(self, closure: Callable[[], Any] | None, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        # Without a closure, none is passed: many optimizers (LARC's among them) take no closure.
        if closure is None:
            return self.original_step(*args, **kwargs)
        return self.original_step(closure, *args, **kwargs)

    def _step_with_found_inf(self, found_inf: torch.Tensor, closure: Callable[[], Any] | None,
                             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Sync-free step: the optimizer itself skips on ``found_inf`` (device-side)."""
        optimizer = self.optimizer
        device = _param_device(optimizer)
        # Fused optimizers subtract found_inf from 0-dim step counters: it must be 0-dim too.
        found_inf = found_inf.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
        optimizer.grad_scale, optimizer.found_inf = None, found_inf
        try:
            result = self._original_step(closure, args, kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        self.skips.record(found_inf)
        counts = self.skips.host_values()
        if counts is not None:
            self.reporter.report(*counts, lambda: "Gradient overflow.  Skipped step(s), the loss scale "
                                 "was reduced.", self._culprit_finder())
        return result

    def _step_reading_flag(self, flags_by_loss: dict[int, torch.Tensor], closure: Callable[[], Any] | None,
                           args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """Apex's path: one host read of the flags; a non-finite step never reaches the optimizer."""
        loss_ids = list(flags_by_loss)
        values = torch.cat([flags_by_loss[i] for i in loss_ids]).tolist()
        overflowed = [loss_id for loss_id, value in zip(loss_ids, values) if value > 0]
        applied = not overflowed
        self.skips.record_known(not applied)
        if applied:
            result = self._original_step(closure, args, kwargs)
        else:
            # A scheduler that wrapped step() before amp did would otherwise warn that step() was
            # never called.
            record_step_for_lr_scheduler(self.optimizer, self.original_step)
            result = None
        self.host_total_skips += not applied
        self.host_consecutive_skips = 0 if applied else self.host_consecutive_skips + 1
        self.reporter.report(self.host_total_skips, self.host_consecutive_skips,
                             _describe_skip(self.context.loss_scalers, overflowed), self._culprit_finder())
        return result, applied

    def _culprit_finder(self) -> Callable[[], list[str]]:
        """A callable listing the names of the parameters (masters and model) whose grads are not finite."""
        def find() -> list[str]:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            if self.master_weights:
                params += self.weights.low_params
            return non_finite_grad_names(
                (self.param_names.get(p, f"<parameter {index} of the optimizer>"), p)
                for index, p in enumerate(params))
        return find

    def add_param_group(self, new_group: dict[str, Any]) -> None:
        """Validate, then add: a rejected group leaves the optimizer and amp's bookkeeping unchanged."""
        group = validated_param_group(self.optimizer, new_group, self.model_params())
        lengths = [(value, len(value)) for part in self.weights.parts()
                   for value in vars(part).values() if isinstance(value, list)]
        try:
            self.weights.add_group(group)
            self.original_add_param_group(group)
        except BaseException:
            for value, length in lengths:
                del value[length:]
            raise
        self.weights.group_added()

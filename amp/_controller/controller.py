"""One optimizer's amp controller (``optimizer._amp_stash``): its phase, and the step it applies or skips.

``amp.initialize`` gives each optimizer one controller (``attach.py``), composed with the part that
says what is stepped (``weights.py``). The controller owns the ``Phase`` that a ``scale_loss``
block moves with ``begin_backward``, ``end_backward`` and ``abort_backward`` (a call out of order
raises from here with what to do), the overflow flags that the block notes, and the skip counts.

``optimizer.step`` is wrapped exactly once and calls ``step`` here, which consults those flags:
with an optimizer that accepts ``found_inf`` (torch's ``fused=True`` Adam, AdamW, SGD, Adagrad)
the flag goes to the optimizer and the host never reads it; otherwise the flag is read once and a
non-finite step is skipped without calling the optimizer at all. Either way a skipped step leaves
parameters, optimizer state and step counters untouched. amp's part comes before
(``_begin_step``) and after (``_end_step``) the optimizer's own step: ``torch.compile`` runs those
eagerly and compiles only the optimizer's step, as with ``torch.amp.GradScaler.step``.

Under master weights the step also notices the model's low-precision grads written after the
last ``scale_loss`` exit (clipping ``model.parameters()``, the GradScaler habit, which the step
never sees) and says, once, to clip ``amp.master_params(optimizer)`` instead.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .. import casting
from .._apex_compat import ApexStashFields
from .._compat import eager_under_compile, optimizer_accepts_found_inf, record_step_for_lr_scheduler
from .._overflow_report import OverflowReporter, non_finite_grad_names
from .._skip_counts import SkipCounts
from .grads import GradsAtExit
from .param_groups import validated_param_group
from .phase import Phase, check_phase_for_step, combine_flags
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


class _Step:
    """One ``optimizer.step()``: what amp decided before the optimizer's own step, for after it.

    ``found_inf``: the flag handed to an optimizer that skips by itself (None otherwise);
    ``overflowed``: the losses whose flags the host read (None when it read none); ``casts_off``:
    the O1/O4 casts are off until the step is over.
    """

    __slots__ = ("applies", "copies_masters", "found_inf", "overflowed", "casts_off")

    def __init__(self) -> None:
        self.applies = self.copies_masters = True
        self.found_inf: torch.Tensor | None = None
        self.overflowed: list[int] | None = None
        self.casts_off = contextlib.ExitStack()


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
        # Under master weights: the model's grads as the last scale_loss block left them.
        self.grads_at_exit = GradsAtExit()
        self.reporter = OverflowReporter(max_consecutive_skips, context.verbosity, scalers=context.loss_scalers,
                                         max_steps_at_scale_floor=context.max_steps_at_scale_floor,
                                         step_counts=self.skips)
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

    @eager_under_compile
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
            self.weights.set_grads_aside()

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
            if self.master_weights:
                self.grads_at_exit.note(self.weights.low_params)

    def abort_backward(self) -> None:
        """Leave the block without unscaling: grads set aside come back, the phase is as before."""
        if self.phase is not Phase.IN_BACKWARD:
            return
        if self._grads_set_aside:
            self.weights.restore_grads()
        self.phase = self._phase_before_backward
        if self.master_weights:
            self.grads_at_exit.note(self.weights.low_params)  # as amp put them back

    def note_found_inf(self, loss_id: int, found_inf: torch.Tensor) -> None:
        """Keep ``loss_id``'s overflow flag for the next step (the max over its backward passes)."""
        flags = self.found_inf_by_loss
        previous = flags.get(loss_id)
        flags[loss_id] = found_inf if previous is None else torch.maximum(previous, found_inf)

    @eager_under_compile(recursive=False)
    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """The wrapped ``optimizer.step``: applied, or skipped if a grad since the last step overflowed.

        Under ``torch.compile`` amp's part before and after the optimizer's own step runs as it is,
        and only the optimizer's step is compiled (as with ``torch.amp.GradScaler.step``).
        """
        step = self._begin_step(closure)
        try:
            if not step.applies:
                result = None
            elif closure is None:  # none is passed: many optimizers (LARC's among them) take no closure
                result = self.original_step(*args, **kwargs)
            else:
                result = self.original_step(closure, *args, **kwargs)
        except BaseException:
            self._abandon_step(step)
            raise
        self._end_step(step)
        return result

    @eager_under_compile
    def _begin_step(self, closure: Callable[[], Any] | None) -> _Step:
        """Check, take the overflow flags, and decide: the optimizer skips by itself on ``found_inf``
        (sync-free), or the host reads the flags once and a non-finite step never reaches it."""
        self.weights.check_step(closure, self.phase)
        check_phase_for_step(self.phase)
        if self.master_weights:
            self.grads_at_exit.warn_if_changed(self.weights.low_params)
        self.phase = Phase.READY
        self.context.note_step()
        self.weights.before_step()
        flags_by_loss, self.found_inf_by_loss = self.found_inf_by_loss, {}
        step = _Step()
        if self.patch_torch_functions:
            step.casts_off.enter_context(casting.disable_casts())
        try:
            if not flags_by_loss:
                self.skips.record_applied()
            elif optimizer_accepts_found_inf(self.optimizer):
                self._hand_over_found_inf(step, combine_flags(list(flags_by_loss.values())))
            else:
                self._read_flags(step, flags_by_loss)
        except BaseException:
            step.casts_off.close()
            raise
        return step

    def _hand_over_found_inf(self, step: _Step, found_inf: torch.Tensor) -> None:
        """Sync-free: the optimizer itself skips on ``found_inf`` (device-side); the masters are
        unchanged on a skipped step, so copying them again is harmless."""
        device = _param_device(self.optimizer)
        # Fused optimizers subtract found_inf from 0-dim step counters: it must be 0-dim too.
        step.found_inf = found_inf.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
        self.optimizer.grad_scale, self.optimizer.found_inf = None, step.found_inf

    def _read_flags(self, step: _Step, flags_by_loss: dict[int, torch.Tensor]) -> None:
        """Apex's path: one host read of the flags; a non-finite step never reaches the optimizer."""
        loss_ids = list(flags_by_loss)
        values = torch.cat([flags_by_loss[i] for i in loss_ids]).tolist()
        step.overflowed = [loss_id for loss_id, value in zip(loss_ids, values) if value > 0]
        step.applies = step.copies_masters = not step.overflowed
        self.skips.record_known(not step.applies)
        if not step.applies:
            # A scheduler that wrapped step() before amp did would otherwise warn that step() was
            # never called.
            record_step_for_lr_scheduler(self.optimizer, self.original_step)

    @eager_under_compile
    def _abandon_step(self, step: _Step) -> None:
        """The optimizer's step raised: take the flag back and turn the casts on again."""
        try:
            if step.found_inf is not None:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        finally:
            step.casts_off.close()

    @eager_under_compile
    def _end_step(self, step: _Step) -> None:
        """Count and report the step, applied or skipped; copy the masters into the model."""
        with step.casts_off:
            if step.found_inf is not None:
                del self.optimizer.grad_scale, self.optimizer.found_inf
                self.skips.record(step.found_inf)
                counts = self.skips.host_values()
                if counts is not None:
                    self.reporter.report(*counts, lambda: "Gradient overflow.  Skipped step(s), the loss "
                                         "scale was reduced.", self._culprit_finder())
            elif step.overflowed is not None:
                self.host_total_skips += not step.applies
                self.host_consecutive_skips = 0 if step.applies else self.host_consecutive_skips + 1
                self.reporter.report(self.host_total_skips, self.host_consecutive_skips,
                                     _describe_skip(self.context.loss_scalers, step.overflowed),
                                     self._culprit_finder())
            self.weights.after_step(step.copies_masters)

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

"""Per-optimizer amp controller (``optimizer._amp_stash``) and the optimizer methods delegating to it.

``amp.initialize`` gives each optimizer one controller: ``WithMasterWeights`` (O2/O5: fp32
masters are stepped, then copied into the low-precision model) or ``WithoutMasterWeights`` (the
model's own params are stepped). It owns the param lists, the grads set aside during a backward,
the overflow flags and skip counts, and a ``Phase`` that ``scale_loss`` moves with
``begin_backward``, ``end_backward`` and ``abort_backward``; a call out of order raises from there
with what to do. Apex's field names (``all_fp16_params``, ``fp16_groups``, ...) are attributes of
the controller, so code that read Apex's stash keeps working.

``step`` is wrapped exactly once and delegates to the controller, which consults the overflow
flags that ``scale_loss`` recorded: with an optimizer that accepts ``found_inf`` (torch's
``fused=True`` Adam, AdamW, SGD, Adagrad) the flag goes to the optimizer and the host never reads
it; otherwise the flag is read once and a non-finite step is skipped without calling the optimizer
at all. Either way a skipped step leaves parameters, optimizer state and step counters untouched.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.optim.optimizer import required

from . import _collective_writes, casting
from ._compat import (LR_SCHEDULER_STEP_MARKS, coalesced_sparse_coo_tensor, optimizer_accepts_found_inf,
                      record_step_for_lr_scheduler)
from ._master_weights import LOW_PRECISION_DTYPES, check_trainable_dtype, swap_in_fp32_masters
from ._overflow_report import OverflowReporter, non_finite_grad_names
from ._skip_counts import SkipCounts

if TYPE_CHECKING:
    from ._run import AmpContext
    from .scaler import Unscaler

# Methods _process_optimizer attaches; an optimizer that already has one is refused.
ATTACHED_METHODS = ("_lazy_init_maybe_master_weights", "_master_params_to_model_params",
                    "_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init")


class Phase(enum.Enum):
    """Where an optimizer stands between two steps (like GradScaler's ``OptState``)."""

    READY = "ready"  # no backward was unscaled since the last step
    IN_BACKWARD = "in backward"  # inside a scale_loss block
    GRADS_SCALED = "grads scaled"  # a delay_unscale block left the grads scaled
    UNSCALED = "unscaled"  # the grads are unscaled and wait for step()


def _param_device(optimizer):
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def _stash_and_clear_grads(params, stash_list):
    """Set aside the grads that exist before a backward; they are added back once it is unscaled.

    The slots are all None between backward passes, so with no grads (``zero_grad`` sets them to
    None) there is nothing to do, and nothing is written.
    """
    if all(param.grad is None for param in params):
        return
    for index, param in enumerate(params):
        stash_list[index] = param.grad
        param.grad = None


def _put_back_grads(params, stash_list):
    """Put back the grads ``_stash_and_clear_grads`` set aside (a failed backward)."""
    for index, param in enumerate(params):
        param.grad = stash_list[index]
        stash_list[index] = None


def _unscaled_sparse(scaler, grad, dtype, previous):
    """``grad`` (sparse COO, scaled) unscaled into ``dtype``, plus ``previous`` (already unscaled).

    Its values join the scaler's overflow check like dense grads do (coalesced first, so each
    row is counted once, as torch's GradScaler does).
    """
    grad = grad.coalesce()
    values = grad._values()
    out = values if values.dtype == dtype else torch.empty_like(values, dtype=dtype)
    scaler.unscale_into([values], [out], models_are_masters=out is values)
    unscaled = coalesced_sparse_coo_tensor(grad._indices(), out, grad.shape)
    return unscaled if previous is None else previous + unscaled


def _unscale_models_are_masters(scaler, params, stash_list):
    """Unscale new grads in place; add back what was stashed before this backward (never lost)."""
    if all(slot is None for slot in stash_list):
        # The common case, a backward after zero_grad: one list, no per-parameter branching.
        fresh = [grad for grad in (param.grad for param in params) if grad is not None]
        if not any(grad.is_sparse for grad in fresh):
            if fresh:
                scaler.unscale_into(fresh, fresh, models_are_masters=True)
            return
    fresh, with_stash, stashed = [], [], []
    for index, param in enumerate(params):
        previous = stash_list[index]
        stash_list[index] = None
        if param.grad is None:
            param.grad = previous
        elif param.grad.is_sparse:
            param.grad = _unscaled_sparse(scaler, param.grad, param.dtype, previous)
        elif previous is None:
            fresh.append(param.grad)
        else:
            with_stash.append(param.grad)
            stashed.append(previous)
    if fresh:
        scaler.unscale_into(fresh, fresh, models_are_masters=True)
    if with_stash:
        scaler.unscale_with_stashed(with_stash, stashed, with_stash)


def _validated_param_group(optimizer, new_group, tracked_params):
    """A copy of ``new_group`` with its params as a list, checked as torch checks it and against
    the model params amp already tracks. Raises before anything changes."""
    if not isinstance(new_group, dict):
        raise TypeError(f"param group must be a dict, got {type(new_group).__name__}.")
    if "params" not in new_group:
        raise ValueError("param group must have a 'params' entry.")
    group = dict(new_group)
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                        "ordering of tensors in sets will change between runs. Please use a list instead.")
    params = group["params"] = list(params)
    for index, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is "
                            f"{type(param).__name__}.")
        if not param.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor.")
        check_trainable_dtype(param, f"<parameter {index} of the new param group>")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("the new param group contains the same parameter more than once; amp would "
                         "unscale and step it twice. Pass each parameter once.")
    existing = {id(p) for p in tracked_params}
    existing.update(id(p) for g in optimizer.param_groups for p in g["params"])
    if any(id(p) in existing for p in params):
        raise ValueError("some parameters appear in more than one parameter group (the new group "
                         "holds a parameter this optimizer already has).")
    for name, default in optimizer.defaults.items():
        if default is required and name not in group:
            raise ValueError(f"parameter group didn't specify a value of required optimization "
                             f"parameter {name}")
    return group


def _combine_flags(flags):
    """One overflow flag (device tensor) from the flags of several backward passes."""
    return flags[0] if len(flags) == 1 else torch.cat(flags).amax(dim=0, keepdim=True)


def _describe_skip(scalers, overflowed_loss_ids):
    def describe():
        return "; ".join(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            f"{scalers[loss_id].loss_scale()}" for loss_id in overflowed_loss_ids)
    return describe


class OptimizerController:
    """One optimizer's amp state and its way through backward passes and steps.

    Subclasses say what is stepped, fp32 masters or the model's own params, through
    ``init_params``, ``_add_group``, ``model_params``, ``set_grads_aside``, ``unscale_grads`` and
    ``_restore_grads``. The lists they build are plain attributes with Apex's names;
    ``add_param_group`` rolls them back by length.
    """

    master_weights = False
    # Apex's field, in every controller: the low-precision params among those the optimizer trains.
    all_fp16_params: list[torch.Tensor]

    def __init__(self, optimizer: Any, context: AmpContext, param_names: dict[torch.Tensor, str],
                 max_consecutive_skips: int) -> None:
        self.optimizer = optimizer
        self.context = context
        self.patch_torch_functions = context.options.patch_torch_functions
        self.param_names = param_names
        self.lazy_init_called = False
        self.already_patched = False  # Apex field; stays False: step is never re-patched here
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
    def in_scale_loss(self) -> bool:
        """Apex's flag: inside a ``scale_loss`` block."""
        return self.phase is Phase.IN_BACKWARD

    @property
    def params_have_scaled_gradients(self) -> bool:
        """Apex's flag: a ``delay_unscale`` block left the grads scaled (still so inside a block)."""
        phase = self._phase_before_backward if self.phase is Phase.IN_BACKWARD else self.phase
        return phase is Phase.GRADS_SCALED

    def prepare_master_grads(self) -> None:
        """Called by ``amp.master_params``: make the grads it yields hold this step's gradients."""

    def lazy_init(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Build the param lists once (``fp32_values``: exact initial values for new masters)."""
        if not self.lazy_init_called:
            self.init_params(fp32_values)
            self.lazy_init_called = True

    # What a subclass says: what is stepped, and how grads are set aside, unscaled and put back.

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Build the param lists from the optimizer's groups."""
        raise NotImplementedError

    def _add_group(self, group: dict[str, Any]) -> None:
        """Take in the params of a new param group."""
        raise NotImplementedError

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters this optimizer trains."""
        raise NotImplementedError

    def set_grads_aside(self) -> None:
        """Before a backward: set aside the grads that exist."""
        raise NotImplementedError

    def unscale_grads(self, scaler: Unscaler) -> None:
        """After a backward: unscale the new grads and add back those set aside."""
        raise NotImplementedError

    def _restore_grads(self) -> None:
        """After a failed backward: put back the grads set aside."""
        raise NotImplementedError

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
        self._phase_before_backward = self.phase
        self._grads_set_aside = set_aside_grads and self.phase is not Phase.GRADS_SCALED
        self.phase = Phase.IN_BACKWARD
        if self._grads_set_aside:
            self.set_grads_aside()

    def end_backward(self, scaler: Unscaler | None) -> None:
        """Leave the block: unscale every grad with ``scaler``; None (delay_unscale) keeps them scaled."""
        if scaler is None:
            self.phase = Phase.GRADS_SCALED
        else:
            self.phase = Phase.UNSCALED
            self.unscale_grads(scaler)

    def abort_backward(self) -> None:
        """Leave the block without unscaling: grads set aside come back, the phase is as before."""
        if self.phase is not Phase.IN_BACKWARD:
            return
        if self._grads_set_aside:
            self._restore_grads()
        self.phase = self._phase_before_backward

    def note_found_inf(self, loss_id: int, found_inf: torch.Tensor) -> None:
        """Keep ``loss_id``'s overflow flag for the next step (the max over its backward passes)."""
        flags = self.found_inf_by_loss
        previous = flags.get(loss_id)
        flags[loss_id] = found_inf if previous is None else torch.maximum(previous, found_inf)

    def _check_step(self, closure: Callable[[], Any] | None) -> None:
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
        self._check_step(closure)
        self.phase = Phase.READY
        self._before_step()
        flags_by_loss, self.found_inf_by_loss = self.found_inf_by_loss, {}
        casts_off = casting.disable_casts() if self.patch_torch_functions else contextlib.nullcontext()
        with casts_off:
            if not flags_by_loss:
                self.skips.record_applied()
                result, copy_masters = self._original_step(closure, args, kwargs), True
            elif optimizer_accepts_found_inf(self.optimizer):
                found_inf = _combine_flags(list(flags_by_loss.values()))
                # The masters are unchanged on a skipped step, so copying them again is harmless.
                result, copy_masters = self._step_with_found_inf(found_inf, closure, args, kwargs), True
            else:
                result, copy_masters = self._step_reading_flag(flags_by_loss, closure, args, kwargs)
            self._after_step(copy_masters)
        return result

    def _original_step(self, closure, args, kwargs):
        # Without a closure, none is passed: many optimizers (LARC's among them) take no closure.
        if closure is None:
            return self.original_step(*args, **kwargs)
        return self.original_step(closure, *args, **kwargs)

    def _before_step(self) -> None:
        """What a subclass must do before every step."""

    def _after_step(self, copy_masters: bool) -> None:
        """What a subclass must do after every step, applied or skipped."""

    def _step_with_found_inf(self, found_inf, closure, args, kwargs):
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

    def _step_reading_flag(self, flags_by_loss, closure, args, kwargs):
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
        def find():
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            if self.master_weights:
                params += self.all_fp16_params
            return non_finite_grad_names(
                (self.param_names.get(p, f"<parameter {index} of the optimizer>"), p)
                for index, p in enumerate(params))
        return find

    def add_param_group(self, new_group: dict[str, Any]) -> None:
        """Validate, then add: a rejected group leaves the optimizer and amp's bookkeeping unchanged."""
        group = _validated_param_group(self.optimizer, new_group, self.model_params())
        lengths = {name: len(value) for name, value in vars(self).items() if isinstance(value, list)}
        try:
            self._add_group(group)
            self.original_add_param_group(group)
        except BaseException:
            for name, length in lengths.items():
                del getattr(self, name)[length:]
            raise


class WithoutMasterWeights(OptimizerController):
    """The model's own params (fp32 and low precision) are stepped; their grads are unscaled in place."""

    all_fp32_params: list[torch.Tensor]
    all_fp16_grad_stash: list[torch.Tensor | None]
    all_fp32_grad_stash: list[torch.Tensor | None]

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Sort the params into ``all_fp16_params`` and ``all_fp32_params`` (``fp32_values``: unused)."""
        self.all_fp16_params, self.all_fp32_params = [], []
        self.all_fp16_grad_stash, self.all_fp32_grad_stash = [], []
        for group in self.optimizer.param_groups:
            self._add_group(group)

    def _add_group(self, group: dict[str, Any]) -> None:
        """Sort params into the low-precision and fp32 lists, each with a stash slot."""
        for param in group["params"]:
            check_trainable_dtype(param, self.param_names.get(param, "<parameter of the optimizer>"))
            if param.dtype in LOW_PRECISION_DTYPES:
                self.all_fp16_params.append(param)
                self.all_fp16_grad_stash.append(None)
            else:
                self.all_fp32_params.append(param)
                self.all_fp32_grad_stash.append(None)

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters this optimizer trains."""
        return self.all_fp16_params + self.all_fp32_params

    def set_grads_aside(self) -> None:
        """Apex's ``_prepare_amp_backward``: the grads so far wait while a backward adds new ones."""
        _stash_and_clear_grads(self.all_fp16_params, self.all_fp16_grad_stash)
        _stash_and_clear_grads(self.all_fp32_params, self.all_fp32_grad_stash)

    def unscale_grads(self, scaler: Unscaler) -> None:
        """Apex's ``_post_amp_backward``: unscale the new grads and add back those set aside."""
        _unscale_models_are_masters(scaler, self.all_fp16_params, self.all_fp16_grad_stash)
        _unscale_models_are_masters(scaler, self.all_fp32_params, self.all_fp32_grad_stash)

    def _restore_grads(self) -> None:
        _put_back_grads(self.all_fp16_params, self.all_fp16_grad_stash)
        _put_back_grads(self.all_fp32_params, self.all_fp32_grad_stash)


class WithMasterWeights(OptimizerController):
    """fp32 masters are stepped in place of the low-precision params, then copied into them.

    The model's low-precision grads stay scaled; each backward is unscaled into the masters' grads,
    which hold what was accumulated since the last step.
    """

    master_weights = True
    # Apex's fields (made by init_params): per param group, then flat over all groups.
    fp16_groups: list[list[torch.Tensor]]
    fp32_from_fp16_groups: list[list[torch.Tensor]]
    fp32_from_fp32_groups: list[list[torch.Tensor]]
    all_fp32_from_fp16_params: list[torch.Tensor]
    all_fp32_from_fp32_params: list[torch.Tensor]
    all_fp16_grad_stash: list[torch.Tensor | None]
    all_fp32_from_fp32_grad_stash: list[torch.Tensor | None]
    master_grad_buffers: list[torch.Tensor | None]
    model_versions: list[int]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._warned_step_without_backward = False

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Swap in an fp32 master for each low-precision param (exact values from ``fp32_values``)."""
        for name in ("fp16_groups", "fp32_from_fp16_groups", "fp32_from_fp32_groups", "all_fp16_params",
                     "all_fp32_from_fp16_params", "all_fp32_from_fp32_params", "all_fp16_grad_stash",
                     "all_fp32_from_fp32_grad_stash", "master_grad_buffers"):
            setattr(self, name, [])
        for group in self.optimizer.param_groups:
            self._add_group(group, fp32_values)
        for param in self.all_fp32_from_fp16_params + self.all_fp32_from_fp32_params:
            param.grad = None
        # Recast existing optimizer state (momentum, ...) to the masters' fp32.
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self._note_model_versions()

    def _add_group(self, group: dict[str, Any], fp32_values: dict[int, torch.Tensor] | None = None) -> None:
        """Swap each low-precision param of ``group`` for an fp32 master and record all three kinds."""
        for param in group["params"]:
            if param.requires_grad:
                check_trainable_dtype(param, self.param_names.get(param, "<parameter of the optimizer>"))
        fp16_params, masters, fp32_params = swap_in_fp32_masters(self.optimizer, group, fp32_values)
        for param, master in zip(fp16_params, masters):
            name = self.param_names.get(param)
            if name is not None:  # an unnamed param's master is named by its position, as the param
                self.param_names.setdefault(master, name)
        self.fp16_groups.append(fp16_params)
        self.fp32_from_fp16_groups.append(masters)
        self.fp32_from_fp32_groups.append(fp32_params)
        self.all_fp16_params += fp16_params
        self.all_fp32_from_fp16_params += masters
        self.all_fp32_from_fp32_params += fp32_params
        self.all_fp16_grad_stash += [None for _ in fp16_params]
        self.master_grad_buffers += [None for _ in masters]
        self.all_fp32_from_fp32_grad_stash += [None for _ in fp32_params]
        _collective_writes.watch(self, fp16_params)

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters this optimizer trains (not the masters)."""
        return self.all_fp16_params + self.all_fp32_from_fp32_params

    def set_grads_aside(self) -> None:
        """Apex's ``_prepare_amp_backward``: the grads so far wait while a backward adds new ones."""
        # The masters hold what was accumulated so far; the model's fp16 grads start afresh.
        for param in self.all_fp16_params:
            if param.grad is not None:
                param.grad = None
        _stash_and_clear_grads(self.all_fp32_from_fp32_params, self.all_fp32_from_fp32_grad_stash)

    def unscale_grads(self, scaler: Unscaler) -> None:
        """Apex's ``_post_amp_backward``: unscale the model's grads into (or onto) the masters'."""
        fresh_model, fresh_master, acc_model, acc_master = [], [], [], []
        for index, (param, master) in enumerate(zip(self.all_fp16_params, self.all_fp32_from_fp16_params)):
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                master.grad = _unscaled_sparse(scaler, grad, master.dtype, master.grad)
            elif master.grad is None:
                master.grad = self._master_grad_buffer(index, master)
                fresh_model.append(grad)
                fresh_master.append(master.grad)
            else:
                acc_model.append(grad)
                acc_master.append(master.grad)
        if fresh_model:
            scaler.unscale_into(fresh_model, fresh_master)
        if acc_model:
            scaler.unscale_with_stashed(acc_model, acc_master, acc_master)
        _unscale_models_are_masters(scaler, self.all_fp32_from_fp32_params,
                                    self.all_fp32_from_fp32_grad_stash)

    def _master_grad_buffer(self, index: int, master: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor that receives ``master``'s unscaled grad, allocated once and reused.

        Every step sets the masters' ``.grad`` back to None, so no step sees another's values; reusing
        the tensor saves an allocation per parameter per step.
        """
        buffer = self.master_grad_buffers[index]
        if buffer is None:
            buffer = self.master_grad_buffers[index] = torch.empty_like(master)
        return buffer

    def _restore_grads(self) -> None:
        for param in self.all_fp16_params:
            param.grad = None
        _put_back_grads(self.all_fp32_from_fp32_params, self.all_fp32_from_fp32_grad_stash)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's grads and the masters' (which ``optimizer.zero_grad`` would not reach)."""
        for param in self.all_fp16_params + self.all_fp32_from_fp32_params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()
        for master in self.all_fp32_from_fp16_params:
            master.grad = None

    def master_params_to_model_params(self) -> None:
        """Round the masters into the model's low-precision params."""
        if self.all_fp16_params:
            # A plain rounding copy, no scaling and no check: PyTorch's foreach copy is the fastest
            # kernel for it (amp_C's scale-by-1.0 measured 2x slower on CPU for fp32 -> fp16).
            with torch.no_grad():
                torch._foreach_copy_(self.all_fp16_params, self.all_fp32_from_fp16_params)
            self._note_model_versions()

    def _note_model_versions(self) -> None:
        """Remember each low-precision param's version right after amp wrote it (see below)."""
        self.model_versions = [param._version for param in self.all_fp16_params]

    def _refresh_masters_written_elsewhere(self) -> None:
        """Take into its master the value of each low-precision param that something else wrote.

        Runs at the start of every step, before the masters are stepped and copied back. DDP's
        broadcast of rank 0's weights, ``load_state_dict`` on a submodule or an in-place edit changes
        a param after its master was made; stepping the stale master would write it back (and DDP
        ranks would diverge). A master is kept only if it rounds to the param and was itself
        written since it was made (by a step, or by loading a checkpoint through the model): the param
        was then rounded from it, and its extra fp32 bits are the same on every rank. An untouched
        master holds this process's own initial weights, which another rank's broadcast weights may
        round alike from different fp32 values, so it is replaced.

        Collectives (``dist.broadcast(p, 0)``, also through ``p.data``) do not bump the version; a
        param that one wrote is seen by ``_collective_writes`` on every rank of the group, and its
        master is replaced on every rank whatever the values, so that all ranks hold the same
        masters (in a group of one rank, the rule above applies). Other writes through
        ``param.data`` bypass the version counter and go unseen.
        """
        written = _collective_writes.take_written(self)
        versions = [param._version for param in self.all_fp16_params]
        recorded = self.model_versions
        if versions == recorded and not written:
            return
        with torch.no_grad():
            pairs = zip(self.all_fp16_params, self.all_fp32_from_fp16_params)
            for index, (param, master) in enumerate(pairs):
                group_size = _collective_writes.group_size_of_write(param, written) if written else 0
                if group_size > 1:
                    master.copy_(param)
                    continue
                if not group_size and index < len(recorded) and recorded[index] == versions[index]:
                    continue
                if master._version == 0 or not torch.equal(master.to(param.dtype), param):
                    master.copy_(param)
        self.model_versions = versions

    def _check_step(self, closure: Callable[[], Any] | None) -> None:
        """Also refuse a closure, and warn (once) of a step with nothing to train."""
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers under master "
                               "weights (O2/O5): call the closure yourself, then optimizer.step().")
        super()._check_step(closure)
        if self.phase is Phase.READY and not self._warned_step_without_backward:
            self._warned_step_without_backward = True
            warnings.warn("optimizer.step() was called under master weights (O2/O5) with no "
                          "amp.scale_loss backward since the last step: the fp32 master weights have no "
                          "gradients, so nothing is trained. Run the backward inside "
                          "`with amp.scale_loss(loss, optimizer) as scaled_loss:`. (Warned once.)",
                          stacklevel=4)

    def _before_step(self) -> None:
        self._refresh_masters_written_elsewhere()

    def _after_step(self, copy_masters: bool) -> None:
        """Master->model copy and master-grad clearing that follow every step, applied or skipped."""
        if copy_masters:
            self.master_params_to_model_params()
        for master in self.all_fp32_from_fp16_params:
            master.grad = None


def controller_of(optimizer: Any) -> OptimizerController:
    """The controller ``amp.initialize`` gave ``optimizer`` (its ``_amp_stash``)."""
    return optimizer._amp_stash


def _amp_step(optimizer, *args, **kwargs):
    """``optimizer.step`` after initialize: the controller's step."""
    return optimizer._amp_stash.step(*args, **kwargs)


def _process_optimizer(optimizer, context, param_names, fp32_values, max_consecutive_skips):
    """Give ``optimizer`` its controller (``_amp_stash``) and delegating methods, once, and its masters.

    ``amp.initialize`` has checked the optimizer already (see ``ATTACHED_METHODS``).
    """
    masters = context.options.master_weights and not context.sharded_masters
    kind = WithMasterWeights if masters else WithoutMasterWeights
    if kind is WithMasterWeights:
        # amp.optimizers name their own controller, so amp never imports them.
        kind = getattr(optimizer, "_amp_master_weights_controller", kind)
    controller = kind(optimizer, context, dict(param_names), max_consecutive_skips)
    optimizer._amp_stash = controller
    # Apex's method names, for code that calls them on the optimizer.
    optimizer._amp_lazy_init = controller.lazy_init
    optimizer._lazy_init_maybe_master_weights = controller.init_params
    optimizer._prepare_amp_backward = controller.set_grads_aside
    optimizer._post_amp_backward = controller.unscale_grads
    if isinstance(controller, WithMasterWeights):
        optimizer._master_params_to_model_params = controller.master_params_to_model_params
        optimizer.zero_grad = controller.zero_grad
    optimizer.add_param_group = controller.add_param_group
    step = _amp_step
    marks = [mark for mark in LR_SCHEDULER_STEP_MARKS if hasattr(controller.original_step, mark)]
    if marks:
        # An LR scheduler created before initialize warns at its first step() unless it finds its
        # mark on optimizer.step; the mark goes on a per-optimizer copy, never on _amp_step itself.
        @functools.wraps(_amp_step)
        def step(self, *args, **kwargs):
            return _amp_step(self, *args, **kwargs)
        for mark in marks:
            setattr(step, mark, True)
    # Bound to the optimizer itself: an LR scheduler created later rebinds step's function to it.
    optimizer.step = types.MethodType(step, optimizer)
    # Masters are made now (Apex made them lazily) so that checkpoints loaded right after
    # initialize land on the fp32 masters with no precision lost.
    controller.lazy_init(fp32_values)

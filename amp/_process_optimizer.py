"""Per-optimizer amp state (``optimizer._amp_stash``) and the methods ``amp.initialize`` attaches.

``step`` is wrapped exactly once. The wrapper consults the overflow flags that ``scale_loss``
left on the stash: with an optimizer that accepts ``found_inf`` (torch's ``fused=True`` Adam,
AdamW, SGD, Adagrad) the flag goes to the optimizer and the host never reads it; otherwise the
flag is read once and a non-finite step is skipped without calling the optimizer at all. Either
way a skipped step leaves parameters, optimizer state and step counters untouched.
"""
import contextlib
import functools
import types
import warnings

import torch
from torch.optim.optimizer import required

from . import casting
from ._master_weights import swap_in_fp32_masters
from ._overflow_report import OverflowReporter, non_finite_grad_names
from ._skip_counts import SkipCounts

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Methods _process_optimizer attaches; an optimizer that already has one is refused.
ATTACHED_METHODS = ("_lazy_init_maybe_master_weights", "_master_params_to_model_params",
                    "_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init")


class AmpOptimizerState:
    """Apex's attribute bag, plus the device-side skip signal of the pending and the last step."""

    def __init__(self, master_weights, param_names, max_consecutive_skips, device, verbosity=1):
        self.master_weights = bool(master_weights)
        self.lazy_init_called = False
        self.already_patched = False  # Apex field; stays False: step is never re-patched here
        self.params_have_scaled_gradients = False
        # Phase of the GradScaler-like state machine: inside a scale_loss block; unscaled
        # gradients waiting for step(); step() without scale_loss under master weights (warned once).
        self.in_scale_loss = False
        self.unscaled_since_step = False
        self.warned_step_without_scale_loss = False
        self.param_names = param_names
        # loss_id -> overflow flag (device tensor) of the backward passes since the last step.
        self.found_inf_by_loss = {}
        self.skips = SkipCounts(device)
        self.reporter = OverflowReporter(max_consecutive_skips, verbosity)
        # Exact host counts, kept by the path that reads the flag anyway.
        self.host_total_skips = 0
        self.host_consecutive_skips = 0

    def model_params(self):
        """The model's own parameters this optimizer trains (not the masters)."""
        if self.master_weights:
            return self.all_fp16_params + self.all_fp32_from_fp32_params
        return self.all_fp16_params + self.all_fp32_params


def _param_device(optimizer):
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def _check_param_type(param, what):
    if not param.is_floating_point():
        raise TypeError(f"{what} must be floating point (torch.float32, torch.float16 or "
                        f"torch.bfloat16); received a parameter of dtype {param.dtype}.")


def _lazy_init_with_master_weights(self):
    stash = self._amp_stash
    for name in ("fp16_groups", "fp32_from_fp16_groups", "fp32_from_fp32_groups", "all_fp16_params",
                 "all_fp32_from_fp16_params", "all_fp32_from_fp32_params", "all_fp16_grad_stash",
                 "all_fp32_from_fp32_grad_stash", "master_grad_buffers"):
        setattr(stash, name, [])
    for group in self.param_groups:
        _add_master_group(self, group, stash.fp32_values)
    for param in stash.all_fp32_from_fp16_params + stash.all_fp32_from_fp32_params:
        param.grad = None
    # Recast existing optimizer state (momentum, ...) to the masters' fp32.
    self.load_state_dict(self.state_dict())
    _note_model_versions(stash)


def _add_master_group(optimizer, group, fp32_values):
    """Swap each low-precision param of ``group`` for an fp32 master and record all three kinds."""
    stash = optimizer._amp_stash
    for param in group["params"]:
        if param.requires_grad:
            _check_param_type(param, "Optimizer parameters")
    fp16_params, masters, fp32_params = swap_in_fp32_masters(optimizer, group, fp32_values)
    for param, master in zip(fp16_params, masters):
        stash.param_names.setdefault(master, stash.param_names.get(param))
    stash.fp16_groups.append(fp16_params)
    stash.fp32_from_fp16_groups.append(masters)
    stash.fp32_from_fp32_groups.append(fp32_params)
    stash.all_fp16_params += fp16_params
    stash.all_fp32_from_fp16_params += masters
    stash.all_fp32_from_fp32_params += fp32_params
    stash.all_fp16_grad_stash += [None for _ in fp16_params]
    stash.master_grad_buffers += [None for _ in masters]
    stash.all_fp32_from_fp32_grad_stash += [None for _ in fp32_params]


def _lazy_init_no_master_weights(self):
    stash = self._amp_stash
    stash.all_fp16_params, stash.all_fp32_params = [], []
    stash.all_fp16_grad_stash, stash.all_fp32_grad_stash = [], []
    for group in self.param_groups:
        _add_plain_params(stash, group["params"])


def _add_plain_params(stash, params):
    """Sort params into the low-precision and fp32 lists (no masters), each with a stash slot."""
    for param in params:
        _check_param_type(param, "Optimizer parameters")
        if param.dtype in LOW_PRECISION:
            stash.all_fp16_params.append(param)
            stash.all_fp16_grad_stash.append(None)
        else:
            stash.all_fp32_params.append(param)
            stash.all_fp32_grad_stash.append(None)


def _amp_lazy_init(self):
    stash = self._amp_stash
    if not stash.lazy_init_called:
        self._lazy_init_maybe_master_weights()
        stash.lazy_init_called = True


def _master_params_to_model_params(self):
    stash = self._amp_stash
    if stash.all_fp16_params:
        # A plain rounding copy, no scaling and no check: PyTorch's foreach copy is the fastest
        # kernel for it (amp_C's scale-by-1.0 measured 2x slower on CPU for fp32 -> fp16).
        with torch.no_grad():
            torch._foreach_copy_(stash.all_fp16_params, stash.all_fp32_from_fp16_params)
        _note_model_versions(stash)


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


def _note_model_versions(stash):
    """Remember each low-precision param's version right after amp wrote it (see below)."""
    stash.model_versions = [param._version for param in stash.all_fp16_params]


def _refresh_masters_written_elsewhere(stash):
    """Take into its master the value of each low-precision param that something else wrote.

    Runs at the start of every step, before the masters are stepped and copied back. DDP's
    broadcast of rank 0's weights, ``load_state_dict`` on a submodule or an in-place edit changes
    a param after its master was made; stepping the stale master would write it back (and DDP
    ranks would diverge). A master is kept only if it rounds to the param and was itself
    written since it was made (by a step, or by loading a checkpoint through the model): the param
    was then rounded from it, and its extra fp32 bits are the same on every rank. An untouched
    master holds this process's own initial weights, which another rank's broadcast weights may
    round alike from different fp32 values, so it is replaced. Writes through ``param.data``
    bypass the version counter and go unseen.
    """
    versions = [param._version for param in stash.all_fp16_params]
    recorded = stash.model_versions
    if versions == recorded:
        return
    with torch.no_grad():
        for index, (param, master) in enumerate(zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params)):
            if index < len(recorded) and recorded[index] == versions[index]:
                continue
            if master._version == 0 or not torch.equal(master.to(param.dtype), param):
                master.copy_(param)
    stash.model_versions = versions


def _prepare_backward_with_master_weights(self):
    stash = self._amp_stash
    self._amp_lazy_init()
    # The masters hold what was accumulated so far; the model's fp16 grads start afresh.
    for param in stash.all_fp16_params:
        if param.grad is not None:
            param.grad = None
    _stash_and_clear_grads(stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash)


def _prepare_backward_no_master_weights(self):
    stash = self._amp_stash
    self._amp_lazy_init()
    _stash_and_clear_grads(stash.all_fp16_params, stash.all_fp16_grad_stash)
    _stash_and_clear_grads(stash.all_fp32_params, stash.all_fp32_grad_stash)


def _unscaled_sparse(scaler, grad, dtype, previous):
    """``grad`` (sparse COO, scaled) unscaled into ``dtype``, plus ``previous`` (already unscaled).

    Its values join the scaler's overflow check like dense grads do (coalesced first, so each
    row is counted once, as torch's GradScaler does).
    """
    grad = grad.coalesce()
    values = grad._values()
    out = values if values.dtype == dtype else torch.empty_like(values, dtype=dtype)
    scaler.unscale([values], [out], None, models_are_masters=out is values)
    unscaled = torch.sparse_coo_tensor(grad._indices(), out, grad.shape, is_coalesced=True,
                                       check_invariants=False)
    return unscaled if previous is None else previous + unscaled


def _unscale_models_are_masters(scaler, params, stash_list):
    """Unscale new grads in place; add back what was stashed before this backward (never lost)."""
    if all(slot is None for slot in stash_list):
        # The common case, a backward after zero_grad: one list, no per-parameter branching.
        fresh = [grad for grad in (param.grad for param in params) if grad is not None]
        if not any(grad.is_sparse for grad in fresh):
            if fresh:
                scaler.unscale(fresh, fresh, None, models_are_masters=True)
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
        scaler.unscale(fresh, fresh, None, models_are_masters=True)
    if with_stash:
        scaler.unscale_with_stashed(with_stash, stashed, with_stash)


def _master_grad_buffer(stash, index, master):
    """The fp32 tensor that receives ``master``'s unscaled grad, allocated once and reused.

    Every step sets the masters' ``.grad`` back to None, so no step sees another's values; reusing
    the tensor saves an allocation per parameter per step.
    """
    buffer = stash.master_grad_buffers[index]
    if buffer is None:
        buffer = stash.master_grad_buffers[index] = torch.empty_like(master)
    return buffer


def _post_backward_with_master_weights(self, scaler):
    stash = self._amp_stash
    self._amp_lazy_init()
    fresh_model, fresh_master, acc_model, acc_master = [], [], [], []
    for index, (param, master) in enumerate(zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params)):
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            master.grad = _unscaled_sparse(scaler, grad, master.dtype, master.grad)
        elif master.grad is None:
            master.grad = _master_grad_buffer(stash, index, master)
            fresh_model.append(grad)
            fresh_master.append(master.grad)
        else:
            acc_model.append(grad)
            acc_master.append(master.grad)
    if fresh_model:
        scaler.unscale(fresh_model, fresh_master, None)
    if acc_model:
        scaler.unscale_with_stashed(acc_model, acc_master, acc_master)
    _unscale_models_are_masters(scaler, stash.all_fp32_from_fp32_params,
                                stash.all_fp32_from_fp32_grad_stash)


def _post_backward_no_master_weights(self, scaler):
    stash = self._amp_stash
    self._amp_lazy_init()
    _unscale_models_are_masters(scaler, stash.all_fp16_params, stash.all_fp16_grad_stash)
    _unscale_models_are_masters(scaler, stash.all_fp32_params, stash.all_fp32_grad_stash)


def _restore_after_failed_backward(self):
    """Undo ``_prepare_amp_backward`` when the ``scale_loss`` body raised: nothing is lost."""
    stash = self._amp_stash
    if stash.master_weights:
        for param in stash.all_fp16_params:
            param.grad = None
        pairs = [(stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash)]
    else:
        pairs = [(stash.all_fp16_params, stash.all_fp16_grad_stash),
                 (stash.all_fp32_params, stash.all_fp32_grad_stash)]
    for params, stash_list in pairs:
        for index, param in enumerate(params):
            param.grad = stash_list[index]
            stash_list[index] = None


def _zero_grad_with_master_weights(self, set_to_none=True):
    stash = self._amp_stash
    self._amp_lazy_init()
    for param in stash.all_fp16_params + stash.all_fp32_from_fp32_params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_()
            param.grad.zero_()
    for master in stash.all_fp32_from_fp16_params:
        master.grad = None


def _validated_param_group(optimizer, new_group):
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
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is "
                            f"{type(param).__name__}.")
        if not param.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor.")
        if param.is_complex() or param.dtype == torch.float64 or not param.is_floating_point():
            raise TypeError(f"add_param_group: amp trains float32, float16 and bfloat16 parameters; "
                            f"got one of dtype {param.dtype}.")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("the new param group contains the same parameter more than once; amp would "
                         "unscale and step it twice. Pass each parameter once.")
    stash = optimizer._amp_stash
    existing = {id(p) for p in stash.model_params()}
    existing.update(id(p) for g in optimizer.param_groups for p in g["params"])
    if any(id(p) in existing for p in params):
        raise ValueError("some parameters appear in more than one parameter group (the new group "
                         "holds a parameter this optimizer already has).")
    for name, default in optimizer.defaults.items():
        if default is required and name not in group:
            raise ValueError(f"parameter group didn't specify a value of required optimization "
                             f"parameter {name}")
    return group


def _add_param_group(self, new_group):
    """Validate, then add: a rejected group leaves the optimizer and amp's bookkeeping unchanged."""
    stash = self._amp_stash
    self._amp_lazy_init()
    group = _validated_param_group(self, new_group)
    lengths = {name: len(value) for name, value in vars(stash).items() if isinstance(value, list)}
    try:
        if stash.master_weights:
            _add_master_group(self, group, fp32_values={})
        else:
            _add_plain_params(stash, group["params"])
        stash.original_add_param_group(group)
    except BaseException:
        for name, length in lengths.items():
            del getattr(stash, name)[length:]
        raise


def _combine_flags(flags):
    """One overflow flag (device tensor) from the flags of several backward passes."""
    return flags[0] if len(flags) == 1 else torch.cat(flags).amax(dim=0, keepdim=True)


def _describe_skip(scalers, overflowed_loss_ids):
    def describe():
        return "; ".join(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            f"{scalers[loss_id].loss_scale()}" for loss_id in overflowed_loss_ids)
    return describe


def _culprit_finder(self):
    """A callable listing the names of the parameters (masters and model) whose grads are not finite."""
    stash = self._amp_stash

    def find():
        params = [p for group in self.param_groups for p in group["params"]]
        if stash.master_weights:
            params += stash.all_fp16_params
        return non_finite_grad_names(
            (stash.param_names.get(p, f"<parameter {index} of the optimizer>"), p)
            for index, p in enumerate(params))
    return find


def _after_step(self, copy_masters):
    """Master->model copy and master-grad clearing that follow every step, applied or skipped."""
    stash = self._amp_stash
    if stash.master_weights:
        if copy_masters:
            self._master_params_to_model_params()
        for master in stash.all_fp32_from_fp16_params:
            master.grad = None


def _step_with_found_inf(self, found_inf, closure, args, kwargs):
    """Sync-free step: the optimizer itself skips on ``found_inf`` (device-side)."""
    stash = self._amp_stash
    device = _param_device(self)
    # Fused optimizers subtract found_inf from 0-dim step counters: it must be 0-dim too.
    found_inf = found_inf.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    self.grad_scale, self.found_inf = None, found_inf
    try:
        result = stash.original_step(closure, *args, **kwargs)
    finally:
        del self.grad_scale, self.found_inf
    stash.skips.record(found_inf)
    counts = stash.skips.host_values()
    if counts is not None:
        stash.reporter.report(*counts, lambda: "Gradient overflow.  Skipped step(s), the loss scale "
                              "was reduced.", _culprit_finder(self))
    return result


def _step_reading_flag(self, flags_by_loss, closure, args, kwargs):
    """Apex's path: one host read of the flags; a non-finite step never reaches the optimizer."""
    stash = self._amp_stash
    loss_ids = list(flags_by_loss)
    values = torch.cat([flags_by_loss[i] for i in loss_ids]).tolist()
    overflowed = [loss_id for loss_id, value in zip(loss_ids, values) if value > 0]
    applied = not overflowed
    stash.skips.record_known(not applied)
    if applied:
        result = stash.original_step(closure, *args, **kwargs)
    else:
        # A scheduler that wrapped step() before amp did would otherwise warn that step() was never called.
        if hasattr(stash.original_step, "_wrapped_by_lr_sched"):
            self._opt_called = True
        result = None
    stash.host_total_skips += not applied
    stash.host_consecutive_skips = 0 if applied else stash.host_consecutive_skips + 1
    stash.reporter.report(stash.host_total_skips, stash.host_consecutive_skips,
                          _describe_skip(stash.context.loss_scalers, overflowed),
                          _culprit_finder(self))
    return result, applied


def _check_step_phase(stash):
    if stash.in_scale_loss:
        raise RuntimeError("optimizer.step() was called inside its amp.scale_loss block: the "
                           "gradients are unscaled when the block exits. Call step() after the "
                           "`with` block.")
    if stash.params_have_scaled_gradients:
        raise RuntimeError("optimizer.step() was called while the gradients are still scaled: the "
                           "last amp.scale_loss block used delay_unscale=True and no block without "
                           "it followed. Run the last backward of the step in a scale_loss block "
                           "with delay_unscale=False (it unscales everything), then call step().")
    if stash.master_weights and not stash.unscaled_since_step and not stash.warned_step_without_scale_loss:
        stash.warned_step_without_scale_loss = True
        warnings.warn("optimizer.step() was called under master weights (O2/O5) with no "
                      "amp.scale_loss backward since the last step: the fp32 master weights have no "
                      "gradients, so nothing is trained. Run the backward inside "
                      "`with amp.scale_loss(loss, optimizer) as scaled_loss:`. (Warned once.)",
                      stacklevel=3)
    stash.unscaled_since_step = False


def _amp_step(self, closure=None, *args, **kwargs):
    stash = self._amp_stash
    if stash.master_weights and closure is not None:
        raise RuntimeError("Currently, Amp does not support closure use with optimizers under master "
                           "weights (O2/O5): call the closure yourself, then optimizer.step().")
    _check_step_phase(stash)
    if stash.master_weights:
        _refresh_masters_written_elsewhere(stash)
    flags_by_loss, stash.found_inf_by_loss = stash.found_inf_by_loss, {}
    casts_off = casting.disable_casts() if stash.patch_torch_functions else contextlib.nullcontext()
    with casts_off:
        if not flags_by_loss:
            stash.skips.record_applied()
            result, copy_masters = stash.original_step(closure, *args, **kwargs), True
        elif getattr(self, "_step_supports_amp_scaling", False):
            found_inf = _combine_flags(list(flags_by_loss.values()))
            # The masters are unchanged on a skipped step, so copying them again is harmless.
            result, copy_masters = _step_with_found_inf(self, found_inf, closure, args, kwargs), True
        else:
            result, copy_masters = _step_reading_flag(self, flags_by_loss, closure, args, kwargs)
        _after_step(self, copy_masters)
    return result


def _process_optimizer(optimizer, context, param_names, fp32_values, max_consecutive_skips):
    """Attach ``_amp_stash`` and amp's methods to ``optimizer`` (once) and create its masters.

    ``amp.initialize`` has checked the optimizer already (see ``ATTACHED_METHODS``).
    """
    properties = context.properties
    stash = AmpOptimizerState(properties.master_weights, dict(param_names), max_consecutive_skips,
                              _param_device(optimizer), context.verbosity)
    stash.context = context
    stash.patch_torch_functions = properties.patch_torch_functions
    stash.fp32_values = fp32_values
    optimizer._amp_stash = stash
    bind = lambda fn: types.MethodType(fn, optimizer)  # noqa: E731

    optimizer._amp_lazy_init = bind(_amp_lazy_init)
    optimizer._restore_after_failed_backward = bind(_restore_after_failed_backward)
    if properties.master_weights:
        optimizer._lazy_init_maybe_master_weights = bind(_lazy_init_with_master_weights)
        optimizer._master_params_to_model_params = bind(_master_params_to_model_params)
        optimizer._prepare_amp_backward = bind(_prepare_backward_with_master_weights)
        optimizer._post_amp_backward = bind(_post_backward_with_master_weights)
        optimizer.zero_grad = bind(_zero_grad_with_master_weights)
    else:
        optimizer._lazy_init_maybe_master_weights = bind(_lazy_init_no_master_weights)
        optimizer._prepare_amp_backward = bind(_prepare_backward_no_master_weights)
        optimizer._post_amp_backward = bind(_post_backward_no_master_weights)
    stash.original_add_param_group = optimizer.add_param_group
    optimizer.add_param_group = bind(_add_param_group)
    stash.original_step = optimizer.step
    step = _amp_step
    if hasattr(stash.original_step, "_wrapped_by_lr_sched"):
        # An LR scheduler created before initialize warns at its first step() unless it finds its
        # mark on optimizer.step; the mark goes on a per-optimizer copy, never on _amp_step itself.
        @functools.wraps(_amp_step)
        def step(self, *args, **kwargs):
            return _amp_step(self, *args, **kwargs)
        step._wrapped_by_lr_sched = True
    optimizer.step = bind(step)
    # Masters are made now (Apex made them lazily) so that checkpoints loaded right after
    # initialize land on the fp32 masters with no precision lost.
    optimizer._amp_lazy_init()
    del stash.fp32_values

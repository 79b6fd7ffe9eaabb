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

import torch

from . import casting
from ._amp_state import _amp_state
from ._master_weights import swap_in_fp32_masters
from ._overflow_report import OverflowReporter, non_finite_grad_names

LOW_PRECISION = (torch.float16, torch.bfloat16)


class AmpOptimizerState:
    """Apex's attribute bag, plus the device-side skip signal of the pending and the last step."""

    def __init__(self, master_weights, param_names, max_consecutive_skips, device):
        self.master_weights = bool(master_weights)
        self.lazy_init_called = False
        self.already_patched = False  # Apex field; stays False: step is never re-patched here
        self.params_have_scaled_gradients = False
        self.param_names = param_names
        # loss_id -> overflow flag (device tensor) of the backward passes since the last step.
        self.found_inf_by_loss = {}
        # Readable without a sync: did the last step() apply, and how many steps were skipped.
        self.step_applied = torch.ones((), dtype=torch.bool, device=device)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.consecutive_skips = torch.zeros((), dtype=torch.int64, device=device)
        self.reporter = OverflowReporter(max_consecutive_skips)
        # Host-side counts, kept by the path that reads the flag anyway.
        self.host_total_skips = 0
        self.host_consecutive_skips = 0
        self.host_counters = _HostCounters(device)


class _HostCounters:
    """A host copy of (skipped_steps, consecutive_skips), refreshed asynchronously one step late.

    The sync-free path must not wait for the device, yet it still has to notice a run that skips
    forever. Each step enqueues a non-blocking copy of the device counters into pinned memory;
    the next step reads it only if the copy has finished (``Event.query`` never blocks).
    """

    def __init__(self, device):
        on_cuda = device.type == "cuda"
        self.buffer = torch.zeros(2, dtype=torch.int64, pin_memory=on_cuda)
        self.event = torch.cuda.Event() if on_cuda else None
        self.pending = False

    def enqueue(self, skipped_steps, consecutive_skips):
        self.buffer.copy_(torch.stack([skipped_steps, consecutive_skips]), non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.pending = True

    def ready_values(self):
        """``(skipped, consecutive)`` from the last finished copy, or None if none is ready."""
        if not self.pending or (self.event is not None and not self.event.query()):
            return None
        self.pending = False
        skipped, consecutive = self.buffer.numpy().tolist()
        return skipped, consecutive


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
                 "all_fp32_from_fp32_grad_stash"):
        setattr(stash, name, [])
    for group in self.param_groups:
        _add_master_group(self, group, stash.fp32_values)
    for param in stash.all_fp32_from_fp16_params + stash.all_fp32_from_fp32_params:
        param.grad = None
    # Recast existing optimizer state (momentum, ...) to the masters' fp32.
    self.load_state_dict(self.state_dict())


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


def _stash_and_clear_grads(params, stash_list):
    for index, param in enumerate(params):
        stash_list[index] = param.grad
        param.grad = None


def _prepare_backward_with_master_weights(self):
    stash = self._amp_stash
    self._amp_lazy_init()
    # The masters hold what was accumulated so far; the model's fp16 grads start afresh.
    for param in stash.all_fp16_params:
        param.grad = None
    _stash_and_clear_grads(stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash)


def _prepare_backward_no_master_weights(self):
    stash = self._amp_stash
    self._amp_lazy_init()
    _stash_and_clear_grads(stash.all_fp16_params, stash.all_fp16_grad_stash)
    _stash_and_clear_grads(stash.all_fp32_params, stash.all_fp32_grad_stash)


def _unscale_models_are_masters(scaler, params, stash_list):
    """Unscale new grads in place; add back what was stashed before this backward (never lost)."""
    fresh, with_stash, stashed = [], [], []
    for index, param in enumerate(params):
        previous = stash_list[index]
        stash_list[index] = None
        if param.grad is None:
            param.grad = previous
        elif previous is None:
            fresh.append(param.grad)
        else:
            with_stash.append(param.grad)
            stashed.append(previous)
    if fresh:
        scaler.unscale(fresh, fresh, None, models_are_masters=True)
    if with_stash:
        scaler.unscale_with_stashed(with_stash, stashed, with_stash)


def _post_backward_with_master_weights(self, scaler):
    stash = self._amp_stash
    self._amp_lazy_init()
    fresh_model, fresh_master, acc_model, acc_master = [], [], [], []
    for param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        if param.grad is None:
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
            fresh_model.append(param.grad)
            fresh_master.append(master.grad)
        else:
            acc_model.append(param.grad)
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


def _add_param_group(self, new_group):
    stash = self._amp_stash
    self._amp_lazy_init()
    if not isinstance(new_group, dict):
        raise TypeError(f"param group must be a dict, got {type(new_group).__name__}.")
    params = new_group["params"]
    if isinstance(params, torch.Tensor):
        new_group["params"] = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                        "ordering of tensors in sets will change between runs. Please use a list instead.")
    else:
        new_group["params"] = list(params)
    if stash.master_weights:
        _add_master_group(self, new_group, fp32_values={})
    else:
        _add_plain_params(stash, new_group["params"])
    stash.original_add_param_group(new_group)


def _combine_flags(flags):
    """One overflow flag (device tensor) from the flags of several backward passes."""
    return flags[0] if len(flags) == 1 else torch.cat(flags).amax(dim=0, keepdim=True)


def _describe_skip(overflowed_loss_ids):
    def describe():
        return "; ".join(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            f"{_amp_state.loss_scalers[loss_id].loss_scale()}" for loss_id in overflowed_loss_ids)
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
    skipped = found_inf > 0
    stash.step_applied.copy_(~skipped)
    stash.skipped_steps.add_(skipped)
    stash.consecutive_skips.add_(1).mul_(skipped)
    ready = stash.host_counters.ready_values()
    if ready is not None:
        total, consecutive = ready
        stash.reporter.report(total, consecutive, lambda: "Gradient overflow.  Skipped step(s), "
                              "the loss scale was reduced.", _culprit_finder(self))
    stash.host_counters.enqueue(stash.skipped_steps, stash.consecutive_skips)
    return result


def _step_reading_flag(self, flags_by_loss, closure, args, kwargs):
    """Apex's path: one host read of the flags; a non-finite step never reaches the optimizer."""
    stash = self._amp_stash
    loss_ids = list(flags_by_loss)
    values = torch.cat([flags_by_loss[i] for i in loss_ids]).tolist()
    overflowed = [loss_id for loss_id, value in zip(loss_ids, values) if value > 0]
    applied = not overflowed
    stash.step_applied.fill_(applied)
    if applied:
        stash.consecutive_skips.zero_()
        result = stash.original_step(closure, *args, **kwargs)
    else:
        stash.skipped_steps.add_(1)
        stash.consecutive_skips.add_(1)
        # A scheduler that wrapped step() before amp did would otherwise warn that step() was never called.
        if hasattr(stash.original_step, "_wrapped_by_lr_sched"):
            self._opt_called = True
        result = None
    stash.host_total_skips += not applied
    stash.host_consecutive_skips = 0 if applied else stash.host_consecutive_skips + 1
    stash.reporter.report(stash.host_total_skips, stash.host_consecutive_skips,
                          _describe_skip(overflowed), _culprit_finder(self))
    return result, applied


def _amp_step(self, closure=None, *args, **kwargs):
    stash = self._amp_stash
    if stash.master_weights and closure is not None:
        raise RuntimeError("Currently, Amp does not support closure use with optimizers under master "
                           "weights (O2/O5): call the closure yourself, then optimizer.step().")
    flags_by_loss, stash.found_inf_by_loss = stash.found_inf_by_loss, {}
    casts_off = casting.disable_casts() if stash.patch_torch_functions else contextlib.nullcontext()
    with casts_off:
        if not flags_by_loss:
            stash.step_applied.fill_(True)
            result, copy_masters = stash.original_step(closure, *args, **kwargs), True
        elif getattr(self, "_step_supports_amp_scaling", False):
            found_inf = _combine_flags(list(flags_by_loss.values()))
            # The masters are unchanged on a skipped step, so copying them again is harmless.
            result, copy_masters = _step_with_found_inf(self, found_inf, closure, args, kwargs), True
        else:
            result, copy_masters = _step_reading_flag(self, flags_by_loss, closure, args, kwargs)
        _after_step(self, copy_masters)
    return result


def _process_optimizer(optimizer, properties, param_names, fp32_values, max_consecutive_skips):
    """Attach ``_amp_stash`` and amp's methods to ``optimizer`` (once) and create its masters."""
    for name in ("_lazy_init_maybe_master_weights", "_master_params_to_model_params",
                 "_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init"):
        if hasattr(optimizer, name):
            raise RuntimeError(f"Incoming optimizer already has {name} defined.")
    stash = AmpOptimizerState(properties.master_weights, dict(param_names), max_consecutive_skips,
                              _param_device(optimizer))
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

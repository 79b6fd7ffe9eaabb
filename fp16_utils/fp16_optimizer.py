"""``FP16_Optimizer``: fp32 master weights and loss scaling around any ``torch.optim`` optimizer.

Kept for code written against Apex's ``fp16_utils``; new code should use ``amp.initialize``.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections import defaultdict
from typing import Any, Callable, Iterable, NoReturn, Sequence

import torch

from amp._master_weights import check_param_dtypes, swap_in_fp32_masters
from amp._overflow_report import OverflowReporter, non_finite_grad_names
from amp.multi_tensor_apply import multi_tensor_applier, multi_tensor_scale
from amp.scaler import LossScaler

from ._deprecation import deprecated_warning
# Apex's module held these too (`from apex.fp16_utils.fp16_optimizer import clip_grad_norm`).
from .fp16util import (  # noqa: F401
    clip_grad_norm,
    master_params_to_model_params,
    model_grads_to_master_grads,
)

__all__ = ["FP16_Optimizer"]

logger = logging.getLogger("fp16_utils")
FP16_REMEDY = ("Raise max_consecutive_skips in FP16_Optimizer(...) (or set it to 0 to disable this "
               "check) if the run really needs more skipped steps. To carry on after fixing the "
               "cause, reset the shrunken scale with optimizer.loss_scale = 2.**16.")

_DYNAMIC_LOSS_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")
_STATE_DICT_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                    "optimizer_state_dict", "fp32_from_fp16")
# A closure whose grads overflow this many times in a row cannot be rescued by lowering the scale
# (the grads are non-finite for another reason); Apex would have retried forever.
MAX_CLOSURE_RETRIES = 64


def _grouped(rows: Iterable[Sequence[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
    """Split rows of tensors by the devices and dtypes in each row and return each group as
    columns, because every list of one fused call must share a device and a dtype."""
    groups: dict[tuple[tuple[torch.device, torch.dtype], ...], list[Sequence[torch.Tensor]]] = {}
    for row in rows:
        groups.setdefault(tuple((t.device, t.dtype) for t in row), []).append(row)
    return [[list(column) for column in zip(*group)] for group in groups.values()]


def _clear_grad(p: torch.Tensor, set_to_none: bool) -> None:
    if set_to_none:
        p.grad = None
    elif p.grad is not None:
        p.grad.detach_()
        p.grad.zero_()


def _check_optimizer(optimizer: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"FP16_Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                        "build the optimizer on the model's params first, then wrap it.")
    if getattr(optimizer, "_wrapped_by_fp16_optimizer", False):
        raise RuntimeError("FP16_Optimizer: this optimizer is already wrapped by an FP16_Optimizer "
                           "(its params are fp32 masters now); keep using that FP16_Optimizer.")
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("FP16_Optimizer: this optimizer went through amp.initialize, which already "
                           "gives it fp32 master weights and loss scaling; use amp.scale_loss instead.")


def _as_flag(value: Any, name: str) -> bool:
    """Apex tested these flags for truth, so ints (``verbose=0``) work; a string such as
    ``"False"`` would be true, and is refused."""
    if isinstance(value, numbers.Integral) and int(value) >= 0:
        return bool(value)
    raise TypeError(f"FP16_Optimizer: {name} must be True or False (or an int >= 0), got {value!r}.")


def _check_max_consecutive_skips(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError("FP16_Optimizer: max_consecutive_skips must be an int >= 0 (0 disables the "
                         f"check), got {value!r}.")


def _make_loss_scaler(static_loss_scale: Any, dynamic_loss_scale: bool,
                      dynamic_loss_args: Any) -> LossScaler:
    # Checked even when dynamic scaling ignores it, as a bad value is a bug in the caller.
    if isinstance(static_loss_scale, bool) or not isinstance(static_loss_scale, numbers.Real):
        raise TypeError(f"FP16_Optimizer: static_loss_scale must be a number, got {static_loss_scale!r}"
                        "; for dynamic loss scaling pass dynamic_loss_scale=True.")
    if not (math.isfinite(static_loss_scale) and static_loss_scale > 0):
        raise ValueError(f"FP16_Optimizer: static_loss_scale must be a finite number > 0, got "
                         f"{static_loss_scale!r}.")
    if not dynamic_loss_scale:
        if dynamic_loss_args is not None:
            raise ValueError("FP16_Optimizer: dynamic_loss_args is only used with "
                             "dynamic_loss_scale=True; pass that too, or drop dynamic_loss_args.")
        return LossScaler(float(static_loss_scale))
    if dynamic_loss_args is None:
        dynamic_loss_args = {}
    if not isinstance(dynamic_loss_args, dict):
        raise TypeError(f"FP16_Optimizer: dynamic_loss_args must be a dict, got "
                        f"{type(dynamic_loss_args).__name__}.")
    unknown = [key for key in dynamic_loss_args if key not in _DYNAMIC_LOSS_ARGS]
    if unknown:
        raise ValueError(f"FP16_Optimizer: unknown dynamic_loss_args {unknown}; the allowed keys "
                         f"are {list(_DYNAMIC_LOSS_ARGS)}.")
    return LossScaler("dynamic", **dynamic_loss_args)


def _check_params(optimizer: torch.optim.Optimizer) -> None:
    # Frozen floating params are checked too: they get masters, as they may be unfrozen later.
    for i, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            if param.requires_grad or param.is_floating_point():
                check_param_dtypes([param], f"FP16_Optimizer (param group {i}, param {j})")


class FP16_Optimizer:
    """Wrap ``init_optimizer``, whose params may be fp16 or bf16 (or fp32), so that it steps fp32
    master copies of the low-precision params and copies the result back into the model.

    Example::

        model = convert_network(model, torch.float16)
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        optimizer.backward(loss)      # instead of loss.backward()
        optimizer.step()              # skipped, with a smaller scale, if the grads overflowed

    Args:
        init_optimizer: the ``torch.optim.Optimizer`` built on the model's params. Its
            low-precision params are replaced by fp32 masters (and its state re-keyed to them).
        static_loss_scale (float): the fixed scale used when ``dynamic_loss_scale`` is False
            (checked either way).
        dynamic_loss_scale (bool): let ``amp.scaler.LossScaler("dynamic")`` pick the scale.
        dynamic_loss_args (dict, optional): keyword arguments for that scaler: ``init_scale``,
            ``scale_factor``, ``scale_window``, ``min_loss_scale``, ``max_loss_scale``.
        verbose (bool): log (``logging.getLogger("fp16_utils")``) each param group's contents at
            info level and skipped steps at warning level (the first few, then a summary every
            100). The deprecation notice is a ``DeprecatedFeatureWarning`` either way, filtered
            like any other warning.
        max_consecutive_skips (int, keyword-only, new here): raise
            :class:`amp.NonFiniteGradientsError` naming the params whose grads were not finite
            after this many skipped steps in a row, instead of halving the scale forever
            (0 disables the check).

    The flags also take ints (``verbose=0``), as Apex's truth tests did. A rejected construction
    leaves ``init_optimizer`` untouched; so does wrapping an optimizer twice, or one that went
    through ``amp.initialize``, which is refused.

    Unlike Apex, ``backward`` may be called several times before ``step``: each call's grads are
    added, unscaled once each, to the master grads (Apex unscaled the fp32 params' grads again).
    """

    # amp.initialize recognises (and refuses) an FP16_Optimizer by this mark, so that amp need
    # not import fp16_utils.
    _is_fp16_utils_optimizer = True

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 verbose: bool = True, *, max_consecutive_skips: int = 50) -> None:
        # Everything is checked before init_optimizer is touched: a rejected call changes nothing.
        _check_optimizer(init_optimizer)
        dynamic_loss_scale = _as_flag(dynamic_loss_scale, "dynamic_loss_scale")
        verbose = _as_flag(verbose, "verbose")
        _check_max_consecutive_skips(max_consecutive_skips)
        loss_scaler = _make_loss_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
        _check_params(init_optimizer)

        deprecated_warning("fp16_utils.FP16_Optimizer is deprecated and dangerous, and will be removed. "
                           "For mixed precision, use amp.initialize with opt_level='O2' (or 'O5' for "
                           "bfloat16) and amp.scale_loss instead.")
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.loss_scaler = loss_scaler
        self.dynamic_loss_scale = dynamic_loss_scale
        self.overflow = False
        self.reporter = OverflowReporter(max_consecutive_skips, verbosity=int(verbose), logger=logger,
                                         remedy=FP16_REMEDY)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.first_closure_call_this_step = True
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_
        self._make_masters()
        # A mark on the user's optimizer, read back with getattr by _check_optimizer.
        init_optimizer._wrapped_by_fp16_optimizer = True  # type: ignore[attr-defined]
        # Grad bookkeeping that makes repeated backward calls accumulate exactly:
        # _grads_pending: a backward ran whose grads are still scaled in the model params.
        # _masters_hold_grads: master grads (and fp32 params' grads) hold unscaled sums.
        # _fp32_stash: the fp32 params' unscaled grads, set aside when a backward starts while
        #              the masters hold grads, and added back by update_master_grads.
        self._grads_pending = False
        self._masters_hold_grads = False
        self._fp32_stash: list[torch.Tensor | None] | None = None

    def _make_masters(self) -> None:
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for i, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {i}:")
            fp16_params, fp32_from_fp16, fp32_params = swap_in_fp32_masters(self.optimizer, group)
            for param in fp16_params + fp32_params:
                self.maybe_print(f"FP16_Optimizer received {param.dtype} with {tuple(param.shape)}")
            self.fp16_groups.append(fp16_params)
            self.fp32_from_fp16_groups.append(fp32_from_fp16)
            self.fp32_from_fp32_groups.append(fp32_params)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        # The round trip casts any state the optimizer already had to the masters' dtype.
        self.optimizer.load_state_dict(self.optimizer.state_dict())

    def maybe_print(self, msg: str) -> None:
        """Log progress at info level when ``verbose`` (Apex printed it)."""
        if self.verbose:
            logger.info(msg)

    def _maybe_warn(self, msg: str) -> None:
        if self.verbose:
            logger.warning(msg)

    def __getstate__(self) -> NoReturn:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: object) -> NoReturn:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def zero_grad(self, set_grads_to_None: bool = False, *, set_to_none: bool | None = None) -> None:
        """Zero (or, with ``set_grads_to_None``/``set_to_none``, drop) the master and model grads."""
        if set_to_none is not None:
            set_grads_to_None = set_to_none
        if not isinstance(set_grads_to_None, bool):
            raise TypeError(f"FP16_Optimizer.zero_grad: set_grads_to_None must be True or False, "
                            f"got {set_grads_to_None!r}.")
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                _clear_grad(p, set_grads_to_None)
        for p in self.all_fp16_params:
            _clear_grad(p, set_grads_to_None)
        self._grads_pending = False
        self._masters_hold_grads = False
        self._fp32_stash = None

    def _master_params_to_model_params(self) -> None:
        rows = list(zip(self.all_fp32_from_fp16_params, self.all_fp16_params))
        for masters, models in _grouped(rows):
            noop_flag = torch.zeros(1, dtype=torch.int32, device=masters[0].device)
            with torch.no_grad():  # the params are leaves that require grad
                multi_tensor_applier(multi_tensor_scale, noop_flag, [masters, models], 1.0)

    def _report_skip(self) -> None:
        """Count a skipped step; log it (rate-limited), or raise once skips never end."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        named = ((f"param group {g}: {param.dtype} param of shape {tuple(param.shape)}", param)
                 for g, (low, fp32) in enumerate(zip(self.fp16_groups, self.fp32_from_fp32_groups))
                 for param in low + fp32)
        self.reporter.report(
            self.skipped_steps, self.consecutive_skips,
            lambda: f"Gradient overflow.  Skipping step, reducing loss scale to {self.loss_scaler.loss_scale()}",
            lambda: non_finite_grad_names(named))

    def _clear_master_grads(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self._masters_hold_grads = False
        self._fp32_stash = None

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor | float:
        """Clip the fp32 master grads by their total norm and return that norm (before clipping),
        or -1 when the grads overflowed (the coming step will be skipped anyway)."""
        self._flush_pending_grads()
        if self.overflow:
            return -1
        fp32_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(fp32_params, max_norm, norm_type)

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Run ``(loss.float() * loss_scale).backward()`` and, by default, unscale the new grads
        into the fp32 master grads. Grads of repeated calls accumulate, as with ``loss.backward()``."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"FP16_Optimizer.backward expects the loss tensor, got {type(loss).__name__}.")
        for name, value in (("update_master_grads", update_master_grads), ("retain_graph", retain_graph)):
            if not isinstance(value, bool):
                raise TypeError(f"FP16_Optimizer.backward: {name} must be True or False, got {value!r}.")
        if self._masters_hold_grads and self._fp32_stash is None:
            # The master grads already hold earlier unscaled grads. Let the model params collect
            # only the new scaled grads, which update_master_grads then unscales and adds.
            for p in self.all_fp16_params:
                p.grad = None
            self._fp32_stash = [p.grad for p in self.all_fp32_from_fp32_params]
            for p in self.all_fp32_from_fp32_params:
                p.grad = None
        scaled_loss = loss.float() * self.loss_scaler.loss_scale()
        scaled_loss.backward(retain_graph=retain_graph)
        self._grads_pending = True
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the grads of the backward passes since the last call into the fp32 master
        grads, check them for overflow (dynamic scaling) and update the scale. Calling it again
        without a new ``backward`` does nothing, so nothing is ever unscaled twice."""
        if not self._grads_pending:
            return
        scaler = self.loss_scaler
        scaler.clear_overflow_state()
        scale = scaler.loss_scale()
        stash = self._fp32_stash
        fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        added: list[tuple[torch.Tensor, torch.Tensor]] = []
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model.grad is None:
                continue
            if stash is not None and master.grad is not None:
                added.append((model.grad, master.grad))
            else:
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                fresh.append((model.grad, master.grad))
        fp32_fresh: list[tuple[torch.Tensor]] = []
        fp32_added: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, p in enumerate(self.all_fp32_from_fp32_params):
            earlier = None if stash is None else stash[k]
            if p.grad is None:
                p.grad = earlier
            elif earlier is None:
                fp32_fresh.append((p.grad,))
            else:
                fp32_added.append((p.grad, earlier))
        for model_grads, master_grads in _grouped(fresh):
            scaler.unscale(model_grads, master_grads, scale)
        for (grads,) in _grouped(fp32_fresh):
            scaler.unscale(grads, grads, scale, models_are_masters=True)
        for model_grads, master_grads in _grouped(added):
            scaler.unscale_with_stashed(model_grads, master_grads, master_grads)
        for grads, stashed in _grouped(fp32_added):
            scaler.unscale_with_stashed(grads, stashed, grads)
        # Earlier grads that overflowed are still in the sums, so the overflow stays.
        earlier_overflow = stash is not None and self.overflow
        self.overflow = scaler.update_scale() or earlier_overflow
        self._grads_pending = False
        self._masters_hold_grads = True
        self._fp32_stash = None

    def _flush_pending_grads(self) -> None:
        # backward(update_master_grads=False) leaves grads scaled; whatever reads the master
        # grads next must see them unscaled.
        if self._grads_pending:
            self.update_master_grads()

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """Return, per param group, the master grads (``None`` for a param without one), or
        ``None`` while the grads have overflowed."""
        self._flush_pending_grads()
        if self.overflow:
            self._maybe_warn("Calling FP16_Optimizer.inspect_master_grad_data while in an overflow state: "
                             "the gradients are invalid (may be inf, nan, or stale). Returning None.")
            return None
        return [[None if p.grad is None else p.grad.data for p in group["params"]]
                for group in self.optimizer.param_groups]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on the fp32 masters and copy them into the model, or, if
        the grads overflowed, skip the step (params and optimizer state untouched)."""
        if closure is not None:
            if not callable(closure):
                raise TypeError(f"FP16_Optimizer.step: closure must be callable, got "
                                f"{type(closure).__name__}.")
            return self._step_with_closure(closure)
        self._flush_pending_grads()
        if self.overflow:
            self._report_skip()
            self._clear_master_grads()
            return None
        self.consecutive_skips = 0
        retval = self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # An optimizer that evaluates several points per step (LBFGS) moved the masters:
                # the model must see them before the closure runs the forward pass.
                self._master_params_to_model_params()
            loss = closure()
            self._flush_pending_grads()
            retries = 0
            while self.overflow:
                if retries == MAX_CLOSURE_RETRIES:
                    raise RuntimeError(
                        f"FP16_Optimizer.step: the closure's grads overflowed {retries + 1} times in "
                        f"a row (loss scale now {self.loss_scaler.loss_scale()}); lowering the scale "
                        "does not help, so the loss or the grads are not finite for another reason. "
                        "Check the closure zeroes the grads (optimizer.zero_grad()) and the model's inputs.")
                retries += 1
                self._maybe_warn("OVERFLOW within closure! Skipping step, reducing loss scale to "
                                 f"{self.loss_scaler.loss_scale()}")
                self._clear_master_grads()
                loss = closure()
                self._flush_pending_grads()
            return loss

        try:
            retval = self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True
        self._master_params_to_model_params()
        return retval

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly, as tensors and numbers only (the scaler as its own
        dict), so ``torch.load(..., weights_only=True)`` reads it back."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[p.detach() for p in group] for group in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` saved, the fp32 masters exactly. Load the model's
        ``state_dict`` too (before or after); nothing is changed if the checkpoint does not fit."""
        self._check_state_dict(state_dict)
        old_scaler_state = self.loss_scaler.state_dict()
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        try:
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        except Exception:
            self.loss_scaler.load_state_dict(old_scaler_state)
            raise
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
                for current, saved in zip(current_group, saved_group):
                    current.copy_(saved)

    def _check_state_dict(self, state_dict: object) -> None:
        where = "FP16_Optimizer.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where} expects the dict FP16_Optimizer.state_dict() returned, got "
                            f"{type(state_dict).__name__}.")
        missing = [k for k in _STATE_DICT_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"{where}: the state dict lacks {missing}; pass what FP16_Optimizer.state_dict() returned.")
        if not isinstance(state_dict["loss_scaler"], dict):
            raise TypeError(f"{where}: state_dict['loss_scaler'] must be the scaler's own dict of numbers, "
                            f"got {type(state_dict['loss_scaler']).__name__} (a checkpoint written by "
                            "Apex's FP16_Optimizer pickled the scaler object and cannot be loaded).")
        if state_dict["dynamic_loss_scale"] != self.dynamic_loss_scale:
            raise ValueError(f"{where}: the checkpoint was written with dynamic_loss_scale="
                             f"{state_dict['dynamic_loss_scale']}, this optimizer has "
                             f"{self.dynamic_loss_scale}; construct FP16_Optimizer the same way to resume.")
        for key in ("overflow", "first_closure_call_this_step"):
            if not isinstance(state_dict[key], bool):
                raise TypeError(f"{where}: state_dict[{key!r}] must be a bool, got {state_dict[key]!r}.")
        saved = state_dict["fp32_from_fp16"]
        shapes = [[tuple(p.shape) for p in group] for group in self.fp32_from_fp16_groups]
        if (not isinstance(saved, (list, tuple)) or len(saved) != len(shapes)
                or any(not isinstance(g, (list, tuple)) or len(g) != len(s) for g, s in zip(saved, shapes))
                or any(not isinstance(t, torch.Tensor) or tuple(t.shape) != s
                       for g, gs in zip(saved, shapes) for t, s in zip(g, gs))):
            raise ValueError(f"{where}: the saved fp32 master weights do not match this optimizer's "
                             f"low-precision params (expected shapes {shapes} per param group); the "
                             "checkpoint belongs to a different model or param grouping.")

    def _get_loss_scale(self) -> float:
        return self.loss_scaler.loss_scale()

    def _set_loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = value

    loss_scale = property(_get_loss_scale, _set_loss_scale)

    def _get_state(self) -> defaultdict[torch.Tensor, Any]:
        return self.optimizer.state

    def _set_state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        self.optimizer.state = value

    state = property(_get_state, _set_state)

    def _get_param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _set_param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    param_groups = property(_get_param_groups, _set_param_groups)

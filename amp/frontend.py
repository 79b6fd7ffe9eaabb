"""``amp.initialize`` and what reads a run back: ``state_dict``, ``load_state_dict``, ``master_params``,
the loss scale and the skip counts.

``initialize`` checks its own arguments, turns the opt level and the overrides into the run's
``Options`` (``options.py``, where the opt-level presets live), and hands models and optimizers
to ``_initialize``. ``Properties`` is Apex's mutable form of the options, kept for code that
builds one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Mapping, Tuple, TypeVar, Union, overload

import torch
import torch.distributed as dist
from torch import nn

from . import _checkpoint
from ._amp_state import _amp_state
from ._apex_presets import O0, O1, O2, O3, opt_levels  # noqa: F401  (Apex's names on this module)
from ._initialize import _initialize
from ._logging import maybe_print
from ._master_weights import master_params
from ._optimizer_wrappers import OptimizerLike, OptimizerWrapper, is_optimizer
from ._run import AmpContext
from .options import OPT_LEVELS, Options, check_bool, check_option, patch_type_of

if TYPE_CHECKING:
    from ._controller.controller import OptimizerController
    from .scaler import LossScaler

__all__ = ["initialize", "state_dict", "load_state_dict", "master_params", "last_step_applied",
           "skipped_steps", "loss_scale", "loss_scale_tensor", "loss_scaler", "Properties"]


class Properties:
    """Apex's options object: the options of one opt level, each assignment checked against it.

    amp itself keeps an immutable :class:`~amp.options.Options` per run; this mutable form stays
    for code written for Apex. A check that fails raises, or with ``_amp_state.hard_override``
    only warns, as ``initialize`` does.
    """

    def __init__(self) -> None:
        self.options: dict[str, Any] = Options().options

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    @property
    def patch_torch_functions_type(self) -> torch.dtype | None:
        """The low-precision dtype O1/O4 casts to, or None when functions are not patched."""
        return patch_type_of(self.opt_level, self.patch_torch_functions)

    def __setattr__(self, name: str, value: Any) -> None:
        if "options" not in self.__dict__:
            super().__setattr__(name, value)
            return
        if name not in self.options:
            raise AttributeError(f"'{type(self).__name__}' has no option '{name}'")
        self.options[name] = check_option(self.opt_level, name, value, _amp_state.hard_override)


def _options_table(options: Mapping[str, Any]) -> str:
    return "\n".join(f"{key:22} : {value}" for key, value in options.items())


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _check_process_group(group: object) -> None:
    if group is None:
        return
    process_group = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if process_group is None or not isinstance(group, process_group):
        raise TypeError("overflow_process_group must be None or a torch.distributed process group "
                        "(dist.group.WORLD, or one made by dist.new_group), got "
                        f"{group!r}.")


def _check_arguments(enabled: object, opt_level: object, verbosity: object, num_losses: object,
                     cast_model_outputs: object, growth_interval: object, hysteresis: object,
                     max_consecutive_skips: object, overflow_process_group: object,
                     max_steps_at_scale_floor: object) -> None:
    """Every check of initialize's own arguments that needs no model or optimizer."""
    check_bool("enabled", enabled)
    if isinstance(verbosity, bool) or verbosity not in (0, 1, 2):
        raise ValueError(f"verbosity must be 0, 1 or 2, got {verbosity!r}.")
    if not enabled:
        return
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level!r}. Options are "
            f"{', '.join(map(repr, OPT_LEVELS))}. Note that in `O0`, `O1`, etc., the prefix O is "
            "the letter O, not the number zero.")
    _check_positive_int("num_losses", num_losses)
    _check_positive_int("growth_interval", growth_interval)
    _check_positive_int("hysteresis", hysteresis)
    for name, value in (("max_consecutive_skips", max_consecutive_skips),
                        ("max_steps_at_scale_floor", max_steps_at_scale_floor)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer (0 disables the check), "
                             f"got {value!r}.")
    if cast_model_outputs is not None and (not isinstance(cast_model_outputs, torch.dtype)
                                           or not cast_model_outputs.is_floating_point):
        raise TypeError("cast_model_outputs must be a floating-point torch.dtype (e.g. "
                        f"torch.float32) or None, got {cast_model_outputs!r}.")
    _check_process_group(overflow_process_group)


# What initialize gives back is what it was given: a model or a list of them, and, when
# optimizers were passed, the optimizer or the list or tuple of them.
_Models = TypeVar("_Models", bound=Union[nn.Module, List[Any]])
_Optimizers = TypeVar("_Optimizers", bound=Union[torch.optim.Optimizer, OptimizerWrapper, List[Any],
                                                 Tuple[Any, ...]])


@overload
def initialize(models: _Models, optimizers: None = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: torch.dtype | None = None, patch_torch_functions: bool | None = None,
               keep_batchnorm_fp32: bool | str | None = None, master_weights: bool | str | None = None,
               loss_scale: float | str | None = None, cast_model_outputs: torch.dtype | None = None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float | None = 2.0**24, *, growth_factor: float = 2.0,
               backoff_factor: float | None = None, growth_interval: int = 2000, hysteresis: int = 1,
               max_consecutive_skips: int = 50, overflow_process_group: dist.ProcessGroup | None = None,
               max_steps_at_scale_floor: int = 100) -> _Models: ...


@overload
def initialize(models: _Models, optimizers: _Optimizers, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: torch.dtype | None = None, patch_torch_functions: bool | None = None,
               keep_batchnorm_fp32: bool | str | None = None, master_weights: bool | str | None = None,
               loss_scale: float | str | None = None, cast_model_outputs: torch.dtype | None = None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float | None = 2.0**24, *, growth_factor: float = 2.0,
               backoff_factor: float | None = None, growth_interval: int = 2000, hysteresis: int = 1,
               max_consecutive_skips: int = 50, overflow_process_group: dist.ProcessGroup | None = None,
               max_steps_at_scale_floor: int = 100) -> tuple[_Models, _Optimizers]: ...


def initialize(models: _Models, optimizers: _Optimizers | None = None, enabled: bool = True,
               opt_level: str = "O1", cast_model_type: torch.dtype | None = None,
               patch_torch_functions: bool | None = None, keep_batchnorm_fp32: bool | str | None = None,
               master_weights: bool | str | None = None, loss_scale: float | str | None = None,
               cast_model_outputs: torch.dtype | None = None, num_losses: int = 1, verbosity: int = 1,
               min_loss_scale: float | None = None, max_loss_scale: float | None = 2.0**24, *,
               growth_factor: float = 2.0, backoff_factor: float | None = None,
               growth_interval: int = 2000, hysteresis: int = 1, max_consecutive_skips: int = 50,
               overflow_process_group: dist.ProcessGroup | None = None,
               max_steps_at_scale_floor: int = 100) -> _Models | tuple[_Models, _Optimizers]:
    """Prepare models and optimizers for mixed-precision training at the chosen ``opt_level``.

    Usage (Apex's three lines)::

        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    Opt levels: O0 (fp32), O1 (patched functions, fp16, dynamic scale), O2 (fp16 model, fp32
    batchnorm and master weights, dynamic scale), O3 (pure fp16), O4 (O1 with bfloat16, scale 1),
    O5 (O2 with bfloat16, scale 1). ``cast_model_type``, ``patch_torch_functions``,
    ``keep_batchnorm_fp32``, ``master_weights`` and ``loss_scale`` override the preset (``None``
    keeps it); ``loss_scale`` is ``"dynamic"`` or a number. ``master_weights="remainder"`` (bf16
    models: O5) keeps each fp32 master as its bf16 model weight plus a 16-bit remainder and a carry
    bit, 2.125 bytes per parameter instead of 4, with the same bits in every step (see
    ``docs/reference.md``). Models and optimizers may live on
    CPU or CUDA. Call parallel wrappers (DDP) after ``initialize``. A model cast to
    ``cast_model_type`` keeps its float64 buffers in float64 (float64 parameters are refused).
    amp picks the precision: a ``torch.autocast`` around the models' forward is warned about.

    Args (keyword-only, new here; they shape the dynamic loss scale):
        growth_factor (float): factor applied after ``growth_interval`` clean steps (Apex: 2).
        backoff_factor (float): factor applied on overflow; default ``1 / growth_factor``.
        growth_interval (int): clean backward passes before the scale grows (Apex's 2000).
        hysteresis (int): consecutive overflows tolerated before the scale backs off (1 = Apex).
            Every overflowing step is still skipped.
        max_consecutive_skips (int): raise :class:`amp.NonFiniteGradientsError` naming the
            offending parameters after this many skipped steps in a row (0 disables the check).
        max_steps_at_scale_floor (int): raise :class:`amp.LossScaleFloorError` after this many
            steps with a dynamic scale held at a floor below 1 (``min_loss_scale``, 2**-24 by
            default) by overflows that recur too often for it to grow; there small fp16 gradients
            flush to zero, so steps stop training. A rate-limited warning comes first (0 disables
            the error, not the warning).
        overflow_process_group: a ``torch.distributed`` group over which the overflow flag is
            all-reduced (MAX) so every rank makes the same skip decision (for sharded or
            model-parallel training; DDP's gradient all-reduce already agrees on its own).

    Returns the same objects, mutated, in Apex's shapes: ``model`` or ``(model, optimizer)``,
    lists when lists were given.

    The call is all-or-nothing: every argument, model and parameter is checked before anything
    is changed, so a call that raises leaves models, optimizers and earlier amp runs as they
    were, and may simply be retried. Each call keeps its own options and loss scalers: a later
    ``initialize`` on other objects does not change how the optimizers returned here behave
    (``amp._amp_state`` shows the latest call's).
    """
    _check_arguments(enabled, opt_level, verbosity, num_losses, cast_model_outputs, growth_interval,
                     hysteresis, max_consecutive_skips, overflow_process_group,
                     max_steps_at_scale_floor)
    if not enabled:
        return _initialize_disabled(models, optimizers, verbosity)

    overrides = dict(cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
                     keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                     loss_scale=loss_scale)
    options = Options.for_level(opt_level, overrides, lenient=_amp_state.hard_override)
    scaler_options = dict(min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                          growth_factor=growth_factor, growth_interval=growth_interval,
                          backoff_factor=backoff_factor, hysteresis=hysteresis)
    context = AmpContext(options, verbosity=verbosity,
                         overflow_process_group=overflow_process_group,
                         min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                         max_steps_at_scale_floor=max_steps_at_scale_floor)
    result = _initialize(models, optimizers, context, num_losses, cast_model_outputs,
                         scaler_options, max_consecutive_skips)
    level = OPT_LEVELS[opt_level]
    maybe_print(f"Selected optimization level {opt_level}:  {level.brief}\n"
                f"Defaults for this optimization level are:\n"
                f"{_options_table(dict(enabled=True, opt_level=opt_level, **level.options))}\n"
                "After processing overrides, optimization options are:\n"
                f"{_options_table(options.options)}", rank0=True, verbosity=verbosity)
    return result


def _initialize_disabled(models: _Models, optimizers: _Optimizers | None,
                         verbosity: int) -> _Models | tuple[_Models, _Optimizers]:
    """``enabled=False``: nothing is changed; ``scale_loss`` passes these optimizers' loss through."""
    if is_optimizer(optimizers):
        _amp_state.disabled_optimizers.add(optimizers)
    elif isinstance(optimizers, (list, tuple)):
        for optimizer in optimizers:
            if is_optimizer(optimizer):
                _amp_state.disabled_optimizers.add(optimizer)
    _amp_state.publish(AmpContext(Options(), verbosity=verbosity))
    return models if optimizers is None else (models, optimizers)


def state_dict(destination: dict[str, Any] | None = None,
               optimizer: OptimizerLike | None = None) -> dict[str, Any]:
    """The loss scalers' state as plain numbers (loadable with ``torch.load(weights_only=True)``).

    With one live ``amp.initialize`` run (one whose models or optimizers are still alive) this is
    Apex's ``{"loss_scaler0": {...}, ...}``; with several, ``{"run0": {...}, "run1": ...}`` holds
    each run's dict in the order of the ``initialize`` calls. ``optimizer`` picks one run.
    """
    return _checkpoint.state_dict(destination, None if optimizer is None else _stash(optimizer).context)


def load_state_dict(state_dict: dict[str, Any], optimizer: OptimizerLike | None = None) -> None:
    """Restore the loss scalers from :func:`state_dict`; everything is validated before anything changes.

    Saved runs go to the live runs in ``initialize`` order; a checkpoint whose runs, ``num_losses``
    or static/dynamic scalers do not match them is refused. ``optimizer`` picks one run, which then
    loads one run's dict (the whole checkpoint of a single run, or one ``"runN"`` entry).
    """
    _checkpoint.load_state_dict(state_dict, None if optimizer is None else _stash(optimizer).context)


def _stash(optimizer: OptimizerLike) -> OptimizerController:
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is None:
        raise RuntimeError("This optimizer was not returned by amp.initialize.")
    return stash


def loss_scale(loss_id: int = 0, optimizer: OptimizerLike | None = None) -> float:
    """The current loss scale of loss ``loss_id`` as a Python float (a dynamic scale: one sync).

    ``optimizer`` picks the ``amp.initialize`` call whose scaler is read (default: the latest).
    Change a scale with ``LossScaler.set_scale`` on the same scaler (``loss_scaler(...)``).
    """
    return _loss_scaler("loss_scale", loss_id, optimizer).loss_scale()


def loss_scale_tensor(loss_id: int = 0, optimizer: OptimizerLike | None = None) -> torch.Tensor:
    """The same as :func:`loss_scale`, as a 0-dim float32 tensor read without a sync.

    It is a copy, taken on the device where the scale lives; it does not follow later updates.
    """
    return _loss_scaler("loss_scale_tensor", loss_id, optimizer).scale_tensor_copy()


def loss_scaler(loss_id: int = 0, optimizer: OptimizerLike | None = None) -> LossScaler:
    """The :class:`amp.LossScaler` of loss ``loss_id`` (``get_scale``, ``set_scale``, ...).

    ``optimizer`` picks the ``amp.initialize`` call whose scaler is returned (default: the latest).
    """
    return _loss_scaler("loss_scaler", loss_id, optimizer)


def _loss_scaler(caller: str, loss_id: int, optimizer: OptimizerLike | None) -> LossScaler:
    # ``caller``: the public function the user called, for the error message.
    if optimizer is not None:
        context = _stash(optimizer).context
    elif _amp_state.context is not None and _amp_state.context.enabled:
        context = _amp_state.context
    else:
        raise RuntimeError(f"amp.{caller}() needs an enabled amp.initialize call first.")
    return context.loss_scaler(loss_id)


def last_step_applied(optimizer: OptimizerLike) -> torch.Tensor:
    """A 0-dim bool tensor on the parameters' device: did the last ``step()`` update anything?

    Reading it on the host syncs; use it on the device to keep a step sync-free, e.g. an EMA
    that follows skips: ``torch._foreach_lerp_(ema, params, decay * amp.last_step_applied(opt))``.
    """
    return _stash(optimizer).skips.step_applied()


def skipped_steps(optimizer: OptimizerLike) -> torch.Tensor:
    """A 0-dim int64 tensor on the parameters' device: how many ``step()`` calls were skipped."""
    return _stash(optimizer).skips.skipped_steps()

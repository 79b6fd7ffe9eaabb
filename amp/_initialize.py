"""What ``amp.initialize`` does, once its arguments are checked (``frontend.py``): check the models and
optimizers, then change them.

Everything that can be refused is checked first, so a call that raises changes nothing. Then the
run's loss scalers (``scaler.py``) are made, the models cast (with the hooks of ``_model_hooks``),
each optimizer given its controller (``_controller.attach_controller``), the O1/O4 casting policy
installed (``casting``), and the run published to ``_amp_state``.
"""
import functools

import torch
from torch import nn

from . import _fsdp, casting, multi_tensor_apply
from ._amp_state import _amp_state
from ._apex_compat import APEX_METHODS, warn_or_err
from ._apex_compat import O2StateDictHook  # noqa: F401  (Apex's name on this module)
from ._master_weights import LOW_PRECISION_DTYPES, check_trainable_dtype, convert_network
from ._model_hooks import (cast_forward, check_autocast, keep_run_hooks, register_fp32_state_dict_hooks,
                           remove_run_hooks, to_type)
from ._model_hooks import applier  # noqa: F401  (Apex's name on this module)
from ._optimizer_wrappers import is_optimizer, is_optimizer_wrapper
from ._controller.attach import attach_controller
from .scaler import LossScaler

_PARALLEL_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def _check_models(models):
    if len({id(model) for model in models}) != len(models):
        raise RuntimeError("The same model appears more than once in the models passed to "
                           "amp.initialize; pass each model once.")
    for model in models:
        if not isinstance(model, nn.Module):
            raise TypeError(f"amp.initialize expects torch.nn.Module models, got {type(model).__name__}.")
        if isinstance(model, _PARALLEL_WRAPPERS):
            raise RuntimeError(
                f"Incoming model is an instance of {type(model).__name__}. Parallel wrappers should "
                "only be applied to the model(s) AFTER the model(s) have been returned from "
                "amp.initialize.")


def _check_params_fp32(models):
    if _amp_state.allow_incoming_model_not_fp32:
        return
    for model in models:
        named = list(model.named_parameters()) + list(model.named_buffers())
        for name, tensor in named:
            if tensor.dtype in LOW_PRECISION_DTYPES:
                warn_or_err(
                    f"Found param or buffer {name} with dtype {tensor.dtype}. When using "
                    "amp.initialize, you do not need to call .half() or .bfloat16() on your model "
                    "before passing it, no matter what optimization level you choose.",
                    _amp_state.hard_override)


def _as_model_list(models):
    if isinstance(models, nn.Module):
        return [models], False
    if isinstance(models, list):
        return models, True
    raise TypeError("models must be either a single model or a list of models, got "
                    f"{type(models).__name__}; pass a list, e.g. amp.initialize([model_a, model_b], ...).")


def _as_optimizer_list(optimizers):
    """``(list of optimizers, how to give them back)``."""
    if optimizers is None:
        return [], None
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers), type(optimizers)
    if is_optimizer(optimizers) or _is_fp16_optimizer(optimizers):
        return [optimizers], "single"  # an FP16_Optimizer is refused with its own message below
    raise TypeError("optimizers must be either a single optimizer or a list of optimizers, got "
                    f"{type(optimizers).__name__}.")


def _is_fp16_optimizer(optimizer):
    # fp16_utils marks its FP16_Optimizer so that amp never has to import fp16_utils.
    return getattr(optimizer, "_is_fp16_utils_optimizer", False) is True


def _check_optimizers(optimizers):
    for optimizer in optimizers:
        if _is_fp16_optimizer(optimizer):
            raise RuntimeError("An incoming optimizer is an instance of fp16_utils.FP16_Optimizer. "
                               "amp.initialize creates its own master weights and loss scaling: pass "
                               "the plain torch.optim optimizer instead.")
        if not is_optimizer(optimizer):
            raise TypeError(f"optimizers must be torch.optim.Optimizer instances (or a LARC wrapper "
                            f"around one), got {type(optimizer).__name__}.")
        if hasattr(optimizer, "_amp_stash") or hasattr(getattr(optimizer, "optim", None), "_amp_stash"):
            raise RuntimeError("A given optimizer should only be passed through amp.initialize once. "
                               "Create a new optimizer for the new models, or keep using the one "
                               "amp.initialize returned the first time.")
        for name in APEX_METHODS:
            if hasattr(optimizer, name):
                raise RuntimeError(f"Incoming optimizer already has {name} defined.")
    # A LARC wrapper steps its inner optimizer: passing both would step it twice.
    inner = [opt.optim for opt in optimizers if is_optimizer_wrapper(opt)]
    if len({id(opt) for opt in optimizers + inner}) != len(optimizers) + len(inner):
        raise RuntimeError("The same optimizer appears more than once in the optimizers passed to "
                           "amp.initialize (directly or inside a LARC wrapper); pass each optimizer "
                           "once.")


def _named_params(models):
    """``{param: name}`` over all models (``model{i}.`` prefixes when there are several)."""
    names: dict[torch.Tensor, str] = {}
    for model_idx, model in enumerate(models):
        prefix = f"model{model_idx}." if len(models) > 1 else ""
        for name, param in model.named_parameters():
            names.setdefault(param, prefix + name)
    return names


def _check_param_dtypes(param_names, optimizers):
    """Reject what amp cannot train in mixed precision, naming the parameter and the fix; the
    optimizers' params that no model names are named by position."""
    params = dict(param_names)
    for opt_idx, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                params.setdefault(param, f"<parameter {index} of optimizer {opt_idx}>")
    for param, name in params.items():
        check_trainable_dtype(param, name)


def _cast_model(model, cast_type, keep_batchnorm_fp32):
    """Cast the model's floating params and buffers to ``cast_type``, affine batch norm kept fp32 with
    ``keep_batchnorm_fp32``, and float64 buffers kept as they are.

    A float64 buffer was made so on purpose (a RoPE table whose steps of 1e-10 fp16 would round to
    nothing, a running sum), and a model that mixes it with fp32 activations already casts it
    where it is used; rounding it here would lose precision silently. (float64 params are refused.)
    """
    float64 = [(module, name, buffer) for module in model.modules()
               for name, buffer in module.named_buffers(recurse=False) if buffer.dtype == torch.float64]
    for module, name, _ in float64:
        setattr(module, name, None)  # hidden from the cast
    try:
        if keep_batchnorm_fp32:
            convert_network(model, cast_type)
        else:
            model.to(cast_type)
    finally:
        for module, name, buffer in float64:
            setattr(module, name, buffer)


def _initialize(models, optimizers, context, num_losses, cast_model_outputs, scaler_options,
                max_consecutive_skips):
    """Check everything, then change models and optimizers; a call that raises changes nothing."""
    options = context.options
    models, models_was_list = _as_model_list(models)
    optimizers, optimizers_container = _as_optimizer_list(optimizers)
    _check_optimizers(optimizers)
    _check_models(models)
    _check_params_fp32(models)
    param_names = _named_params(models)
    _check_param_dtypes(param_names, optimizers)
    sharded = _fsdp.plan(models, optimizers, context)
    loss_scalers = [LossScaler(options.loss_scale, **scaler_options) for _ in range(num_losses)]

    # Nothing below raises on user input: from here on, models and optimizers change.
    for model in models:
        remove_run_hooks(model)  # of an earlier initialize of the same model
    # The kernels' paths (amp_C's first-use self-test) are decided now, eagerly, not in a step.
    multi_tensor_apply.decide_paths(p.device for model in models for p in model.parameters())
    # Masters start from the exact fp32 values, taken before the model is cast.
    fp32_values = {}
    cast_type = options.cast_model_type
    if sharded is not None:
        sharded.apply(context)
    _fsdp.remember_unsharded(models, context)
    if options.master_weights and cast_type in LOW_PRECISION_DTYPES and not context.sharded_masters:
        for model in models:
            for param in model.parameters():
                if param.dtype == torch.float32:
                    fp32_values[id(param)] = param.detach().clone()

    if cast_type:
        for model in models:
            if not context.sharded_masters:  # else FSDP2 casts the gathered params by the policy amp set
                _cast_model(model, cast_type, options.keep_batchnorm_fp32)
        input_caster = functools.partial(to_type, cast_type)
        output_caster = functools.partial(to_type, cast_model_outputs or torch.float32)
        for model in models:
            keep_run_hooks(model, cast_forward(model, input_caster, output_caster))
        # State loaded before initialize (mmengine resumes so) follows its params' new dtype; under
        # master weights it moves to the fp32 masters instead (attach_controller), never rounded.
        if not options.master_weights:
            for optimizer in optimizers:
                optimizer.load_state_dict(optimizer.state_dict())
    elif cast_model_outputs is not None:
        output_caster = functools.partial(to_type, cast_model_outputs)
        for model in models:
            keep_run_hooks(model, cast_forward(model, None, output_caster))

    context.loss_scalers = loss_scalers
    context.track(models)
    for optimizer in optimizers:
        attach_controller(optimizer, context, param_names, fp32_values, max_consecutive_skips)

    if cast_type in LOW_PRECISION_DTYPES and not context.sharded_masters:
        for model in models:
            keep_run_hooks(model, register_fp32_state_dict_hooks(model, optimizers))

    # An earlier O1/O4 run's patches stay installed: its models keep its casts in their forward.
    # Only a run still alive can be affected by the new policy outside every model.
    earlier = _amp_state.live_runs()
    context.casting_policy = casting.use_run_policy(options, context.verbosity == 2,
                                                    earlier[-1].options.opt_level if earlier else None)
    for model in models:
        keep_run_hooks(model, casting.track_forward(model, context.casting_policy))
    check_autocast(models, options)
    _amp_state.publish(context)

    if optimizers_container is None:
        return models if models_was_list else models[0]
    models_out = models if models_was_list else models[0]
    if optimizers_container == "single":
        return models_out, optimizers[0]
    return models_out, optimizers_container(optimizers)


# Apex's names of these checks, for code that imported them from apex.amp._initialize.
check_models, check_params_fp32, check_optimizers = _check_models, _check_params_fp32, _check_optimizers

"""What ``amp.initialize`` does to models: checks, casting, forward patching and state-dict hooks.

Optimizers are handed to ``_process_optimizer``; loss scalers and O1/O4 patches are created here.
"""
import collections.abc
import copy
import functools

import torch
from torch import nn

from . import casting
from ._amp_state import _amp_state, warn_or_err
from ._master_weights import convert_network
from ._process_optimizer import _process_optimizer
from .scaler import LossScaler

LOW_PRECISION = (torch.float16, torch.bfloat16)
_PARALLEL_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def applier(value, fn):
    """Apply ``fn`` to every tensor (or object with ``.to``) inside ``value``, keeping container types.

    Dict subclasses, namedtuples, lists and tuples come back as the same type; strings, numpy
    arrays and anything unknown pass through untouched.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (str, bytes)) or type(value).__module__ == "numpy":
        return value
    if hasattr(value, "to") and callable(value.to) and not isinstance(value, nn.Module):
        return fn(value)
    if isinstance(value, collections.abc.Mapping):
        if type(value) is dict:
            return {key: applier(item, fn) for key, item in value.items()}
        if isinstance(value, dict):
            # copy.copy keeps the subclass and its extra state (defaultdict's factory, ...).
            out = copy.copy(value)
            for key, item in value.items():
                out[key] = applier(item, fn)
            return out
        return type(value)({key: applier(item, fn) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(applier(item, fn) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(applier(item, fn) for item in value)
    return value


def to_type(dtype, value):
    """Cast floating tensors to ``dtype``; objects with ``.to`` (custom batches) get ``.to(dtype)``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    return value.to(dtype)


def _check_models(models):
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
            if tensor.dtype in LOW_PRECISION:
                warn_or_err(
                    f"Found param or buffer {name} with dtype {tensor.dtype}. When using "
                    "amp.initialize, you do not need to call .half() or .bfloat16() on your model "
                    "before passing it, no matter what optimization level you choose.")


def _patch_forward(model, input_caster, output_caster):
    forward = model.forward

    @functools.wraps(forward)
    def new_fwd(*args, **kwargs):
        if input_caster is not None:
            args = applier(args, input_caster)
            kwargs = applier(kwargs, input_caster)
        return applier(forward(*args, **kwargs), output_caster)

    model.forward = new_fwd


def _register_fp32_state_dict_hooks(model, master_of):
    """Make ``model.state_dict()`` fp32 and exact; let ``load_state_dict`` restore the masters.

    Under master weights each low-precision parameter's entry is its fp32 master, so a checkpoint
    keeps the full-precision values; loading such a checkpoint writes them back into the masters
    (the model copy is rounded by ``load_state_dict`` itself). Other low-precision entries are
    widened to fp32, as Apex did.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    masters_by_name = {names[key]: master for key, master in master_of.items() if key in names}

    def to_fp32(module, state_dict, prefix, local_metadata):
        if prefix:  # only the root's hook walks the whole dict
            return
        for key, value in state_dict.items():
            master = masters_by_name.get(key)
            if master is not None:
                state_dict[key] = master.detach()
            elif isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
                state_dict[key] = value.float()

    def load_masters(module, state_dict, prefix, *args):
        for name, master in masters_by_name.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.shape == master.shape:
                with torch.no_grad():
                    master.copy_(value)

    model.register_state_dict_post_hook(to_fp32)
    model.register_load_state_dict_pre_hook(load_masters)


def _initialize(models, optimizers, properties, num_losses, cast_model_outputs, scaler_options,
                max_consecutive_skips, overflow_process_group):
    if isinstance(models, nn.Module):
        models_was_list = False
        models = [models]
    elif isinstance(models, list):
        models_was_list = True
    else:
        raise TypeError("models must be either a single model or a list of models, got "
                        f"{type(models).__name__}; pass a list, e.g. amp.initialize([model_a, model_b], ...).")

    if optimizers is None:
        optimizers_container = None
        optimizers = []
    elif isinstance(optimizers, (list, tuple)):
        optimizers_container = type(optimizers)
        optimizers = list(optimizers)
    elif isinstance(optimizers, torch.optim.Optimizer):
        optimizers_container = "single"
        optimizers = [optimizers]
    else:
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers, got "
                        f"{type(optimizers).__name__}.")
    for optimizer in optimizers:
        if getattr(optimizer, "_is_fp16_utils_optimizer", False) is True:
            raise RuntimeError("An incoming optimizer is an instance of fp16_utils.FP16_Optimizer. "
                               "amp.initialize creates its own master weights and loss scaling: pass "
                               "the plain torch.optim optimizer instead.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got "
                            f"{type(optimizer).__name__}.")
        if hasattr(optimizer, "_amp_stash"):
            raise RuntimeError("A given optimizer should only be passed through amp.initialize once. "
                               "Create a new optimizer for the new models, or keep using the one "
                               "amp.initialize returned the first time.")
    if len({id(opt) for opt in optimizers}) != len(optimizers):
        raise RuntimeError("The same optimizer appears more than once in the optimizers passed to "
                           "amp.initialize; pass each optimizer once.")

    _check_models(models)
    _check_params_fp32(models)

    # Masters start from the exact fp32 values, taken before the model is cast.
    fp32_values = {}
    cast_type = properties.cast_model_type
    if properties.master_weights and cast_type in LOW_PRECISION:
        for model in models:
            for param in model.parameters():
                if param.dtype == torch.float32:
                    fp32_values[id(param)] = param.detach().clone()

    if cast_type:
        for model in models:
            if properties.keep_batchnorm_fp32:
                convert_network(model, cast_type)
            else:
                model.to(cast_type)
        input_caster = functools.partial(to_type, cast_type)
        output_caster = functools.partial(to_type, cast_model_outputs or torch.float32)
        for model in models:
            _patch_forward(model, input_caster, output_caster)
        for optimizer in optimizers:
            optimizer.load_state_dict(optimizer.state_dict())
    elif cast_model_outputs is not None:
        output_caster = functools.partial(to_type, cast_model_outputs)
        for model in models:
            _patch_forward(model, None, output_caster)

    param_names = {}
    for model_idx, model in enumerate(models):
        prefix = f"model{model_idx}." if len(models) > 1 else ""
        for name, param in model.named_parameters():
            param_names.setdefault(param, prefix + name)

    for optimizer in optimizers:
        _process_optimizer(optimizer, properties, param_names, fp32_values, max_consecutive_skips)

    if cast_type in LOW_PRECISION:
        master_of = {}
        for optimizer in optimizers:
            stash = optimizer._amp_stash
            if properties.master_weights:
                for model_param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
                    master_of[id(model_param)] = master
        for model in models:
            _register_fp32_state_dict_hooks(model, master_of)

    _amp_state.overflow_process_group = overflow_process_group
    _amp_state.loss_scalers = [LossScaler(properties.loss_scale, **scaler_options)
                               for _ in range(num_losses)]

    if properties.patch_torch_functions:
        casting.init(loss_scale=properties.loss_scale, verbose=(_amp_state.verbosity == 2),
                     patch_type=properties.patch_torch_functions_type)
    elif _amp_state.handle is not None:
        # A previous O1/O4 initialize left its patches in place: remove them.
        _amp_state.handle._deactivate()
        _amp_state.handle = None

    if optimizers_container is None:
        return models if models_was_list else models[0]
    models_out = models if models_was_list else models[0]
    if optimizers_container == "single":
        return models_out, optimizers[0]
    return models_out, optimizers_container(optimizers)

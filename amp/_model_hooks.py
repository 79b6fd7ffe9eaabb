"""The hooks ``amp.initialize`` registers on a model: forward casting, the autocast check, fp32 state dicts.

Every hook is a module-level function bound with ``functools.partial`` (or a small picklable
object), never a closure over the original model, so ``copy.deepcopy(model)`` gives an
independent model and ``torch.save(model)`` can pickle it. The model keeps the handles of its
run's hooks (``keep_run_hooks``), so that initializing it again replaces them (``remove_run_hooks``).
"""
import collections.abc
import copy
import functools
import weakref

import torch
from torch import nn

from ._compat import (any_autocast_enabled, eager_under_compile, register_load_state_dict_pre_hook,
                      register_state_dict_post_hook)
from ._logging import warn_at_caller
from ._master_weights import LOW_PRECISION_DTYPES
from ._remainder_master import plain_value
from .casting.policy import in_disable_casts


def applier(value, fn):
    """Apply ``fn`` to every tensor (or object with ``.to``) inside ``value``, keeping container types.

    Dict subclasses, namedtuples, lists and tuples come back as the same type; strings, numpy
    arrays and anything unknown pass through untouched.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    # Plain containers first: they have no ``.to``, and torch.compile (before 2.5) cannot trace
    # ``hasattr`` on them, which would split a compiled forward in two.
    if type(value) in (list, tuple):
        return type(value)(applier(item, fn) for item in value)
    if type(value) is dict:
        return {key: applier(item, fn) for key, item in value.items()}
    if isinstance(value, (str, bytes)):
        return value
    if hasattr(value, "to") and callable(value.to) and not isinstance(value, nn.Module):
        return fn(value)
    if isinstance(value, dict):
        # copy.copy keeps the subclass and its extra state (defaultdict's factory, ...).
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = applier(item, fn)
        return out
    if isinstance(value, collections.abc.Mapping):
        # A Mapping subclass rebuilt from a dict, as such constructors (MappingProxyType, ...) take.
        return type(value)({key: applier(item, fn) for key, item in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(applier(item, fn) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(applier(item, fn) for item in value)
    return value


# The model attribute holding the handles of the hooks of the run that initialized it last.
_RUN_HOOKS = "_amp_run_hooks"


def remove_run_hooks(model):
    """Remove the hooks an earlier ``amp.initialize`` registered on ``model``: it carries its live run's only."""
    for handle in model.__dict__.pop(_RUN_HOOKS, ()):
        handle.remove()


def keep_run_hooks(model, handles):
    """Remember the handles of hooks that this ``amp.initialize`` registered on ``model``."""
    model.__dict__.setdefault(_RUN_HOOKS, []).extend(handles)


def to_type(dtype, value):
    """Cast floating tensors to ``dtype``; objects with ``.to`` (custom batches) get ``.to(dtype)``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    return value.to(dtype)


def _cast_inputs(caster, module, args, kwargs):
    return applier(args, caster), applier(kwargs, caster)


def _cast_output(caster, module, args, output):
    return applier(output, caster)


def cast_forward(model, input_caster, output_caster):
    """Cast the model's inputs with ``input_caster`` (unless None) and its output with ``output_caster``.

    The output is cast before any forward hook the user registered earlier sees it, as when the
    cast happened inside ``forward``. Returns the hooks' handles.
    """
    handles = []
    if input_caster is not None:
        handles.append(model.register_forward_pre_hook(functools.partial(_cast_inputs, input_caster),
                                                       with_kwargs=True))
    handles.append(model.register_forward_hook(functools.partial(_cast_output, output_caster), prepend=True))
    return handles


class AutocastCheck:
    """A forward pre-hook: warn, once per ``amp.initialize`` call, of ``torch.autocast`` around the forward.

    autocast overrides what amp chose (O1/O4 run bf16 linears under an fp16 loss scale, O2/O5
    models have their weights recast every forward), silently. Cheap where it is right: one
    check of torch's autocast state per forward, a constant under torch.compile. Inside
    ``amp.disable_casts()`` the user runs their own precision on purpose, and is not warned.
    """

    def __init__(self, opt_level, what_amp_does):
        self.opt_level = opt_level
        self.what_amp_does = what_amp_does
        self.warned = False

    def __call__(self, module, args):
        if any_autocast_enabled() and not self.warned and not in_disable_casts():
            self._warn(module)

    @eager_under_compile
    def _warn(self, module):
        self.warned = True
        warn_at_caller(
            f"amp: the forward of {type(module).__name__} runs inside torch.autocast, which overrides "
            f"the precision amp.initialize(opt_level={self.opt_level!r}) chose: {self.what_amp_does}. "
            "Remove the torch.autocast block (and a torch.amp.GradScaler, if any) around models that "
            "amp.initialize returned: amp already picks the precision. (Warned once per "
            "amp.initialize call.)")


def check_autocast(models, options):
    """Register an ``AutocastCheck`` on ``models``, the models of one run with ``options``, as run hooks."""
    low = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    if options.patch_torch_functions:
        what = (f"amp runs the listed ops in {low[options.patch_torch_functions_type]} and keeps the rest "
                "in fp32, and autocast recasts the ops on its own lists to its dtype instead, "
                "whatever loss scale amp runs")
    elif options.cast_model_type in LOW_PRECISION_DTYPES:
        what = (f"the model is {low[options.cast_model_type]} already, and autocast recasts its weights "
                "to its own dtype in every forward")
    else:
        what = "the forward runs in fp32, and autocast runs it in low precision without amp's loss scaling"
    check = AutocastCheck(options.opt_level, what)
    for model in models:
        keep_run_hooks(model, [model.register_forward_pre_hook(check)])


class _Masters:
    """Finds the fp32 masters of a model's params in the optimizers, each time it is asked.

    Looking them up at save/load time finds masters made after ``initialize`` (by
    ``add_param_group``). Only weak references are held, and a copy of the model (``deepcopy``,
    pickling) holds none: the copy's params are its own and no optimizer steps them, so its
    state dict is its own weights.
    """

    def __init__(self, optimizers):
        self.optimizers = [weakref.ref(optimizer) for optimizer in optimizers]

    def __getstate__(self):
        return {"optimizers": []}

    def named(self, module):
        """``(name, master)`` for every name of ``module``'s params that have one, tied aliases included."""
        master_of: dict[int, torch.Tensor] = {}
        for ref in self.optimizers:
            stash = getattr(ref(), "_amp_stash", None)
            masters = stash.weights.masters if stash is not None else None
            if masters is not None:
                master_of.update(zip(map(id, masters.model_params), masters.masters))
        return [(name, master_of[id(param)])
                for name, param in module.named_parameters(remove_duplicate=False) if id(param) in master_of]


def _state_dict_to_fp32(masters, module, state_dict, prefix, local_metadata):
    for name, master in masters.named(module):
        state_dict[prefix + name] = plain_value(master)
    for key, value in state_dict.items():
        low_precision = isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION_DTYPES
        if key.startswith(prefix) and low_precision:
            state_dict[key] = value.float()


def _load_masters(masters, module, state_dict, prefix, *args):
    for name, master in masters.named(module):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.shape == master.shape:
            with torch.no_grad():
                master.copy_(value)


def register_fp32_state_dict_hooks(model, optimizers):
    """Make ``model.state_dict()`` fp32 and exact; let ``load_state_dict`` restore the masters.

    Under master weights each low-precision parameter's entry (under every name it has) is its
    fp32 master, so a checkpoint keeps the full-precision values; loading one writes them back
    into the masters (the model copy is rounded by ``load_state_dict`` itself). Other
    low-precision entries are widened to fp32, as Apex did. Both work with the model inside a
    wrapper (DDP, a parent module): the keys carry the wrapper's prefix both ways. Returns the
    hooks' handles.
    """
    masters = _Masters(optimizers)
    return [register_state_dict_post_hook(model, functools.partial(_state_dict_to_fp32, masters)),
            register_load_state_dict_pre_hook(model, functools.partial(_load_masters, masters))]

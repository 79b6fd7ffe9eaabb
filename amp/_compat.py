"""Every private or version-dependent torch API amp relies on, probed once.

amp calls the names bound here instead of reaching into torch, so this module is the one place
that says what a torch upgrade may break. Each probe runs at import and binds a name to the
torch function itself (no per-call cost), to a portable fallback, or to a stub that raises a
clear error naming the missing API when amp first needs it. The distributed probes are the
exception: importing ``torch.distributed.tensor`` or FSDP costs half a second (sympy), which every
worker process would pay, so they run at first use, and amp never imports those modules to
recognise a ``DTensor`` or an FSDP unit: neither can exist before its module was imported.

Probed and bound here:

* ``torch._amp_foreach_non_finite_check_and_unscale_`` -> :func:`non_finite_check_and_unscale_`
* ``torch._foreach_norm(..., dtype=)`` -> :func:`foreach_norm` (fallback: per-tensor
  ``torch.linalg.vector_norm``)
* the fused optimizers' ``grad_scale``/``found_inf`` contract (``_step_supports_amp_scaling``)
  -> :func:`optimizer_accepts_found_inf` (fallback: never, so the flag is read on the host)
* ``torch.compiler.is_compiling`` -> :func:`is_compiling` (fallback: never compiling)
* ``torch._C._is_any_autocast_enabled`` -> :func:`any_autocast_enabled` (fallback, before torch
  2.4: ``torch.is_autocast_enabled()`` or ``torch.is_autocast_cpu_enabled()``, the device types
  that had autocast then)
* ``torch._disable_dynamo`` (``torch.compiler.disable`` that imports ``torch._dynamo`` at the
  first call, not at ``import amp``) -> :func:`eager_under_compile` (fallback: traced like any code)
* ``torch.nn.modules.rnn._VF``, ``RNNBase.check_input`` and ``RNNBase._flat_weights`` ->
  :func:`rnn_module`
* ``nn.Module.register_state_dict_post_hook`` / ``register_load_state_dict_pre_hook`` ->
  :func:`register_state_dict_post_hook` / :func:`register_load_state_dict_pre_hook`
  (public since torch 2.5; fallback: the private ``_register_state_dict_hook`` and
  ``_register_load_state_dict_pre_hook(with_module=True)``, which call hooks the same way)
* the mark an LR scheduler puts on the ``optimizer.step`` it wraps (``_wrapped_by_lr_sched``;
  ``_with_counter`` before torch 2.4) and what that wrapper records when called ->
  :data:`LR_SCHEDULER_STEP_MARKS` / :func:`record_step_for_lr_scheduler`
* ``torch.sparse_coo_tensor(..., is_coalesced=)`` -> :func:`coalesced_sparse_coo_tensor`
  (fallback: ``coalesce()``)
* FSDP2, at first use: ``DTensor`` (``torch.distributed.tensor``; ``torch.distributed._tensor``
  before 2.5) -> :func:`local_tensor`; ``fully_shard``, ``FSDPModule`` and ``MixedPrecisionPolicy``
  (``torch.distributed.fsdp``; ``torch.distributed._composable.fsdp`` before 2.6, where the
  module class is ``FSDP``) -> :func:`fsdp2` and :func:`loaded_fsdp2`; and the private per-module
  state that holds the mixed-precision policy (``_get_fsdp_state()._mp_policy``,
  ``._fsdp_param_group.mp_policy`` and its ``fsdp_params``' ``init_dtype_attrs``), used by
  ``amp._fsdp`` only

Relied upon but used directly, since a wrapper would only add indirection (checked at import,
so a torch without them fails with one clear ``ImportError``): the ``torch._foreach_*`` ops in
``FOREACH_OPS``. Also used directly, being part of torch since 1.x: ``Tensor._version`` (the
in-place counter), sparse ``Tensor._indices()`` / ``_values()``.
"""
import functools
import importlib
import inspect
import sys
import warnings

import torch

_ADVICE = "upgrade to torch>=2.3 (CI tests 2.3.1 and 2.13.0)"

FOREACH_OPS = ("_foreach_add_", "_foreach_copy_", "_foreach_mul_")


def _missing(api, advice=_ADVICE):
    """A stand-in for ``api`` that says which torch API is missing and what to do."""
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"amp needs {api}, which torch {torch.__version__} does not provide: "
                           f"{advice}.")
    return unavailable


def _require_foreach_ops():
    missing = [name for name in FOREACH_OPS if not hasattr(torch, name)]
    if missing:
        raise ImportError(f"amp needs torch.{', torch.'.join(missing)}, which torch "
                          f"{torch.__version__} does not provide: {_ADVICE}.")


def _probe_non_finite_check_and_unscale():
    name = "_amp_foreach_non_finite_check_and_unscale_"
    return getattr(torch, name, None) or _missing(f"torch.{name}")


def _vector_norms(tensors, ord=2, dtype=None):
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


def _probe_foreach_norm():
    try:
        torch._foreach_norm([torch.ones(1)], 2, dtype=torch.float32)
    except (AttributeError, TypeError, RuntimeError):
        return _vector_norms
    return torch._foreach_norm


def _step_supports_amp_scaling(optimizer):
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def _never(optimizer):
    return False


def _probe_found_inf_contract():
    # Fused Adam's functional form takes grad_scale/found_inf when the contract exists.
    try:
        adam = importlib.import_module("torch.optim.adam").adam
        params = inspect.signature(adam).parameters
    except (ImportError, AttributeError, ValueError):
        return _never
    return _step_supports_amp_scaling if {"grad_scale", "found_inf"} <= params.keys() else _never


def _not_compiling():
    return False


def _probe_is_compiling():
    compiler = getattr(torch, "compiler", None)
    return getattr(compiler, "is_compiling", None) or _not_compiling


def _autocast_on_cuda_or_cpu():
    return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _probe_any_autocast_enabled():
    # torch 2.3 has the function, but its torch.compile cannot name it in the graph it generates
    # (every compiled forward of an amp model checks autocast): it counts as absent there.
    if _torch_release() < (2, 4):
        return _autocast_on_cuda_or_cpu
    return getattr(torch._C, "_is_any_autocast_enabled", None) or _autocast_on_cuda_or_cpu


def _traced_anyway(fn=None, recursive=True):
    """``torch._disable_dynamo``'s signature, changing nothing: torch.compile traces ``fn`` as it can."""
    return fn if fn is not None else functools.partial(_traced_anyway, recursive=recursive)


def _probe_eager_under_compile():
    return getattr(torch, "_disable_dynamo", None) or _traced_anyway


def _torch_release():
    """torch's (major, minor) version."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _names_set_by(cls):
    """The attribute names ``cls.__init__`` and ``cls._init_flat_weights`` use (their code's names)."""
    names = set()
    for method in ("__init__", "_init_flat_weights"):
        code = getattr(getattr(cls, method, None), "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names


def _probe_rnn_internals():
    rnn = torch.nn.modules.rnn
    missing = [api for api, found in (
        ("torch.nn.modules.rnn._VF", hasattr(rnn, "_VF")),
        ("torch.nn.RNNBase.check_input", hasattr(rnn.RNNBase, "check_input")),
        # Read off the code that sets it: building an RNN would draw from the global RNG (on the
        # CPU; `import amp` after seeding would change the user's random numbers) or, on the meta
        # device, import sympy through torch's decompositions (torch 2.3), half a second.
        ("torch.nn.RNNBase._flat_weights", "_flat_weights" in _names_set_by(rnn.RNNBase)),
    ) if not found]
    if missing:
        return _missing(" and ".join(missing), _ADVICE + ", or use O2/O3, which patch no RNNs")
    return lambda: rnn


def _probe_state_dict_post_hook():
    module = torch.nn.Module
    if hasattr(module, "register_state_dict_post_hook"):
        return module.register_state_dict_post_hook
    # torch < 2.5: the private forerunner calls hook(module, state_dict, prefix, local_metadata).
    if hasattr(module, "_register_state_dict_hook"):
        return module._register_state_dict_hook
    return _missing("torch.nn.Module.register_state_dict_post_hook")


def _private_load_state_dict_pre_hook(module, hook):
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


def _probe_load_state_dict_pre_hook():
    module = torch.nn.Module
    if hasattr(module, "register_load_state_dict_pre_hook"):
        return module.register_load_state_dict_pre_hook
    # torch < 2.5: with_module=True makes the private forerunner pass the module first.
    if hasattr(module, "_register_load_state_dict_pre_hook"):
        return _private_load_state_dict_pre_hook
    return _missing("torch.nn.Module.register_load_state_dict_pre_hook")


#: The attributes by which an LR scheduler knows that it wrapped ``optimizer.step`` already.
LR_SCHEDULER_STEP_MARKS = ("_wrapped_by_lr_sched", "_with_counter")


def record_step_for_lr_scheduler(optimizer, step):
    """Record what ``step``'s LR-scheduler wrapper records when called, for a step amp skipped.

    Without it the scheduler warns at its first ``step()`` that ``optimizer.step()`` never ran.
    """
    if hasattr(step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True
    elif hasattr(step, "_with_counter"):  # torch < 2.4 counts the calls instead
        optimizer._step_count = getattr(optimizer, "_step_count", 0) + 1


def _sparse_coo_is_coalesced(indices, values, size):
    # The indices come from coalesce(), so torch's invariant check is skipped on purpose; some
    # torch versions (2.11) warn about the skip itself, which would only be noise to users.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse invariant checks are implicitly disabled")
        return torch.sparse_coo_tensor(indices, values, size, is_coalesced=True,
                                       check_invariants=False)


def _sparse_coo_coalesce(indices, values, size):
    return torch.sparse_coo_tensor(indices, values, size).coalesce()


def _probe_sparse_coo_is_coalesced():
    try:
        _sparse_coo_is_coalesced(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (1,))
    except TypeError:
        return _sparse_coo_coalesce
    return _sparse_coo_is_coalesced


def _import_first(*names):
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


# Where DTensor and FSDP2 live (the second name: before torch 2.5 / 2.6).
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")
_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
_dtensor_class = None


def _loaded_dtensor_class():
    # torch < 2.5 has a torch.distributed.tensor package too, without DTensor in it.
    for name in _DTENSOR_MODULES:
        found = getattr(sys.modules.get(name), "DTensor", None)
        if found is not None:
            return found
    return None


def local_tensor(t):
    """The local shard of a ``DTensor``; any other tensor itself."""
    global _dtensor_class
    if type(t) is torch.Tensor:  # the common case, a plain grad: no DTensor
        return t
    if _dtensor_class is None:
        _dtensor_class = _loaded_dtensor_class()
        if _dtensor_class is None:
            return t
    return t.to_local() if isinstance(t, _dtensor_class) else t


@functools.lru_cache(maxsize=None)
def fsdp2():
    """``(fully_shard, FSDPModule, MixedPrecisionPolicy)``, or None where torch lacks FSDP2.

    Imports FSDP at the first call; to recognise a model as FSDP2's, :func:`loaded_fsdp2` imports nothing.
    """
    public = _import_first("torch.distributed.fsdp")
    if public is not None and hasattr(public, "fully_shard") and hasattr(public, "FSDPModule"):
        return public.fully_shard, public.FSDPModule, public.MixedPrecisionPolicy
    composable = _import_first("torch.distributed._composable.fsdp")
    if composable is None or not hasattr(composable, "fully_shard"):
        return None
    module_class = getattr(composable, "FSDPModule", None) or getattr(composable, "FSDP", None)
    return composable.fully_shard, module_class, composable.MixedPrecisionPolicy


def loaded_fsdp2():
    """:func:`fsdp2` once a program imported FSDP, else None: before that no model is an FSDP2 unit."""
    if not any(name in sys.modules for name in _FSDP_MODULES):
        return None
    return fsdp2()


_require_foreach_ops()
#: ``(tensors, found_inf, inv_scale)``: unscale in place, flag non-finite values in ``found_inf``.
non_finite_check_and_unscale_ = _probe_non_finite_check_and_unscale()
#: ``(tensors, ord, dtype=)``: a list of 0-dim norms, each computed in ``dtype``.
foreach_norm = _probe_foreach_norm()
#: ``(optimizer)``: whether ``optimizer.step`` skips by itself on ``optimizer.found_inf``.
optimizer_accepts_found_inf = _probe_found_inf_contract()
#: ``()``: whether torch.compile is tracing the caller.
is_compiling = _probe_is_compiling()
#: ``()``: whether ``torch.autocast`` is on for any device type (torch.compile folds it to a constant).
any_autocast_enabled = _probe_any_autocast_enabled()
#: ``(fn, recursive=True)``, a decorator: torch.compile does not trace ``fn`` but runs it as it is
#: (a compiled caller breaks its graph there); with ``recursive=False`` the functions ``fn`` calls
#: are still compiled.
eager_under_compile = _probe_eager_under_compile()
#: ``()``: ``torch.nn.modules.rnn``, whose ``_VF`` and ``RNNBase.check_input`` O1/O4 patch.
rnn_module = _probe_rnn_internals()
#: ``(module, hook)``: ``hook(module, state_dict, prefix, local_metadata)`` after ``state_dict``.
register_state_dict_post_hook = _probe_state_dict_post_hook()
#: ``(module, hook)``: ``hook(module, state_dict, prefix, *args)`` before ``load_state_dict``.
register_load_state_dict_pre_hook = _probe_load_state_dict_pre_hook()
#: ``(indices, values, size)``: a sparse COO tensor the caller knows to be coalesced.
coalesced_sparse_coo_tensor = _probe_sparse_coo_is_coalesced()

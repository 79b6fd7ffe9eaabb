"""``apex.amp.wrap``: Apex's wrapper makers, for code that patches functions with a handle itself.

Each takes Apex's arguments (a module or class and a function name, a cast function from
``apex.amp.utils`` and the handle of ``amp.init()``) and installs its wrapper through the handle,
so ``amp.deactivate()`` removes it with amp's own patches. The casts follow amp's rules: any mix of
floating types promotes to the widest (Apex refused all but half with float), and bf16 counts as
low precision wherever fp16 does.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NoReturn

import torch

from amp._amp_state import _amp_state
from amp._compat import rnn_module
from amp.casting import rnn
from amp.casting._cast import FLOATING, LOW_PRECISION, any_low_precision, widest_type

from . import utils

__all__ = ["make_cast_wrapper", "cached_cast", "make_promote_wrapper", "promote", "sequence_promote",
           "promote_match_arg0", "err_if_any_half", "err_if_arg0_half", "rnn_cast", "new_rnn_cast",
           "disable_casts"]

Function = Callable[..., Any]


def _installed_handle_active() -> bool:
    handle = _amp_state.handle
    return handle is not None and handle.is_active()


def _to(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype in FLOATING else x


def make_cast_wrapper(orig_fn: Function, cast_fn: Function, handle: Any, try_caching: bool = False) -> Function:
    """``orig_fn`` with its floating arguments cast by ``cast_fn`` while ``handle`` is active
    (fp32 parameters' casts reused from the handle's cache with ``try_caching``)."""
    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not handle.is_active():
            return orig_fn(*args, **kwargs)
        if try_caching and handle.has_cache:
            args = tuple(utils.cached_cast(cast_fn, a, handle.cache) if utils.should_cache(a) else a
                         for a in args)
            for key, value in kwargs.items():
                if utils.should_cache(value):
                    kwargs[key] = utils.cached_cast(cast_fn, value, handle.cache)
        return orig_fn(*utils.casted_args(cast_fn, args, kwargs), **kwargs)
    return wrapper


def cached_cast(mod: Any, fn: str, cast_fn: Function, handle: Any, try_caching: bool = False,
                verbose: bool = False) -> None:
    """Patch ``mod.fn`` to cast its arguments with ``cast_fn`` (a missing ``fn`` is skipped, as in Apex)."""
    if not utils.has_func(mod, fn):
        return
    cast_fn = utils.verbosify(cast_fn, fn, verbose)
    utils.set_func_save(handle, mod, fn, make_cast_wrapper(utils.get_func(mod, fn), cast_fn, handle, try_caching))


def make_promote_wrapper(orig_fn: Function, cast_fn: Function, handle: Any = None) -> Function:
    """``orig_fn`` with mixed floating arguments cast to their widest type (half with float: by
    ``cast_fn``) while the handle of the latest ``amp.init()`` is active (``handle`` is unused, as in Apex)."""
    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _installed_handle_active():
            return orig_fn(*args, **kwargs)
        dtype = widest_type((*args, *kwargs.values()))
        if dtype is None:
            return orig_fn(*args, **kwargs)
        cast = cast_fn if dtype is torch.float32 else functools.partial(_to, dtype=dtype)
        return orig_fn(*utils.casted_args(cast, args, kwargs), **kwargs)
    return wrapper


def promote(mod: Any, fn: str, handle: Any, verbose: bool = False) -> None:
    """Patch ``mod.fn`` to promote mixed floating arguments to their widest type."""
    maybe_float = utils.verbosify(utils.maybe_float, fn, verbose)
    utils.set_func_save(handle, mod, fn, make_promote_wrapper(utils.get_func(mod, fn), maybe_float))


def sequence_promote(mod: Any, fn: str, handle: Any, verbose: bool = False) -> None:
    """Patch ``mod.fn`` (``cat``, ``stack``) to promote the tensors of its first argument."""
    orig_fn = utils.get_func(mod, fn)
    maybe_float = utils.verbosify(utils.maybe_float, fn, verbose)

    @functools.wraps(orig_fn)
    def wrapper(seq: Any, *args: Any, **kwargs: Any) -> Any:
        dtype = widest_type(seq) if _installed_handle_active() else None
        if dtype is not None:
            cast = maybe_float if dtype is torch.float32 else functools.partial(_to, dtype=dtype)
            seq = [cast(x) for x in seq]
        return orig_fn(seq, *args, **kwargs)
    utils.set_func_save(handle, mod, fn, wrapper)


def promote_match_arg0(mod: Any, fn: str, handle: Any, verbose: bool = False) -> None:
    """Patch the in-place method ``mod.fn`` to cast its other arguments to ``self``'s dtype."""
    if not utils.has_func(mod, fn):
        return
    orig_fn = utils.get_func(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(arg0: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _installed_handle_active() or arg0.dtype not in FLOATING:
            return orig_fn(arg0, *args, **kwargs)
        cast = functools.partial(_to, dtype=arg0.dtype)
        return orig_fn(arg0, *utils.casted_args(cast, args, kwargs), **kwargs)
    utils.set_func_save(handle, mod, fn, wrapper)


def err_if_any_half(mod: Any, fn: str, handle: Any, custom_err_msg: str | None = None) -> None:
    """Patch ``mod.fn`` to refuse fp16/bf16 arguments with ``custom_err_msg`` (or Apex's message)."""
    if not utils.has_func(mod, fn):
        return
    orig_fn = utils.get_func(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if any_low_precision(args, kwargs):
            raise NotImplementedError(custom_err_msg or f"Cannot call in-place function {fn} with fp16 arguments.")
        return orig_fn(*args, **kwargs)
    utils.set_func_save(handle, mod, fn, wrapper)


def err_if_arg0_half(mod: Any, fn: str, handle: Any, verbose: bool = False) -> None:
    """Patch the in-place method ``mod.fn`` to refuse an fp16/bf16 ``self`` and cast the rest to fp32."""
    if not utils.has_func(mod, fn):
        return
    orig_fn = utils.get_func(mod, fn)
    maybe_float = utils.verbosify(utils.maybe_float, fn, verbose)

    @functools.wraps(orig_fn)
    def wrapper(arg0: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if arg0.dtype in LOW_PRECISION:
            raise NotImplementedError(f"Cannot call in-place method {fn} on fp16 Tensors.")
        return orig_fn(arg0, *utils.casted_args(maybe_float, args, kwargs), **kwargs)
    utils.set_func_save(handle, mod, fn, wrapper)


def rnn_cast(backend: Any, fn: str, handle: Any, verbose: bool = False) -> NoReturn:
    """Apex's patch of PyTorch 0.4's ``torch.nn.backends.thnn`` RNN backend, which PyTorch no longer has."""
    raise RuntimeError("apex.amp.wrap.rnn_cast patched torch.nn.backends.thnn, which PyTorch removed in "
                       "1.0: use apex.amp.wrap.new_rnn_cast, or let amp.init() / amp.initialize at O1 "
                       "cast every RNN itself.")


def new_rnn_cast(fn: str, handle: Any, verbose: bool = False) -> None:
    """Patch the RNN entry point ``fn`` (``"LSTM"``, ``"GRU"``, ``"RNN_TANH"``, ``"RNN_RELU"``) of
    ``torch.nn.modules.rnn`` to run in the low precision of amp's O1/O4 policy, as ``amp.init()``
    does for all four."""
    module = rnn_module()
    name = fn.lower()
    if not isinstance(module._VF, rnn._VFShim):
        utils.set_func_save(handle, module, "_VF", rnn._VFShim(module._VF))
    utils.set_func_save(handle, module._VF, name, rnn._make_rnn_wrapper(getattr(module._VF, name), name))


def disable_casts(mod: Any, fn: str, handle: Any) -> None:
    """Patch ``mod.fn`` to run with ``handle``'s casts off."""
    if not utils.has_func(mod, fn):
        return
    orig_fn = utils.get_func(mod, fn)

    @functools.wraps(orig_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with handle._disable_casts():
            return orig_fn(*args, **kwargs)
    utils.set_func_save(handle, mod, fn, wrapper)

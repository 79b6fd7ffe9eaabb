"""Wrapper factories: each returns a replacement for one patched function.

Every wrapper keeps the original's name and docstring (``functools.wraps``) and reads the
current policy (``policy.current``) on each call, so the model whose forward is running, and
``disable_casts``, decide what it does.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, cast as typing_cast

import torch
from torch import Tensor

from . import policy
from ._cast import (FLOATING, LOW_PRECISION, Caster, any_low_precision, cast_args, cast_tensor,
                    no_floating_scalar, widest_type)

#: A patched function, or its replacement.
Function = Callable[..., Any]


def make_policy_caster(name: str, try_caching: bool = False) -> Caster:
    """``cast(tensor, dtype)`` with the verbosity and weight-cast cache of the current policy.

    Looked up at cast time, not per call: a call that needs no cast pays nothing for it.
    """
    def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
        # Only a wrapper that found an active policy casts, and only a RunPolicy is ever active.
        run = typing_cast(policy.RunPolicy, policy.current)
        cache = run.cache if try_caching and run.has_cache else None
        return cast_tensor(t, dtype, name, run.verbose, cache)
    return cast


def make_cast_wrapper(orig: Function, name: str, dtype: torch.dtype | None, try_caching: bool,
                      only: torch.dtype | None = None) -> Function:
    """Run ``orig`` with its floating arguments cast to ``dtype`` (None: the policy's patch type).

    ``only``: cast only under a policy of this patch type (a name on one low-precision list).
    """
    cast = make_policy_caster(name, try_caching)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        run = policy.current
        if run is None or not run._is_active or (only is not None and run.patch_type is not only):
            return orig(*args, **kwargs)
        args, kwargs = cast_args(args, kwargs, run.patch_type if dtype is None else dtype, cast)
        return orig(*args, **kwargs)
    return wrapper


def make_promote_wrapper(orig: Function, name: str, native: bool = False) -> Function:
    """Run ``orig`` with its floating arguments cast to the widest floating type among them.

    ``native``: ``orig`` promotes by itself unless an operand is a 0-dim floating tensor
    (``lists.NATIVE_PROMOTE``), so the explicit cast is only needed then.

    For ``x += y`` (``__iadd__``) with x half and y float this means x is widened to a float copy,
    the add happens on the copy, and Python rebinds x to the float result (as in Apex); the
    original half tensor is left unchanged. Spell it ``x.add_(y)`` to keep x's dtype.
    """
    cast = make_policy_caster(name)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        run = policy.current
        if run is not None and run._is_active:
            values = (*args, *kwargs.values()) if kwargs else args
            if not (native and no_floating_scalar(values)):
                dtype = widest_type(values)
                if dtype is not None:
                    args, kwargs = cast_args(args, kwargs, dtype, cast)
        return orig(*args, **kwargs)
    return wrapper


def make_sequence_promote_wrapper(orig: Function, name: str) -> Function:
    """For ``cat``/``stack``: cast the tensors of the first argument to their widest type."""
    cast = make_policy_caster(name)

    @functools.wraps(orig)
    def wrapper(seq: Any, *args: Any, **kwargs: Any) -> Any:
        run = policy.current
        if run is not None and run._is_active:
            dtype = widest_type(seq)
            if dtype is not None:
                seq = type(seq)(t if t.dtype is dtype else cast(t, dtype) for t in seq)
        return orig(seq, *args, **kwargs)
    return wrapper


def make_match_self_wrapper(orig: Function, name: str) -> Function:
    """In-place methods (``x.add_(y)``): cast the other arguments to x's dtype, so x keeps it."""
    cast = make_policy_caster(name)

    @functools.wraps(orig)
    def wrapper(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        run = policy.current
        if run is not None and run._is_active and self.dtype in FLOATING:
            args, kwargs = cast_args(args, kwargs, self.dtype, cast)
        return orig(self, *args, **kwargs)
    return wrapper


def make_error_if_any_low_precision(orig: Function, name: str, message: str | None = None) -> Function:
    """Refuse fp16/bf16 arguments: for in-place fp32-only functions and banned functions.

    Like Apex, this refuses inside ``disable_casts`` too: the function is unsafe in low precision
    whether or not casts are currently enabled. Under no O1/O4 policy (an O2 model's forward,
    after an O0/O2/O3/O5 ``initialize``) it is the plain function.
    """
    message = message or f"Cannot call in-place function {name} with fp16 or bf16 arguments."

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if policy.current is not None and any_low_precision(args, kwargs):
            raise NotImplementedError(message)
        return orig(*args, **kwargs)
    return wrapper


def make_banned_wrapper(orig: Function, name: str, message: str) -> Function:
    """A banned function: refused with fp16/bf16 arguments, or run in fp32 under a policy made
    with ``allow_banned``."""
    refuse = make_error_if_any_low_precision(orig, name, message)
    cast = make_policy_caster(name)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        run = policy.current
        if run is None or not run.allow_banned:
            return refuse(*args, **kwargs)
        if run._is_active:
            args, kwargs = cast_args(args, kwargs, torch.float32, cast)
        return orig(*args, **kwargs)
    return wrapper


def make_error_if_self_low_precision(orig: Function, name: str) -> Function:
    """In-place fp32-only methods (``x.exp_()``): refuse an fp16/bf16 ``x``; else match x."""
    cast = make_policy_caster(name)

    @functools.wraps(orig)
    def wrapper(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        run = policy.current
        if run is None:
            return orig(self, *args, **kwargs)
        if self.dtype in LOW_PRECISION:
            raise NotImplementedError(
                f"Cannot call in-place method {name} on {self.dtype} tensors: it needs fp32 "
                f"precision. Use the out-of-place form ({name[:-1]}), which amp runs in fp32.")
        if run._is_active and self.dtype in FLOATING:
            args, kwargs = cast_args(args, kwargs, self.dtype, cast)
        return orig(self, *args, **kwargs)
    return wrapper


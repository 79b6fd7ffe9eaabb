"""Wrapper factories: each returns a replacement for one patched function.

Every wrapper keeps the original's name and docstring (``functools.wraps``) and consults the
handle it was built for, so ``disable_casts`` and ``_deactivate`` switch all of them at once.
"""
import functools

from ._cast import (FLOATING, LOW_PRECISION, any_low_precision, cast_args, make_caster,
                    no_floating_scalar, widest_type)


def make_cast_wrapper(orig, name, handle, dtype, try_caching):
    """Run ``orig`` with its floating arguments cast to ``dtype``."""
    cast = make_caster(name, handle.verbose, handle._cache if try_caching and handle.has_cache
                       else None)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if not handle._is_active:
            return orig(*args, **kwargs)
        args, kwargs = cast_args(args, kwargs, dtype, cast)
        return orig(*args, **kwargs)
    return wrapper


def make_promote_wrapper(orig, name, handle, native=False):
    """Run ``orig`` with its floating arguments cast to the widest floating type among them.

    ``native``: ``orig`` promotes by itself unless an operand is a 0-dim floating tensor
    (``lists.NATIVE_PROMOTE``), so the explicit cast is only needed then.

    For ``x += y`` (``__iadd__``) with x half and y float this means x is widened to a float copy,
    the add happens on the copy, and Python rebinds x to the float result (as in Apex); the
    original half tensor is left unchanged. Spell it ``x.add_(y)`` to keep x's dtype.
    """
    cast = make_caster(name, handle.verbose)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if handle._is_active:
            values = (*args, *kwargs.values()) if kwargs else args
            if not (native and no_floating_scalar(values)):
                dtype = widest_type(values)
                if dtype is not None:
                    args, kwargs = cast_args(args, kwargs, dtype, cast)
        return orig(*args, **kwargs)
    return wrapper


def make_sequence_promote_wrapper(orig, name, handle):
    """For ``cat``/``stack``: cast the tensors of the first argument to their widest type."""
    cast = make_caster(name, handle.verbose)

    @functools.wraps(orig)
    def wrapper(seq, *args, **kwargs):
        if handle._is_active:
            dtype = widest_type(seq)
            if dtype is not None:
                seq = type(seq)(t if t.dtype is dtype else cast(t, dtype) for t in seq)
        return orig(seq, *args, **kwargs)
    return wrapper


def make_match_self_wrapper(orig, name, handle):
    """In-place methods (``x.add_(y)``): cast the other arguments to x's dtype, so x keeps it."""
    cast = make_caster(name, handle.verbose)

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        if handle._is_active and self.dtype in FLOATING:
            args, kwargs = cast_args(args, kwargs, self.dtype, cast)
        return orig(self, *args, **kwargs)
    return wrapper


def make_error_if_any_low_precision(orig, name, message=None):
    """Refuse fp16/bf16 arguments: for in-place fp32-only functions and banned functions.

    Like Apex, this does not consult the handle: the function is unsafe in low precision
    whether or not casts are currently enabled.
    """
    message = message or f"Cannot call in-place function {name} with fp16 or bf16 arguments."

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if any_low_precision(args, kwargs):
            raise NotImplementedError(message)
        return orig(*args, **kwargs)
    return wrapper


def make_error_if_self_low_precision(orig, name, handle):
    """In-place fp32-only methods (``x.exp_()``): refuse an fp16/bf16 ``x``; else match x."""
    cast = make_caster(name, handle.verbose)

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        if self.dtype in LOW_PRECISION:
            raise NotImplementedError(
                f"Cannot call in-place method {name} on {self.dtype} tensors: it needs fp32 "
                f"precision. Use the out-of-place form ({name[:-1]}), which amp runs in fp32.")
        if handle._is_active and self.dtype in FLOATING:
            args, kwargs = cast_args(args, kwargs, self.dtype, cast)
        return orig(self, *args, **kwargs)
    return wrapper


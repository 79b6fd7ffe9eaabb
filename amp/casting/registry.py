"""User additions to the lists, and the ``*_function`` decorators.

``register_*_function`` (``patcher.py``) records a registration here; the patches install it
innermost, so it overrides the built-in lists: at once when O1/O4 patches are installed, else at
the next ``init`` (``amp.initialize`` with O1 or O4). Registrations stay with the installed
patches until ``amp.deactivate()``. Decorators instead look up the current policy at each call,
so they work whether they run before or after ``init``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple, TypeVar, cast as typing_cast

import torch

from . import policy
from ._cast import cast_args, make_caster, widest_type

__all__ = ["record", "consume_registry", "half_function", "float_function", "bfloat16_function",
           "promote_function"]

#: A registration: ``(module, name, dtype)``; dtype None means promote. ``module`` is whatever
#: holds the function as an attribute (a module such as ``torch``, a class such as ``torch.Tensor``).
Registration = Tuple[object, str, Optional[torch.dtype]]
#: A function that a decorator returns with the same signature.
F = TypeVar("F", bound=Callable[..., Any])

# Registrations in registration order.
_USER_REGISTRY: List[Registration] = []


def record(module: object, name: str, dtype: torch.dtype | None) -> None:
    """Remember that ``module.name`` runs in ``dtype`` (None: promoted) under amp."""
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    _USER_REGISTRY.append((module, name, dtype))


def consume_registry() -> list[Registration]:
    """Return the pending registrations, without duplicates, and forget them."""
    pending = list(dict.fromkeys(_USER_REGISTRY))
    _USER_REGISTRY.clear()
    return pending


def _active_handle() -> policy.RunPolicy | None:
    run = policy.current
    return run if run is not None and run._is_active else None


def _cast_decorator(dtype: torch.dtype) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            handle = _active_handle()
            if handle is None:
                return fn(*args, **kwargs)
            cast = make_caster(fn.__name__, handle.verbose,
                               handle._cache if handle.has_cache else None)
            args, kwargs = cast_args(args, kwargs, dtype, cast)
            return fn(*args, **kwargs)
        # functools.wraps gives the wrapper fn's name and docstring; its signature is fn's too.
        return typing_cast(F, wrapper)
    return decorator


half_function = _cast_decorator(torch.float16)
half_function.__doc__ = "Decorator: run ``fn`` with fp16 arguments while amp casts are active."
bfloat16_function = _cast_decorator(torch.bfloat16)
bfloat16_function.__doc__ = "Decorator: run ``fn`` with bf16 arguments while amp casts are active."
float_function = _cast_decorator(torch.float32)
float_function.__doc__ = "Decorator: run ``fn`` with fp32 arguments while amp casts are active."


def promote_function(fn: F) -> F:
    """Decorator: run ``fn`` with its floating arguments cast to their widest type under amp."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handle = _active_handle()
        if handle is not None:
            dtype = widest_type((*args, *kwargs.values()) if kwargs else args)
            if dtype is not None:
                args, kwargs = cast_args(args, kwargs, dtype, make_caster(fn.__name__,
                                                                          handle.verbose))
        return fn(*args, **kwargs)
    return typing_cast(F, wrapper)

"""User additions to the lists: ``register_*_function`` and the ``*_function`` decorators.

Registrations are recorded here and installed innermost, so they override the built-in lists:
at once when O1/O4 patches are installed, else by the next ``init`` (``amp.initialize`` with O1
or O4). They stay with the installed patches until ``amp.deactivate()``. Decorators instead look
up the current policy at each call, so they work whether they run before or after ``init``.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, TypeVar, cast as typing_cast

import torch

from .._amp_state import _amp_state
from . import policy
from ._cast import cast_args, make_caster, widest_type

if TYPE_CHECKING:
    from .handle import AmpHandle

__all__ = [
    "register_half_function", "register_float_function", "register_bfloat16_function",
    "register_promote_function", "half_function", "float_function", "bfloat16_function",
    "promote_function",
]

#: A registration: ``(module, name, dtype)``; dtype None means promote. ``module`` is whatever
#: holds the function as an attribute (a module such as ``torch``, a class such as ``torch.Tensor``).
Registration = Tuple[object, str, Optional[torch.dtype]]
#: A function that a decorator returns with the same signature.
F = TypeVar("F", bound=Callable[..., Any])

# Registrations in registration order.
_USER_REGISTRY: List[Registration] = []


def _register(module: object, name: str, dtype: torch.dtype | None) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    _USER_REGISTRY.append((module, name, dtype))
    if _amp_state.handle is not None:
        _amp_state.handle._apply_registrations()


def register_half_function(module: object, name: str) -> None:
    """Run ``module.name`` in fp16 under amp: at once when O1/O4 patches are installed, else
    from the next ``amp.initialize``."""
    _register(module, name, torch.float16)


def register_bfloat16_function(module: object, name: str) -> None:
    """Run ``module.name`` in bf16 under amp: at once when O1/O4 patches are installed, else
    from the next ``amp.initialize``."""
    _register(module, name, torch.bfloat16)


def register_float_function(module: object, name: str) -> None:
    """Run ``module.name`` in fp32 under amp: at once when O1/O4 patches are installed, else
    from the next ``amp.initialize``."""
    _register(module, name, torch.float32)


def register_promote_function(module: object, name: str) -> None:
    """Run ``module.name`` in the widest floating type of its arguments under amp."""
    _register(module, name, None)


def consume_registry() -> list[Registration]:
    """Return the pending registrations, without duplicates, and forget them."""
    pending = list(dict.fromkeys(_USER_REGISTRY))
    _USER_REGISTRY.clear()
    return pending


def _active_handle() -> AmpHandle | None:
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

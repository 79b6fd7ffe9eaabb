"""``apex.amp.utils``: Apex's helpers for casting arguments and patching functions, on amp's rules.

Two differences from Apex, both amp's: ``maybe_half`` / ``maybe_float`` cast CPU tensors too (Apex
left them alone), and ``cached_cast`` keeps amp's weight-cast cache format, so that a cache it
fills is the one amp's own O1 patches read (a cast copy is reused while its parameter is unchanged).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from amp.casting._cast import FLOATING, TYPE_NAMES

__all__ = ["is_cuda_enabled", "get_cuda_version", "is_fp_tensor", "is_nested", "should_cache",
           "collect_fp_tensor_types", "type_string", "maybe_half", "maybe_float", "casted_args",
           "cached_cast", "verbosify", "as_inplace", "has_func", "get_func", "set_func",
           "set_func_save", "synthesize_flattened_rnn_weights", "new_synthesize_flattened_rnn_weights"]


def is_cuda_enabled() -> bool:
    """Whether this PyTorch was built with CUDA."""
    return torch.version.cuda is not None


def get_cuda_version() -> tuple[int, ...]:
    """The CUDA version this PyTorch was built with, e.g. ``(12, 4)``."""
    if torch.version.cuda is None:
        raise RuntimeError("this PyTorch is built without CUDA (torch.version.cuda is None)")
    return tuple(int(part) for part in torch.version.cuda.split("."))


def is_nested(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def is_fp_tensor(x: Any) -> bool:
    """A floating-point tensor, or a list/tuple made only of them."""
    if is_nested(x):
        return all(is_fp_tensor(y) for y in x)
    return isinstance(x, torch.Tensor) and x.dtype in FLOATING


def should_cache(x: Any) -> bool:
    """What Apex cached the casts of: fp32 parameters (or lists made only of them)."""
    if is_nested(x):
        return all(should_cache(y) for y in x)
    return isinstance(x, torch.nn.Parameter) and x.dtype is torch.float32


def type_string(x: torch.Tensor) -> str:
    """Apex's name of a tensor's type: ``"HalfTensor"``, ``"FloatTensor"``, ... (CPU or CUDA alike)."""
    return x.type().split(".")[-1]


def collect_fp_tensor_types(args: Sequence[Any], kwargs: dict[str, Any]) -> set[str]:
    """The ``type_string`` of every floating-point tensor among the arguments (lists looked into)."""
    types: set[str] = set()

    def collect(x: Any) -> None:
        if is_nested(x):
            for y in x:
                collect(y)
        else:
            types.add(type_string(x))

    for value in (*args, *kwargs.values()):
        if is_fp_tensor(value):
            collect(value)
    return types


def _caster(dtype: torch.dtype) -> Callable[..., Any]:
    def cast(x: Any, name: str = "", verbose: bool = False) -> Any:
        if is_nested(x):
            return type(x)([cast(y, name, verbose) for y in x])
        if not isinstance(x, torch.Tensor) or x.dtype is dtype:
            return x
        if verbose:
            print(f"{TYPE_NAMES.get(x.dtype, x.dtype)}->{TYPE_NAMES[dtype]} ({name})")
        return x.to(dtype)
    cast.dtype = dtype  # type: ignore[attr-defined]  # what cached_cast checks a cached copy against
    return cast


maybe_half = _caster(torch.float16)
maybe_half.__name__ = maybe_half.__qualname__ = "maybe_half"
maybe_half.__doc__ = "``x`` (a tensor, or a list/tuple of them) cast to fp16; ``verbose`` prints the cast."
maybe_float = _caster(torch.float32)
maybe_float.__name__ = maybe_float.__qualname__ = "maybe_float"
maybe_float.__doc__ = "``x`` (a tensor, or a list/tuple of them) cast to fp32; ``verbose`` prints the cast."


def casted_args(cast_fn: Callable[[Any], Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The positional arguments with each floating tensor cast by ``cast_fn``; ``kwargs`` are cast in place."""
    for key, value in kwargs.items():
        if is_fp_tensor(value):
            kwargs[key] = cast_fn(value)
    return [cast_fn(x) if is_fp_tensor(x) else x for x in args]


def cached_cast(cast_fn: Callable[[Any], Any], x: Any, cache: dict[Any, Any]) -> Any:
    """``cast_fn(x)``, reused from ``cache`` while ``x`` (a parameter) is unchanged since it was cast.

    ``cache`` is amp's (a handle's ``cache``): parameter -> (cast copy, the parameter's version).
    A copy made without grad is not reused while grad is on, as in Apex.
    """
    if is_nested(x):
        return type(x)([cached_cast(cast_fn, y, cache) for y in x])
    entry = cache.get(x)
    dtype = getattr(cast_fn, "dtype", None)
    if entry is not None:
        copy, version = entry
        fresh = version == x._version and copy.dtype is dtype
        if fresh and (copy.requires_grad == x.requires_grad or not torch.is_grad_enabled()):
            return copy
    copy = cast_fn(x)
    if dtype is not None and not torch.is_inference_mode_enabled():
        cache[x] = (copy, x._version)
    return copy


def verbosify(cast_fn: Callable[..., Any], fn_name: str, verbose: bool) -> Callable[..., Any]:
    """``cast_fn`` bound to print each cast it makes for ``fn_name`` when ``verbose``."""
    return functools.partial(cast_fn, name=fn_name, verbose=verbose) if verbose else cast_fn


def as_inplace(fns: Iterable[str]) -> Iterator[str]:
    """The in-place names (``"exp"`` -> ``"exp_"``)."""
    for name in fns:
        yield name + "_"


def has_func(mod: Any, fn: str) -> bool:
    return fn in mod if isinstance(mod, dict) else hasattr(mod, fn)


def get_func(mod: Any, fn: str) -> Any:
    return mod[fn] if isinstance(mod, dict) else getattr(mod, fn)


def set_func(mod: Any, fn: str, new_fn: Any) -> None:
    if isinstance(mod, dict):
        mod[fn] = new_fn
    else:
        setattr(mod, fn, new_fn)


def set_func_save(handle: Any, mod: Any, fn: str, new_fn: Any) -> None:
    """Install ``new_fn`` as ``mod.fn`` through ``handle`` (amp's ``amp.init()`` handle), which puts
    the original back when it is deactivated (``amp.deactivate()``)."""
    if isinstance(mod, dict):
        raise TypeError(f"set_func_save patches attributes; {fn!r} is a dict entry, which amp's handle "
                        "cannot restore. Patch the object that holds the function instead.")
    handle._save_func(mod, fn, new_fn)


def new_synthesize_flattened_rnn_weights(fp32_weights: Sequence[torch.Tensor], fp16_flat_tensor: torch.Tensor,
                                         rnn_fn: str = "", verbose: bool = False) -> list[torch.Tensor]:
    """fp16 views of ``fp16_flat_tensor`` holding ``fp32_weights`` (one flat fp32 buffer), each at
    its weight's offset there and filled by a copy, so gradients flow back into the fp32 weights."""
    base = fp32_weights[0].data_ptr()
    views = []
    for weight in fp32_weights:
        offset = (weight.data_ptr() - base) // weight.element_size()
        view = fp16_flat_tensor[offset:offset + weight.numel()].view_as(weight)
        view.copy_(weight)
        if verbose:
            print(f"Float->Half ({rnn_fn})")
        views.append(view)
    return views


def synthesize_flattened_rnn_weights(fp32_weights: Sequence[Sequence[torch.Tensor]],
                                     fp16_flat_tensor: torch.Tensor, rnn_fn: str = "",
                                     verbose: bool = False) -> list[list[torch.Tensor]]:
    """``new_synthesize_flattened_rnn_weights`` for weights given per layer (one flat fp32 buffer)."""
    flat = [weight for layer in fp32_weights for weight in layer]
    views = iter(new_synthesize_flattened_rnn_weights(flat, fp16_flat_tensor, rnn_fn, verbose))
    return [[next(views) for _ in layer] for layer in fp32_weights]

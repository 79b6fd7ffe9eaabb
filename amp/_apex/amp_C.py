"""``amp_C`` as Apex-era scripts see it with the drop-in switch on and no NVIDIA Apex installed:
Apex's multi-tensor ops under their names and signatures, run by amp's ops
(``amp.multi_tensor_apply``: amp's built ``amp_C`` kernels where they serve the tensors, else
PyTorch, with the same results), whether or not amp's extension is built.

Scripts such as NVIDIA's BERT pretraining ``import amp_C`` at the top and call
``amp_C.multi_tensor_scale(65536, overflow_buf, [grads, views], scale)`` or
``multi_tensor_l2norm``. An Apex kernel that amp has no version of is still an attribute (scripts
bind some at import), but calling it raises, with what to use instead. The other attributes of
amp's build (``build_info``, ...) are its own.

amp itself is never fooled: ``amp.multi_tensor_apply`` sees ``AMP_APEX_STAND_IN`` and uses
``built``, amp's extension as loaded from its file, or None where none is built.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable, NoReturn

import torch  # before the extension, which links against it

AMP_APEX_STAND_IN = True


def _load_built() -> tuple[ModuleType | None, ImportError | None]:
    """amp's ``amp_C`` as the import system would find it without the switch (this module holds
    the name ``amp_C``), loaded from its file; or why there is none."""
    import importlib.util

    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = None if getattr(finder, "amp_apex_dropin", False) or find_spec is None else find_spec("amp_C", None)
        if spec is not None and spec.loader is not None:
            break
    else:
        return None, ImportError("amp_C is not built (the module of that name is the apex drop-in's "
                                 "stand-in, which serves amp's PyTorch ops)")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        return None, error
    return module, None


built, built_error = _load_built()

# Every op of Apex's amp_C: those amp has are served; for the others, what to use instead.
_INSTEAD = {
    "multi_tensor_scale": None,
    "multi_tensor_sgd": None,
    "multi_tensor_axpby": None,
    "multi_tensor_l2norm": None,
    "multi_tensor_l2norm_mp": None,
    "multi_tensor_l2norm_scale": None,
    "multi_tensor_unscale_l2norm": None,
    "multi_tensor_adam": None,
    "update_scale_hysteresis": None,
    "multi_tensor_lamb": None,
    "multi_tensor_lamb_mp": "an optimizer instead of the raw kernel (amp.optimizers, or torch.optim)",
    "multi_tensor_lamb_stage1_cuda": "an optimizer instead of the raw kernel (amp.optimizers, or torch.optim)",
    "multi_tensor_lamb_stage2_cuda": "an optimizer instead of the raw kernel (amp.optimizers, or torch.optim)",
    "multi_tensor_adam_capturable": "amp_C.multi_tensor_adam, or torch.optim.Adam(capturable=True) under CUDA graphs",
    "multi_tensor_adam_capturable_master": "amp_C.multi_tensor_adam, or torch.optim.Adam(capturable=True) under CUDA graphs",
    "multi_tensor_adagrad": "torch.optim.Adagrad(foreach=True)",
    "multi_tensor_novograd": "an optimizer instead of the raw kernel (torch.optim, or NVIDIA Apex's FusedNovoGrad)",
}


def multi_tensor_l2norm_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Any,
                              scale: float, per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Apex's ``[in, out]``: the L2 norms of ``in`` (as ``multi_tensor_l2norm``) and
    ``out = in * scale``; flags a non-finite norm."""
    from amp import multi_tensor_apply

    # The norm is taken first (out may be in), into its own flag, so a call that the scale refuses
    # changes nothing.
    norm_flag = torch.zeros_like(noop_flag)
    norms = multi_tensor_apply.multi_tensor_l2norm(chunk_size, norm_flag, tensor_lists[:1], per_tensor)
    multi_tensor_apply.multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)
    noop_flag.copy_(noop_flag | norm_flag)
    return norms


def _not_offered(name: str, instead: str) -> Callable[..., NoReturn]:
    def op(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"amp_C.{name} is NVIDIA Apex's kernel, which amp does not have: this amp_C is amp's "
            f"stand-in for Apex's (python -m amp.apex), which has no {name}. Use {instead}.")
    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str) -> Any:
    if name not in _INSTEAD:
        if built is not None and hasattr(built, name):
            return getattr(built, name)
        raise AttributeError(f"module 'amp_C' (amp's stand-in for NVIDIA Apex's) has no attribute {name!r}")
    # Imported here, not above: amp.multi_tensor_apply imports amp_C, i.e. this module.
    from amp import multi_tensor_apply

    op = getattr(multi_tensor_apply, name, None)
    if op is not None:
        return op
    return _not_offered(name, _INSTEAD[name] or "amp.multi_tensor_apply's ops")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_INSTEAD) | set(dir(built) if built is not None else ()))

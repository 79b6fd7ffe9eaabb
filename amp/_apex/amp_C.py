"""``amp_C`` for Apex-era scripts where no extension is built (the drop-in switch on, no NVIDIA
Apex installed): Apex's multi-tensor ops under their names and signatures, run by amp's ops
(``amp.multi_tensor_apply``, which take PyTorch's path here: same results, slower).

Scripts such as NVIDIA's BERT pretraining ``import amp_C`` at the top and call
``amp_C.multi_tensor_scale(65536, overflow_buf, [grads, views], scale)`` or
``multi_tensor_l2norm``. An Apex kernel that amp has no version of is still an attribute (scripts
bind some at import), but calling it raises, with what to use instead.

amp itself is never fooled: ``amp.multi_tensor_apply`` sees ``AMP_APEX_STAND_IN`` and reports
``amp_C`` as not built (``MultiTensorApply.available`` is False).
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn

import torch

AMP_APEX_STAND_IN = True

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
    "multi_tensor_lamb": "an optimizer instead of the raw kernel (amp.optimizers, or torch.optim)",
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
            f"amp_C.{name} is NVIDIA Apex's kernel, and no amp_C is built here: this amp_C is "
            f"amp's stand-in (python -m amp.apex), which has no {name}. Use {instead}.")
    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str) -> Callable[..., Any]:
    if name not in _INSTEAD:
        raise AttributeError(f"module 'amp_C' (amp's stand-in for NVIDIA Apex's) has no attribute {name!r}")
    # Imported here, not above: amp.multi_tensor_apply imports amp_C, i.e. this module.
    from amp import multi_tensor_apply

    op = getattr(multi_tensor_apply, name, None)
    if op is not None:
        return op
    return _not_offered(name, _INSTEAD[name] or "amp.multi_tensor_apply's ops")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_INSTEAD))

"""The O1/O4 function lists: the only place that says which function runs in which precision.

Each entry is a name looked up on ``torch``, ``torch.Tensor`` or ``torch.nn.functional``.
Names that a PyTorch build lacks are skipped when the patches are installed, so the lists can
name functions that only some versions have.

The bmm family (``bmm``, ``baddbmm``, ``addbmm``) is always low precision. Apex put it on the
fp16 list only when ``torch.version.cuda >= 9.1`` and left it unpatched on CPU and ROCm builds,
so the same model ran batched matmuls in different precisions depending on how PyTorch was
built. Every CUDA version PyTorch 2.x supports is past 9.1, the CPU and ROCm kernels accept fp16
and bf16, and ``torch.autocast`` lists the bmm family as low precision on every backend; so we
do too, and a model behaves the same on a CPU build and a CUDA build.
"""
from __future__ import annotations

from types import ModuleType
from typing import Iterable, Mapping

import torch

__all__ = [
    "TORCH_LOW_PRECISION", "TORCH_BF16_EXCLUDED", "TORCH_FP32", "TORCH_PROMOTE",
    "TORCH_SEQUENCE_PROMOTE", "NATIVE_PROMOTE", "TENSOR_LOW_PRECISION", "TENSOR_FP32", "TENSOR_PROMOTE",
    "FUNCTIONAL_LOW_PRECISION", "FUNCTIONAL_FP32", "FUNCTIONAL_BANNED", "RNN_FUNCTIONS",
    "RNN_CELLS", "Overrides", "overrides",
]

# torch.*
TORCH_LOW_PRECISION = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv",
    "addbmm", "baddbmm", "bmm",
)
# prelu is pointwise, so bf16 buys nothing there; ROCm Apex's bf16 list left it out too.
TORCH_BF16_EXCLUDED = ("prelu",)
# mean is absent on purpose: since torch 1.1 it accumulates in fp32 for half inputs.
TORCH_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum",
    "var", "renorm",
)
TORCH_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul", "eq",
    "equal", "ge", "gt", "le", "lt", "ne",
)
TORCH_SEQUENCE_PROMOTE = ("cat", "stack")
# Promote functions whose kernels already compute in the widest type of their tensor operands
# (torch's type promotion), except that a 0-dim operand does not widen a higher-dim one. For
# these the wrapper skips its explicit cast when no floating operand is 0-dim: same result and
# gradients, one cast and one autograd node fewer (residual adds of fp32 + half activations).
NATIVE_PROMOTE = (
    "add", "div", "mul", "eq", "ge", "gt", "le", "lt", "ne", "atan2",
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__le__", "__lt__", "__mul__", "__ne__",
    "__radd__", "__rdiv__", "__rmul__", "__rsub__", "__rtruediv__", "__sub__", "__truediv__",
)

# torch.Tensor methods, on top of the torch.* names that also exist as methods.
TENSOR_LOW_PRECISION = ("__matmul__",)
# cpu is listed so that data is widened to fp32 before it leaves the device.
TENSOR_FP32 = ("__ipow__", "__pow__", "__rpow__", "cpu")
TENSOR_PROMOTE = (
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__",
    "__isub__", "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__",
    "__rmul__", "__rsub__", "__rtruediv__", "__sub__", "__truediv__",
)

# torch.nn.functional.*
# scaled_dot_product_attention came after Apex; torch.autocast runs it in low precision, and so do
# we. Left unpatched, MultiheadAttention under O1/O4 hands it the low-precision q/k/v of its
# patched projections with a float mask made in its fp32 input's dtype, which torch < 2.4 refuses.
FUNCTIONAL_LOW_PRECISION = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "linear", "scaled_dot_product_attention",
)
FUNCTIONAL_FP32 = (
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss",
    "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss", "ctc_loss",
)
FUNCTIONAL_BANNED = {
    "binary_cross_entropy": (
        "amp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss`: "
        "a sigmoid followed by a log in low precision loses too much accuracy. Use "
        "`torch.nn.BCEWithLogitsLoss` / `F.binary_cross_entropy_with_logits`, which fuse the two "
        "safely; or call `amp.register_float_function(torch, 'sigmoid')` before "
        "`amp.initialize` to run the sigmoid in fp32; or, if you are sure the inputs are safe, "
        "pass `allow_banned=True` to `amp.init()` to run this function in fp32."
    ),
}

# Entry points that torch.nn.modules.rnn calls through its module global `_VF`.
RNN_FUNCTIONS = ("rnn_tanh", "rnn_relu", "gru", "lstm")
RNN_CELLS = ("rnn_tanh_cell", "rnn_relu_cell", "lstm_cell", "gru_cell")


class Overrides:
    """The lists resolved against one module: what to patch there and how."""

    def __init__(self, module: ModuleType | type, low_precision: Iterable[str], fp32: Iterable[str],
                 promote: Iterable[str] = (), sequence_promote: Iterable[str] = (),
                 banned: Mapping[str, str] | None = None) -> None:
        self.module = module
        self.low_precision = _present(module, low_precision)
        self.fp32 = _present(module, fp32)
        self.promote = _present(module, promote)
        self.sequence_promote = _present(module, sequence_promote)
        self.banned = {n: m for n, m in (banned or {}).items() if hasattr(module, n)}


def _present(module: ModuleType | type, names: Iterable[str]) -> tuple[str, ...]:
    # Order-preserving and duplicate-free, so each name is wrapped exactly once per list.
    return tuple(dict.fromkeys(n for n in names if hasattr(module, n)))


def overrides(patch_type: torch.dtype) -> tuple[Overrides, Overrides, Overrides]:
    """The resolved lists for ``torch.nn.functional``, ``torch`` and ``torch.Tensor``.

    ``patch_type`` (torch.float16 or torch.bfloat16) picks the low-precision list.
    """
    torch_low: tuple[str, ...] = TORCH_LOW_PRECISION
    if patch_type is torch.bfloat16:
        torch_low = tuple(n for n in torch_low if n not in TORCH_BF16_EXCLUDED)
    functional = torch.nn.functional
    return (
        Overrides(functional, FUNCTIONAL_LOW_PRECISION, FUNCTIONAL_FP32,
                  banned=FUNCTIONAL_BANNED),
        Overrides(torch, torch_low, TORCH_FP32, TORCH_PROMOTE, TORCH_SEQUENCE_PROMOTE),
        Overrides(torch.Tensor, TENSOR_LOW_PRECISION + torch_low, TENSOR_FP32 + TORCH_FP32,
                  TENSOR_PROMOTE + TORCH_PROMOTE),
    )

"""Pure-PyTorch implementations of the ``amp_C`` multi-tensor ops.

These run wherever PyTorch runs and are what ``amp.multi_tensor_apply`` uses when the ``amp_C``
extension is not built (or does not serve the tensors' device). Each op is a handful of
``torch._foreach_*`` / ``torch._amp_foreach_non_finite_check_and_unscale_`` calls over the whole
list, never a Python loop over elements; the fused optimizer steps, whose exact fp32 arithmetic
takes a few dozen tensor operations, work through each tensor in cache-sized slices instead.
``chunk_size`` has no launches to cut here, but is checked as ``amp_C`` checks it.

One module per family, as ``torch.optim.adam`` splits its math: ``scale``, ``axpby``, ``l2norm``
(three ops), ``scale_update`` (``update_scale_hysteresis``), ``sgd``, ``adam`` and ``lamb``. What they share:
``contract`` (the arguments every op accepts, checked in one order, the same as amp_C's; its
coefficient rules in ``contract_coefficients``),
``storage`` (elements in storage order, fp32 workspaces, the flag) and ``exact`` (the fused steps'
exact fp32 arithmetic: a software fma, slices, scratch buffers).

The compiled kernels must give these ops' bits (the l2norm family: within a tolerance, as it sums
in another order); each family's module says how it rounds. Common to all: a Python-float
coefficient is first rounded to fp32 (round to nearest even), exactly as a C++ ``float`` parameter
receives it; a tensor coefficient is already a 1-element fp32 tensor.

Overflow flag: ``noop_flag`` is a 1-element int32 or fp32 tensor on the tensors' device. Ops only
ever set it to 1, never clear it. ``multi_tensor_scale`` and ``multi_tensor_axpby`` set it when a
checked *input* element is inf or NaN (an overflow created by the multiply is not detected); the
norm ops set it when the fp32 sum of squares is not finite; the fused steps write nothing when it
is set (and adam sets it for a device step out of range).
"""
from .adam import multi_tensor_adam
from .axpby import multi_tensor_axpby
from .lamb import multi_tensor_lamb
from .l2norm import multi_tensor_l2norm, multi_tensor_l2norm_mp, multi_tensor_unscale_l2norm
from .scale import multi_tensor_scale
from .scale_update import update_scale_hysteresis
from .sgd import multi_tensor_sgd

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
    "multi_tensor_sgd",
    "multi_tensor_adam",
    "multi_tensor_lamb",
]

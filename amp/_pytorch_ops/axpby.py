"""``multi_tensor_axpby``: ``out = a * float(x) + b * float(y)``, flagging non-finite inputs.

Bits: ``ax = a * (float)x`` and ``by = b * (float)y`` are each rounded to fp32 *before* the fp32
add, and the sum is rounded once to the output dtype. No fused multiply-add: the kernels use
rounding intrinsics (CUDA) or ``-ffp-contract=off`` (C++).
"""
import torch

from . import contract, contract_coefficients
from .storage import flat, flag_buffer, fp32_copies, merge_flag, scale_


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``out = a*float(x) + b*float(y)`` for ``tensor_lists = [x, y, out]``.

    ``arg_to_check``: -1 flags non-finite values in x and y, 0 only in x, 1 only in y, any other
    int checks nothing.
    """
    op = "multi_tensor_axpby"
    names = contract.check_call(op, chunk_size, noop_flag, tensor_lists, (("x", "y", "out"),))
    arg_to_check = contract.integer(op, "arg_to_check", arg_to_check)
    device = contract.check_tensors(op, chunk_size, tensor_lists, names)
    if device is None:
        return
    contract.check_outputs(op, noop_flag, device, tensor_lists, names)
    a = contract_coefficients.fp32_scalar(op, "a", a, device)
    b = contract_coefficients.fp32_scalar(op, "b", b, device)
    xs, ys, outs = ([flat(t) for t in tensors] for tensors in tensor_lists)
    found = flag_buffer(noop_flag)
    out_is_fp32 = tensor_lists[2][0].dtype == torch.float32
    with torch.no_grad():
        # b*y goes into a private buffer first, so an output aliasing y is read before it is written.
        by = fp32_copies(ys)
        scale_(by, b, found if arg_to_check in (-1, 1) else None)
        if out_is_fp32:
            torch._foreach_copy_(outs, xs)
            ax = outs
        else:
            ax = fp32_copies(xs)
        scale_(ax, a, found if arg_to_check in (-1, 0) else None)
        torch._foreach_add_(ax, by)
        if not out_is_fp32:
            torch._foreach_copy_(outs, ax)
    merge_flag(noop_flag, found)

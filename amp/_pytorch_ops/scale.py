"""``multi_tensor_scale``: ``out = float(in) * scale``, flagging non-finite inputs.

Bits: one fp32 multiply, rounded once to the output dtype, ``out = (out_t)((float)in * scale)``.
Only a non-finite input sets the flag; an overflow that the multiply creates does not (Apex's rule).
"""
import torch

from . import contract, contract_coefficients
from .storage import fp32_copies, flag_buffer, merge_flag, paired_views, scale_


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out = float(in) * scale`` for ``tensor_lists = [in, out]``; flags non-finite inputs."""
    op = "multi_tensor_scale"
    names = contract.check_call(op, chunk_size, noop_flag, tensor_lists, (("in", "out"),))
    device = contract.check_tensors(op, chunk_size, tensor_lists, names)
    if device is None:
        return
    contract.check_outputs(op, noop_flag, device, tensor_lists, names)
    scale = contract_coefficients.fp32_scalar(op, "scale", scale, device)
    ins, outs = paired_views(tensor_lists[0], tensor_lists[1])
    found = flag_buffer(noop_flag)
    with torch.no_grad():
        if tensor_lists[1][0].dtype == torch.float32:
            # Widening into an fp32 output is exact, so the output can be the fp32 workspace.
            if outs is not ins:
                torch._foreach_copy_(outs, ins)
            scale_(outs, scale, found)
        else:
            work = fp32_copies(ins)
            scale_(work, scale, found)
            torch._foreach_copy_(outs, work)
    merge_flag(noop_flag, found)

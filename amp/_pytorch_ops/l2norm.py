"""The l2norm family: the L2 norm of a list of tensors, and of each one.

``multi_tensor_l2norm`` as Apex's; ``multi_tensor_l2norm_mp`` returns zeros when the flag is
already set; ``multi_tensor_unscale_l2norm`` takes the norm of the values times ``inv_scale``.

Bits: these sum squares in another order than a chunked kernel, so they agree with the kernels
within a tolerance, not bit for bit. The sum of squares is an fp32 value on every path, as in
Apex's CUDA kernel: where a tensor's sum of squares (or the total) exceeds fp32's range its norm
(or the total) is inf, even when the norm itself would fit (any norm above sqrt(FLT_MAX), about
1.84e19), and an inf total sets the flag. So every path agrees on finiteness and on the flag.
"""
import torch

from .._compat import foreach_norm
from . import contract, contract_coefficients
from .storage import flat, fp32_copies


def _norms(op, chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor, skip_if_flagged):
    """The body of the family: (total [1], per-tensor [n] or [0]), both fp32."""
    names = contract.check_call(op, chunk_size, noop_flag, tensor_lists, (("x",),))
    device = contract.check_tensors(op, chunk_size, tensor_lists, names, chunks_in_all=True)
    if device is None:
        empty = torch.zeros(0, dtype=torch.float32, device=noop_flag.device)
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), empty
    contract.check_writes(op, noop_flag, device, tensor_lists, names, first_written=1)
    if inv_scale is not None:
        inv_scale = contract_coefficients.fp32_scalar(op, "inv_scale", inv_scale, device)
    xs = [flat(t) for t in tensor_lists[0]]
    with torch.no_grad():
        if inv_scale is not None:
            xs = fp32_copies(xs)
            torch._foreach_mul_(xs, inv_scale)
        norms = torch.stack(foreach_norm(xs, 2, dtype=torch.float32))
        total = torch.linalg.vector_norm(norms).reshape(1)
        # torch may accumulate in fp64 (it does on CPU); the sums of squares must fit in fp32.
        sums = norms.double().square()
        inf = torch.full((), float("inf"), dtype=torch.float32, device=device)
        norms = torch.where(sums.float().isinf(), inf, norms)
        total = torch.where(sums.sum().float().isinf(), inf, total)
        if skip_if_flagged:
            # Decided on the device: reading the flag on the host would synchronise.
            already_flagged = (noop_flag != 0).view(1)
            total = total.masked_fill(already_flagged, 0)
            norms = norms.masked_fill(already_flagged, 0)
        noop_flag.masked_fill_((~torch.isfinite(total)).view(noop_flag.shape), 1)
    if not per_tensor:
        norms = torch.zeros(0, dtype=torch.float32, device=device)
    return total, norms


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """L2 norm of all tensors of ``tensor_lists = [x]`` together, and of each one when ``per_tensor``."""
    return _norms("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, None, per_tensor,
                  False)


def multi_tensor_l2norm_mp(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """Like ``multi_tensor_l2norm``, but returns zeros when ``noop_flag`` was already set."""
    return _norms("multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, None, per_tensor,
                  True)


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """L2 norm of ``x * inv_scale`` without modifying x."""
    return _norms("multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, inv_scale,
                  per_tensor, False)

"""What the ops share besides the contract: views in storage order, fp32 workspaces, the flag,
and where a value can be read on the host.

The compiled kernels walk each tensor's storage, so the ops here pair elements in storage order
too; the contract has made sure that the tensors of one index store their elements alike.
"""
import torch

from .._compat import non_finite_check_and_unscale_


def read_on_host(device):
    """Whether a value on ``device`` can be read without waiting for the device: the CPU's."""
    return device.type == "cpu"


def flat(t):
    """A 1-D view of ``t`` in storage order, whatever its (dense) layout."""
    return t.as_strided((t.numel(),), (1,))


def paired_views(ins, outs):
    """``(ins, outs)`` as lists whose elements pair up in storage order, as the kernels walk them.

    In place (every output is its input) the lists serve as they are, and ``outs is ins`` tells
    the caller so; equal shapes and strides need no views either; other layouts are flattened.
    """
    if all(o is i for i, o in zip(ins, outs)):
        ins = list(ins)
        return ins, ins
    if all(i.shape == o.shape and i.stride() == o.stride() for i, o in zip(ins, outs)):
        return list(ins), list(outs)
    return [flat(t) for t in ins], [flat(t) for t in outs]


def fp32_copies(tensors):
    return [t.to(torch.float32, copy=True) for t in tensors]


def scale_(fp32_tensors, scale, found):
    """Multiply in place by ``scale``; with ``found``, also flag non-finite values (checked first)."""
    if found is None:
        torch._foreach_mul_(fp32_tensors, scale)
    else:
        non_finite_check_and_unscale_(fp32_tensors, found, scale)


def flag_buffer(noop_flag):
    """Where the fused check writes 1.0: a float32 flag itself, an int32 one a float32 stand-in."""
    if noop_flag.dtype == torch.float32:
        return noop_flag
    return torch.zeros(1, dtype=torch.float32, device=noop_flag.device)


def merge_flag(noop_flag, found):
    """Set ``noop_flag`` where its stand-in ``found`` (from ``flag_buffer``) was set."""
    if found is not noop_flag:
        noop_flag.masked_fill_((found > 0).view(noop_flag.shape), 1)

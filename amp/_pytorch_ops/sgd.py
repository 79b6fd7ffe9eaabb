"""``multi_tensor_sgd``: Apex's fused SGD step, with torch.optim.SGD's fp32 arithmetic."""
import torch

from . import contract, contract_coefficients, exact, remainder
from .storage import flat

_LISTS = (("grads", "weights", "momentum_bufs"),
          ("grads", "weights", "momentum_bufs", "model_copies"),
          ("grads", "weights", "momentum_bufs", "remainders"))


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov,
                     first_run, wd_after_momentum, scale):
    """One SGD step over ``[grads, weights, momentum_bufs]`` or ``[grads, weights, momentum_bufs,
    model_copies]``, Apex's ``multi_tensor_sgd``, or ``[grads, bf16 weights, momentum_bufs,
    remainders]`` (the masters rebuilt, stepped and split back: ``remainder.py``); nothing is
    written when ``noop_flag`` is set.

    Per element, in fp32; ``fma`` rounds once, every other operation rounds to fp32; ``wd``,
    ``momentum``, ``lr`` and ``scale`` are fp32, ``dc = fp32(1 - dampening)`` (computed in fp64)::

        g = float(grad) * scale
        w = float(weight)
        if wd != 0 and not wd_after_momentum: g = fma(wd, w, g)       # wd, momentum: as fp32
        if momentum != 0:
            buf = g if first_run else fma(dc, g, buf * momentum)
            g = fma(momentum, buf, g) if nesterov else buf
        if wd != 0 and wd_after_momentum: g = fma(wd, w, g)
        w = fma(-lr, g, w)
        weight = w; momentum_buf = buf (untouched when momentum == 0); model_copy = w rounded

    That is torch.optim.SGD's arithmetic on CPU (``foreach=False``), so with fp32 grads, scale 1
    and ``wd_after_momentum=False`` the two give the same bits. ``scale`` is a Python float or a
    1-element fp32 tensor on the tensors' device (or the CPU); the other coefficients are host
    floats.
    """
    op = "multi_tensor_sgd"
    names = contract.check_call(op, chunk_size, noop_flag, tensor_lists, _LISTS)
    wd, momentum, dampening, lr = (contract.real(op, name, value) for name, value in (
        ("wd", wd), ("momentum", momentum), ("dampening", dampening), ("lr", lr)))
    device = contract.check_fused_tensors(op, chunk_size, noop_flag, tensor_lists, names)
    if device is None:
        return
    scale = contract_coefficients.fp32_scalar(op, "scale", scale, device)
    wd_t, momentum_t, dc_t, neg_lr_t = (exact.fp32(v, device)
                                        for v in (wd, momentum, 1.0 - dampening, -lr))
    wd, momentum, dc = exact.host_fp32(wd), exact.host_fp32(momentum), exact.host_fp32(1.0 - dampening)
    tools = exact.step_tools(noop_flag, device)
    if tools is None:
        return
    fma, keep_old = tools

    def update(lists):
        scratch, pieces = exact.slices(lists, device)
        for grad, weight, buf, *copy in pieces:
            g = exact.fp32_product(scratch, "g", grad, scale)
            w = exact.widened(scratch, "w", weight)
            if wd != 0 and not wd_after_momentum:
                g = fma(wd_t, w, g, scratch, "g.wd")
            if momentum != 0:
                if first_run:
                    b = g
                else:
                    b = exact.fp32_product(scratch, "b", buf, momentum_t)
                    # fma(1, g, b) is g + b rounded once: an fp32 add.
                    b = b.add_(g) if dc == 1 else fma(dc_t, g, b, scratch, "b.dc")
                g = fma(momentum_t, b, g, scratch, "g.nesterov") if nesterov else b
            if wd != 0 and wd_after_momentum:
                g = fma(wd_t, w, g, scratch, "g.wd_after")
            w = fma(neg_lr_t, g, w, scratch, "w.new")
            exact.store(keep_old, scratch, weight, w)
            if momentum != 0:
                exact.store(keep_old, scratch, buf, b)
            if copy:
                exact.store(keep_old, scratch, copy[0], w)

    with torch.no_grad():
        remainder.each_tensor_if_remainders(names, [[flat(t) for t in tensors] for tensors in tensor_lists],
                                            keep_old, update)

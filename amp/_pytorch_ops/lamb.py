"""``multi_tensor_lamb``: Apex's fused LAMB step, in Apex's fp32 arithmetic."""
import torch

from . import contract, contract_coefficients, exact
from .adam import power_of_step
from .storage import flat

_LISTS = (("grads", "params", "exp_avgs", "exp_avg_sqs"),
          ("grads", "params", "exp_avgs", "exp_avg_sqs", "model_copies"))


def multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                      bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
                      max_grad_norm, use_nvlamb=None, inv_scale=1.0):
    """One LAMB step (You et al., "Large Batch Optimization for Deep Learning") over ``[grads,
    params, exp_avgs, exp_avg_sqs]`` or ``[..., model_copies]``, Apex's ``multi_tensor_lamb``;
    nothing is written when ``noop_flag`` is set.

    ``step`` is the step number after this update, a Python int from 1 to 2**31 - 1.
    ``global_grad_norm`` (a float or a 1-element fp32 tensor) is the norm of every gradient the
    optimizer steps, unscaled; where it exceeds ``max_grad_norm`` the gradients are divided by
    their ratio (``clip``). Once per call: ``bc1 = fp32(1 - beta1 ** step)``, ``bc2`` likewise
    (``power_of_step`` in fp64; 1 without ``bias_correction``), ``beta3 = fp32(1 - beta1)`` with
    ``grad_averaging`` else 1, ``w2 = fp32(1 - beta2)``. Per element, in fp32, every operation
    rounded on its own, in Apex's order (stage 1)::

        g = float(grad) * inv_scale / clip
        if mode == 0 and wd != 0: g = g + wd * p
        m = m * beta1 + beta3 * g
        v = v * beta2 + (w2 * g) * g
        update = (m / bc1) / (sqrt(v / bc2) + eps)
        if mode == 1 and wd != 0: update = update + wd * p

    Then, per tensor, Apex's trust ratio: ``ratio = lr * (norm(param) / norm(update))`` (fp32)
    where ``wd != 0`` or ``use_nvlamb`` and both norms are nonzero, else ``lr``; and per element
    (stage 2) ``param = p - ratio * update``, with the model copy its rounding. The norms are
    ``torch.linalg.vector_norm(..., dtype=torch.float32)`` of each tensor in storage order, the
    op ``amp_C`` calls too, so both paths give the same bits on a device. Unlike Apex's kernel,
    the updates go to a scratch tensor (4 bytes per element for the call), not into the grads.
    """
    op = "multi_tensor_lamb"
    names = contract.check_call(op, chunk_size, noop_flag, tensor_lists, _LISTS)
    lr, beta1, beta2, epsilon = (contract.real(op, name, value) for name, value in (
        ("lr", lr), ("beta1", beta1), ("beta2", beta2), ("epsilon", epsilon)))
    step = contract_coefficients.step_number(op, step)
    bias_correction = contract.switch(op, "bias_correction", bias_correction)
    weight_decay = contract.real(op, "weight_decay", weight_decay)
    grad_averaging = contract.switch(op, "grad_averaging", grad_averaging)
    contract.check_adam_mode(op, mode)
    max_grad_norm = contract.real(op, "max_grad_norm", max_grad_norm)
    use_nvlamb = use_nvlamb is not None and contract.switch(op, "use_nvlamb", use_nvlamb)
    device = contract.check_fused_tensors(op, chunk_size, noop_flag, tensor_lists, names)
    if device is None:
        return
    global_grad_norm = contract_coefficients.fp32_scalar(op, "global_grad_norm", global_grad_norm, device)
    inv_scale = contract_coefficients.fp32_scalar(op, "inv_scale", inv_scale, device)
    tools = exact.step_tools(noop_flag, device)
    if tools is None:
        return
    _, keep_old = tools
    grads, params, exp_avgs, exp_avg_sqs = ([flat(t) for t in tensors] for tensors in tensor_lists[:4])
    copies = [flat(t) for t in tensor_lists[4]] if len(tensor_lists) == 5 else None
    wd = exact.host_fp32(weight_decay)
    c = {name: exact.fp32(value, device) for name, value in (
        ("beta1", beta1), ("beta2", beta2), ("w2", 1.0 - beta2), ("eps", epsilon), ("wd", weight_decay),
        ("beta3", 1.0 - beta1 if grad_averaging else 1.0), ("max", max_grad_norm),
        ("bc1", 1.0), ("bc2", 1.0))}
    with torch.no_grad():
        if bias_correction:  # fp32(1 - beta ** step), the power in fp64 as the kernels take it
            step_t = torch.full((), step, dtype=torch.int64, device=device)
            c["bc1"], c["bc2"] = ((1.0 - power_of_step(beta, step_t)).float() for beta in (beta1, beta2))
        gn = global_grad_norm
        clip = torch.where(gn > c["max"], gn / c["max"], torch.ones_like(gn))
        updates = torch.empty(sum(t.numel() for t in grads), dtype=torch.float32, device=device)
        update_views, begin = [], 0
        for grad, param, exp_avg, exp_avg_sq in zip(grads, params, exp_avgs, exp_avg_sqs):
            update = updates[begin:begin + grad.numel()]
            begin += grad.numel()
            update_views.append(update)
            p = param.float()
            g = _fp32_copy(grad).mul_(inv_scale).div_(clip)
            if mode == 0 and wd != 0:
                g.add_(c["wd"] * p)
            m = _fp32_copy(exp_avg).mul_(c["beta1"]).add_(g * c["beta3"])
            v = _fp32_copy(exp_avg_sq).mul_(c["beta2"]).add_((c["w2"] * g).mul_(g))
            # torch.sqrt of fp32 is not correctly rounded on every CPU build; fp64's, rounded, is.
            denom = (v / c["bc2"]).double().sqrt_().float().add_(c["eps"])
            torch.div(m / c["bc1"], denom, out=update)
            if mode == 1 and wd != 0:
                update.add_(c["wd"] * p)
            exact.store(keep_old, None, exp_avg, m)
            exact.store(keep_old, None, exp_avg_sq, v)
        ratios = torch.full((len(grads),), lr, dtype=torch.float32, device=device)
        if use_nvlamb or wd != 0:  # Apex's rule: the trust ratio where decayed (or NVLAMB)
            param_norms = _norms(params)
            update_norms = _norms(update_views)
            trusted = param_norms.ne(0).logical_and(update_norms.ne(0))
            ratios = torch.where(trusted, param_norms.div(update_norms).mul(ratios), ratios)
        for index, (param, update) in enumerate(zip(params, update_views)):
            p = _fp32_copy(param).sub_(update * ratios[index])
            exact.store(keep_old, None, param, p)
            if copies is not None:
                exact.store(keep_old, None, copies[index], p)


def _fp32_copy(t):
    return t.to(torch.float32, copy=True)


def _norms(tensors):
    """Each tensor's L2 norm in fp32, by the op amp_C's binding calls (same bits on a device)."""
    return torch.stack([torch.linalg.vector_norm(flat(t), 2, dtype=torch.float32) for t in tensors])

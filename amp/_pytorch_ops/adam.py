"""``multi_tensor_adam``: Apex's fused Adam/AdamW step, with torch.optim.Adam's fp32 arithmetic."""
import torch

from . import contract, contract_coefficients, exact, remainder
from .storage import flat

_LISTS = (("grads", "params", "exp_avgs", "exp_avg_sqs"),
          ("grads", "params", "exp_avgs", "exp_avg_sqs", "model_copies"),
          ("grads", "weights", "exp_avgs", "exp_avg_sqs", "remainders"))


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
                      bias_correction, weight_decay, inv_scale=1.0):
    """One Adam (``mode`` 0, L2 weight decay) or AdamW (``mode`` 1, decoupled) step over ``[grads,
    params, exp_avgs, exp_avg_sqs]`` or ``[..., model_copies]``; nothing is written when
    ``noop_flag`` is set.

    ``step`` is the step number after this update, a whole number from 1 to 2**31 - 1: a Python
    int, or a 1-element int32/int64/float32 tensor on the tensors' device (so it can stay there).
    A step out of that range is refused, except in a tensor on a device other than the CPU, whose
    value is not read on the host: there the call is a skipped step that sets ``noop_flag``
    (contract rule 9). Once per call, in fp64
    (``pow`` = :func:`power_of_step`, identical for an int and a tensor)::

        step_size = fp32(lr / (1 - pow(beta1, step)))   or fp32(lr) without bias_correction
        bc2_sqrt = fp32(sqrt(1 - pow(beta2, step)))     or 1 without bias_correction

    Per element, in fp32; ``fma`` rounds once, every other operation rounds to fp32; ``wd``,
    ``beta2``, ``eps`` are fp32; ``w1 = fp32(1 - beta1)``, ``w2 = fp32(1 - beta2)`` and
    ``decay = fp32(1 - lr * weight_decay)`` are computed in fp64 and rounded once, ``w1 - 1`` in
    fp32 (exact)::

        g = float(grad) * inv_scale
        p = float(param)
        if mode == 0 and wd != 0: g = fma(wd, p, g)
        if mode == 1 and wd != 0: p = p * decay
        m = fma(w1, g - m, m) if |w1| < 0.5 else fma(w1 - 1, g - m, g)     # torch's lerp
        v = fma(w2 * g, g, v * beta2)                                       # torch's addcmul
        denom = sqrt(v) / bc2_sqrt + eps
        p = p + (-step_size * m) / denom                                    # torch's addcdiv
        param = p; exp_avg = m; exp_avg_sq = v; model_copy = p rounded

    ``sqrt`` is the correctly rounded fp32 square root (IEEE, as CUDA's ``__fsqrt_rn``). That is
    torch.optim.Adam / AdamW's arithmetic (``foreach=False``), but torch's CPU ``sqrt`` (MKL) is
    not correctly rounded, so where it is off by an ulp ``denom`` differs by one ulp and the
    parameters drift apart by a few ulps (tests/test_fused_ops.py gives torch a correctly rounded
    ``sqrt`` and compares bit for bit); torch's libm ``beta ** step`` may also differ from the
    power above in the last fp64 bit.
    """
    op = "multi_tensor_adam"
    names = contract.check_call(op, chunk_size, noop_flag, tensor_lists, _LISTS)
    lr, beta1, beta2, epsilon = (contract.real(op, name, value) for name, value in (
        ("lr", lr), ("beta1", beta1), ("beta2", beta2), ("epsilon", epsilon)))
    contract.check_adam_mode(op, mode)
    bias_correction = contract.switch(op, "bias_correction", bias_correction)
    weight_decay = contract.real(op, "weight_decay", weight_decay)
    device = contract.check_fused_tensors(op, chunk_size, noop_flag, tensor_lists, names)
    if device is None:
        return
    step, step_in_range = contract_coefficients.adam_step(op, step, device)
    inv_scale = contract_coefficients.fp32_scalar(op, "inv_scale", inv_scale, device)
    tools = exact.step_tools(noop_flag, device)
    if tools is None:
        return
    fma, keep_old = tools
    if step_in_range is not None:  # a device's step out of range: a skipped step, flagged
        keep_old = keep_old | ~step_in_range
        noop_flag.masked_fill_(~step_in_range, 1)
    with torch.no_grad():
        step_size, bc2_sqrt = _step_factors(lr, beta1, beta2, step, bias_correction, device)
        w1_host = exact.host_fp32(1.0 - beta1)
        w1, w1_minus_1 = exact.fp32(w1_host, device), exact.fp32(w1_host - 1.0, device)
        small_w1 = abs(w1_host) < 0.5
        wd_t, beta2_t, w2, eps_t, decay = (exact.fp32(v, device) for v in (
            weight_decay, beta2, 1.0 - beta2, epsilon, 1.0 - lr * weight_decay))
        neg_step_size = -step_size
        weight_decay = exact.host_fp32(weight_decay)

    def update(lists):
        scratch, pieces = exact.slices(lists, device)
        for grad, param, exp_avg, exp_avg_sq, *copy in pieces:
            n = grad.numel()
            g = exact.fp32_product(scratch, "g", grad, inv_scale)
            p = exact.widened(scratch, "p", param)
            if weight_decay != 0:
                if mode == 0:
                    g = fma(wd_t, p, g, scratch, "g.wd")
                else:
                    p = torch.mul(p, decay, out=scratch("p.decay", torch.float32, n))
            m = exact.widened(scratch, "m", exp_avg)
            diff = torch.sub(g, m, out=scratch("diff", torch.float32, n))
            if small_w1:
                m = fma(w1, diff, m, scratch, "m.new")
            else:
                m = fma(w1_minus_1, diff, g, scratch, "m.new")
            v = fma(torch.mul(g, w2, out=scratch("w2g", torch.float32, n)), g,
                    exact.fp32_product(scratch, "v", exp_avg_sq, beta2_t), scratch, "v.new")
            # torch.sqrt of fp32 is not correctly rounded on every CPU build (MKL's is not); the
            # fp64 square root rounded to fp32 is (53 >= 2 * 24 + 2 bits).
            denom = scratch("denom.fp64", torch.float64, n).copy_(v).sqrt_()
            denom = scratch("denom", torch.float32, n).copy_(denom).div_(bc2_sqrt).add_(eps_t)
            # p + (-step_size * m) / denom (an IEEE sum is the same either way round)
            update = torch.mul(m, neg_step_size, out=scratch("p.new", torch.float32, n))
            p = update.div_(denom).add_(p)
            exact.store(keep_old, scratch, param, p)
            exact.store(keep_old, scratch, exp_avg, m)
            exact.store(keep_old, scratch, exp_avg_sq, v)
            if copy:
                exact.store(keep_old, scratch, copy[0], p)

    with torch.no_grad():
        remainder.each_tensor_if_remainders(names, [[flat(t) for t in tensors] for tensors in tensor_lists], keep_old, update)


def _step_factors(lr, beta1, beta2, step, bias_correction, device):
    """``(step_size, bc2_sqrt)``, the per-call factors of the bias corrections, as 0-dim fp32
    tensors on ``device``: computed there in fp64 from the step, a 0-dim int64 tensor."""
    if not bias_correction:
        return exact.fp32(lr, device), exact.fp32(1.0, device)
    # A tensor divisor, not ``lr / tensor`` (which torch computes as lr * reciprocal).
    lr64 = torch.full((), lr, dtype=torch.float64, device=device)
    step_size = (lr64 / (1.0 - power_of_step(beta1, step))).float()
    bc2_sqrt = torch.sqrt(1.0 - power_of_step(beta2, step)).float()
    return step_size, bc2_sqrt


def power_of_step(base, step):
    """``base ** step`` in fp64 with a fixed rounding that C++ and CUDA reproduce exactly.

    ``base ** 2**k`` by repeated squaring for k = 0..30, the factors of the step's set bits (1.0
    for the others) multiplied pairwise: (f0*f1)*(f2*f3)... over five levels. Only IEEE fp64
    multiplies, so every platform gives the same bits (a libm ``pow`` does not).
    """
    powers = [base]
    for _ in range(31):
        powers.append(powers[-1] * powers[-1])
    bits = torch.arange(32, device=step.device)
    set_bits = ((step >> bits) & 1).bool() & (bits < 31)
    factors = torch.where(set_bits, torch.tensor(powers, dtype=torch.float64, device=step.device),
                          torch.ones((), dtype=torch.float64, device=step.device))
    while factors.numel() > 1:
        factors = factors[0::2] * factors[1::2]
    return factors.reshape(())

"""Exact fp32 arithmetic for the fused optimizer steps, on any device, with torch operations.

``multi_tensor_sgd`` and ``multi_tensor_adam`` update fp32 (or low-precision) weights and optimizer
state in one pass from the model's grads, unscaling them on the way, and write the low-precision
model copy. Per element everything is computed in fp32 and stored rounded to the destination dtype.
Unlike axpby, they use a fused multiply-add (``fma``: one rounding) exactly where torch.optim's CPU
kernels do (``add(alpha=)``, ``lerp``, ``addcmul``), so that they give torch.optim's bits; every
other operation is rounded to fp32 on its own. Host floats are rounded to fp32 as a C++ ``float``
parameter would be; a coefficient derived from host floats (``1 - dampening``,
``1 - lr * weight_decay``...) is computed in fp64 first and rounded once, as Python computes it
before torch.optim hands it to a kernel.

Here: the software ``fma`` (torch has none), the cache-sized slices the steps walk and their
scratch buffers, the rounding of host numbers to fp32, and the noop flag's effect on a step.
"""
import torch

from . import storage


def fp32(value, device):
    """A host number rounded to fp32, as a 0-dim tensor on ``device``."""
    return torch.full((), value, dtype=torch.float32, device=device)


def host_fp32(value):
    """What a C++ ``float`` parameter holds: the kernels test it (``wd != 0``...) after the rounding."""
    return torch.tensor(value, dtype=torch.float32).item()


# Elements per slice in the fused optimizers below. On the CPU each tensor is updated one slice of
# its flat view at a time, so that the temporaries (fp64 ones in ``fma``) stay in the caches
# instead of streaming through memory; on a GPU a slice only bounds the temporaries' memory (a
# small one would cost a kernel launch per operation for little work).
CPU_SLICE = 131072
DEVICE_SLICE = 2**20


class Scratch:
    """The temporaries of one fused step: a buffer per name, reused from slice to slice as the
    ``out`` of each operation (the CPU allocator would otherwise map, and the kernel fault in,
    fresh pages for most of them). ``scratch(name, dtype, n)`` is that buffer's first ``n``
    elements; a name always has the same dtype."""

    def __init__(self, device, size):
        self._device, self._size, self._buffers = device, size, {}

    def __call__(self, name, dtype, n):
        buffer = self._buffers.get(name)
        if buffer is None:
            buffer = self._buffers[name] = torch.empty(self._size, dtype=dtype, device=self._device)
        return buffer if n == self._size else buffer[:n]


def slices(lists, device):
    """A scratch of the slice size, and an iterator over every tensor index's slices: ``[grad,
    weight, ...]`` lists of aligned pieces of the flat tensors."""
    size = CPU_SLICE if device.type == "cpu" else DEVICE_SLICE
    scratch = Scratch(device, min(size, max(t.numel() for t in lists[0])))

    def pieces():
        for tensors in zip(*lists):
            for begin in range(0, tensors[0].numel(), size):
                yield [t[begin:begin + size] for t in tensors]

    return scratch, pieces()


def widened(scratch, name, t):
    """``t`` as fp32: itself, or widened into the scratch."""
    if t.dtype == torch.float32:
        return t
    return scratch(name, torch.float32, t.numel()).copy_(t)


def fp32_product(scratch, name, t, factor):
    """``fp32(t) * factor`` (a 0-dim fp32 tensor), into the scratch."""
    out = scratch(name, torch.float32, t.numel())
    if t.dtype == torch.float32:
        return torch.mul(t, factor, out=out)
    return out.copy_(t).mul_(factor)


def _as_fp64(scratch, name, t):
    """A 0-dim ``t`` as it is (it is widened exactly inside an fp64 operation), else its fp64 copy."""
    return t if t.dim() == 0 else scratch(name, torch.float64, t.numel()).copy_(t)


def fma(a, b, c, scratch, out):
    """``fp32(a * b + c)`` rounded once, as C's ``fmaf`` and CUDA's ``__fmaf_rn``, into
    ``scratch(out, ...)``: ``b`` and ``c`` fp32 tensors, ``a`` one too or a 0-dim fp32 tensor.

    Why this is exact, each step an IEEE fp64 operation rounded to nearest even:

    * ``p = a * b`` is exact: two 24-bit significands make at most 48 bits, and fp32 products
      (2**-298 to 2**256 in magnitude) lie well inside fp64's normal range.
    * ``s = p + c`` rounds once; TwoSum (Knuth: ``s`` and five more operations) gives its exact
      error ``e = (p + c) - s`` for any finite ``p`` and ``c``.
    * Rounding ``s`` to fp32 could go wrong only where ``s`` lands on a midpoint of two fp32 values
      that the exact sum is not on. Rounded to odd instead (the exact sum truncated toward zero,
      its last bit set when inexact), the fp64 sum never lands on one (an fp32 midpoint has a zero
      last fp64 bit), and rounding that to fp32 is correct: 53 >= 24 + 2 bits (Boldo and
      Melquiond, 2008), over the whole fp32 range, subnormals and overflow to inf included.
    * Round to odd in the bits of ``s``: one unit less when ``|p + c| < |s|`` (``e`` and ``s`` of
      opposite signs), then the last bit set when ``e != 0``; a unit less in the last place of
      a power of two is the largest value of the binade below, as it should be. The signs are
      read from ``e * s``, which neither underflows nor overflows when ``e != 0``: then ``s`` is
      not 0 (a sum that rounds to 0 is exact), ``|s| >= 2**-298`` and ``e`` is a multiple of
      ``2**-350`` (``p + c`` of ``2**-298``, ``s`` of its ulp), and ``|e| <= 2**-53 * |s|``.
    * With an inf or NaN input ``s`` is inf or NaN and TwoSum makes ``e`` NaN: both comparisons are
      false, ``s`` stays, and its fp32 rounding is fmaf's result (``s`` itself never overflows
      fp64; a finite ``s`` beyond fp32's range rounds to inf as fmaf's result does).

    No value is read on the host: this is the path for every device but the CPU. tests/
    test_fused_ops.py checks it against exact rational arithmetic on random and adversarial
    triples (midpoints, ties, subnormals, overflow, signed zeros, inf and NaN).
    """
    n = b.numel()
    p = scratch("fma.p", torch.float64, n).copy_(b).mul_(_as_fp64(scratch, "fma.a", a))
    c = scratch("fma.c", torch.float64, n).copy_(c)
    s = torch.add(p, c, out=scratch("fma.s", torch.float64, n))
    # TwoSum's error, in place: t = s - p, then e = (p - (s - t)) + (c - t).
    t = torch.sub(s, p, out=scratch("fma.t", torch.float64, n))
    torch.sub(c, t, out=c)
    torch.sub(s, t, out=t)
    e = torch.sub(p, t, out=p).add_(c)
    e.mul_(s)  # e * s: its sign says on which side of s the exact sum lies
    lower = torch.lt(e, 0, out=scratch("fma.lower", torch.bool, n))
    inexact = torch.gt(e, 0, out=scratch("fma.inexact", torch.bool, n)).logical_or_(lower)
    bits, unit = s.view(torch.int64), scratch("fma.unit", torch.int64, n)
    bits.sub_(unit.copy_(lower))
    bits.bitwise_or_(unit.copy_(inexact))
    return scratch(out, torch.float32, n).copy_(s)


_FP32_MIN_NORMAL_BITS = 0x00800000  # 2**-126 as fp32 bits


def fma_cpu(a, b, c, scratch, out):
    """``fma`` for CPU tensors, in fewer passes: rounds ``s = a * b + c`` (fp64, as in ``fma``)
    straight to fp32, and recomputes with ``fma`` the elements where that can differ, if any.

    Rounding ``s`` instead of the exact sum ``x`` to fp32 can only differ where ``s`` is an fp32
    rounding midpoint: otherwise no midpoint lies between ``x`` and ``s`` (it would be an fp64
    value nearer to ``x`` than ``s``, or ``x`` itself and then ``s``), so both round alike. In
    fp32's normal range, up to the overflow threshold (``FLT_MAX`` and half an ulp), those
    midpoints are exactly the fp64 values whose 29 low significand bits are a 1 and 28 zeros;
    below it, where fp32 keeps fewer bits, every nonzero ``s`` that rounds to at most ``2**-126``
    in magnitude is recomputed. An inf or NaN ``s`` is neither, and is fmaf's result. Whether any
    element needs it is read on the host, hence CPU tensors only.
    """
    n = b.numel()
    s = scratch("fma_cpu.s", torch.float64, n).copy_(b).mul_(_as_fp64(scratch, "fma_cpu.a", a))
    s.add_(scratch("fma_cpu.c", torch.float64, n).copy_(c))
    r = scratch(out, torch.float32, n).copy_(s)
    # Int32 tests (their reductions are fast, and see no NaN): the 29 low bits of s xor 2**28 are 0
    # at a midpoint; r's bits without the sign are at most 2**-126's where |r| <= 2**-126.
    low = torch.bitwise_and(s.view(torch.int64), 0x1FFFFFFF,
                            out=scratch("fma_cpu.low", torch.int32, n)).bitwise_xor_(0x10000000)
    magnitude = torch.bitwise_and(r.view(torch.int32), 0x7FFFFFFF,
                                  out=scratch("fma_cpu.magnitude", torch.int32, n))
    midpoints, tiny = bool(low.amin() == 0), bool(magnitude.amin() <= _FP32_MIN_NORMAL_BITS)
    if midpoints or tiny:
        suspect = low == 0
        if tiny:
            suspect.logical_or_((magnitude <= _FP32_MIN_NORMAL_BITS).logical_and_(s != 0))
        index = suspect.nonzero().squeeze(1)
        r[index] = fma(a if a.dim() == 0 else a[index], b[index], c[index], scratch, "fma_cpu.fix")
    return r


def step_tools(noop_flag, device):
    """``(fma, keep_old)`` for a fused optimizer step on ``device``, or None when the step is
    skipped. On the CPU the flag is read on the host (there is no device to wait for): a set flag
    skips the step there, and the step uses ``fma_cpu``. Elsewhere nothing is read on the host:
    ``keep_old`` is the flag as a 0-dim bool tensor, applied by ``store``."""
    if storage.read_on_host(device):
        return None if noop_flag.item() != 0 else (fma_cpu, None)
    return fma, (noop_flag != 0).reshape(())


def store(keep_old, scratch, destination, result):
    """``destination = result``, rounded to its dtype; with ``keep_old`` (a 0-dim bool tensor, the
    noop flag) the choice is made on the device, a flagged step storing the old values back.
    ``scratch`` (None: a new tensor) holds the rounded result for that choice."""
    if keep_old is None:
        destination.copy_(result)
        return
    if result.dtype != destination.dtype:
        result = (result.to(destination.dtype) if scratch is None
                  else scratch(f"store.{destination.dtype}", destination.dtype, result.numel()).copy_(result))
    torch.where(keep_old, destination, result, out=destination)

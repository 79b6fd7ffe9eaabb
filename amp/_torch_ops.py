"""Pure-PyTorch implementations of the ``amp_C`` multi-tensor ops.

These run wherever PyTorch runs and are the fallback that ``amp.multi_tensor_apply`` uses when the
``amp_C`` extension is not built (or does not support the tensors' device). Each op is a handful of
``torch._foreach_*`` / ``torch._amp_foreach_non_finite_check_and_unscale_`` calls over the whole
list, never a Python loop over elements. ``chunk_size`` is accepted for signature compatibility and
otherwise ignored (there are no launches to chunk), but refused where ``amp_C`` refuses it.

Rounding contract (the compiled kernels must produce the same bits):

* A Python-float ``scale``/``a``/``b`` is first rounded to fp32 (round to nearest even), exactly as a
  C++ ``float`` parameter receives it; a tensor argument is already a 1-element fp32 tensor.
* ``multi_tensor_scale``: ``out = (out_t)((float)in * scale)``: one fp32 multiply, rounded once to
  the output dtype.
* ``multi_tensor_axpby``: ``out = (out_t)(ax + by)`` with ``ax = a * (float)x`` and
  ``by = b * (float)y`` each rounded to fp32 *before* the fp32 add. A fused multiply-add is not
  allowed (compile the kernel with ``-fmad=false`` / ``-ffp-contract=off`` or use intrinsics).
* ``update_scale_hysteresis``: ``scale * factor`` is computed in fp64 and rounded once to fp32
  (Apex's kernel multiplies a float by a double); growth is stored only if that fp32 value is finite.
* Elements are paired in memory order: ``in[i]`` and ``out[i]`` may differ in shape as long as their
  numels match, and any non-overlapping, dense layout (contiguous, channels_last, a transposed
  matrix...) is accepted, as the kernels see flat storage.
* An output may share memory only with the inputs at its own index, and only exactly (in place,
  ``scale(x, x)``); any other overlap is refused before anything is written, with amp_C's message.
* The l2norm family sums squares in fp32 but in a different order than a chunked kernel, so their
  results agree with the kernels within a tolerance, not bitwise.

Overflow flag: ``noop_flag`` is a 1-element int32 or fp32 tensor on the tensors' device. Ops only
ever set it to 1, never clear it. ``multi_tensor_scale`` and ``multi_tensor_axpby`` set it when a
checked *input* element is inf or NaN (an overflow created by the multiply is not detected); the norm
ops set it when the fp32 sum of squares is not finite.
"""
import collections
import itertools
import math
import operator

import torch

from ._compat import foreach_norm, non_finite_check_and_unscale_

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP32_MAX = torch.finfo(torch.float32).max


def _is_dense(t):
    """Whether ``t`` covers a gap-free block of storage (some permutation of its dims is contiguous)."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _flat(t):
    # A 1-D view in storage order: the order the compiled kernels walk, whatever the layout.
    return t.as_strided((t.numel(),), (1,))


def _paired_views(ins, outs):
    """``(ins, outs)`` as lists whose elements pair up in storage order, as the kernels walk them.

    In place (every output is its input) the lists serve as they are, and ``outs is ins`` tells
    the caller so; equal shapes and strides need no views either; other layouts are flattened.
    """
    if all(o is i for i, o in zip(ins, outs)):
        ins = list(ins)
        return ins, ins
    if all(i.shape == o.shape and i.stride() == o.stride() for i, o in zip(ins, outs)):
        return list(ins), list(outs)
    return [_flat(t) for t in ins], [_flat(t) for t in outs]


def _check_lists(op, tensor_lists, names):
    """Validate the lists and return their common device, or None when they hold no tensors."""
    if len(tensor_lists) != len(names):
        raise ValueError(
            f"{op} expects {len(names)} tensor lists [{', '.join(names)}], got {len(tensor_lists)}"
        )
    lengths = [len(tensors) for tensors in tensor_lists]
    if len(set(lengths)) != 1:
        raise ValueError(
            f"{op}: the tensor lists [{', '.join(names)}] have lengths {lengths}; "
            "they must be equal (one tensor per list for every element)"
        )
    if lengths[0] == 0:
        return None
    device = tensor_lists[0][0].device
    for k, tensors in enumerate(tensor_lists):
        dtype = tensors[0].dtype
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"{op}: tensor_lists[{k}] ({names[k]}) has dtype {dtype}; "
                "only float32, float16 and bfloat16 are supported"
            )
        for i, t in enumerate(tensors):
            where = f"{op}: tensor_lists[{k}][{i}] ({names[k]})"
            if t.dtype != dtype:
                raise ValueError(
                    f"{where} is {t.dtype} but tensor_lists[{k}][0] is {dtype}; every tensor in one "
                    "list must share a dtype: group the tensors by dtype and call once per group"
                )
            if t.device != device:
                raise ValueError(
                    f"{where} is on {t.device} but tensor_lists[0][0] is on {device}; "
                    "group the tensors by device and call once per device"
                )
            if t.numel() != tensor_lists[0][i].numel():
                raise ValueError(
                    f"{where} has {t.numel()} elements but tensor_lists[0][{i}] has "
                    f"{tensor_lists[0][i].numel()}; tensors at the same index must have equal numel"
                )
            if t.layout != torch.strided or not _is_dense(t):
                raise ValueError(
                    f"{where} is not a dense strided tensor (a slice or an expanded view?); "
                    "pass t.contiguous() instead"
                )
    return device


def _check_chunk_size(op, chunk_size):
    """Refuse what amp_C refuses: a call must not work only because the extension is missing."""
    if isinstance(chunk_size, bool) or not hasattr(type(chunk_size), "__index__"):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    value = operator.index(chunk_size)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"chunk_size must be a positive int below 2**63, got {value}")
    if value <= 0:
        raise ValueError(f"{op}: chunk_size must be positive, got {value}")


def _check_writable(op, t, name):
    # Checked before anything is written: torch refuses the in-place update of an inference tensor
    # outside inference mode only after its kernel has run.
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{op}: {name} is an inference tensor, which cannot be updated in place outside "
            "torch.inference_mode(); pass a tensor created outside inference mode (or a clone)"
        )


# A tensor's bytes, and where it sits in tensor_lists; sorts by address first.
_Range = collections.namedtuple("_Range", ["begin", "end", "list", "index"])


def _disjoint(tensor_lists):
    """The common case, cheaply: no two tensors share a byte (a tensor that appears at the same
    index of several lists, in place, counts once). Anything else gets the full walk below."""
    spans = sorted({(id(t), i): (t.data_ptr(), t.nbytes)
                    for tensors in tensor_lists for i, t in enumerate(tensors)}.values())
    end = 0
    for begin, size in spans:
        if size and begin < end:
            return False
        end = max(end, begin + size)
    return True


def _check_outputs(op, tensor_lists):
    """The output list is the last one; an output may share memory only with the inputs at its own
    index, and only exactly (in place, as Apex's ``scale(x, x)``): the compiled kernels write the
    outputs while they read all the lists. amp_C walks the byte ranges the same way, so both name
    the same pair: ranges sorted, identical ranges grouped, each group checked against earlier ones.
    """
    out_list = len(tensor_lists) - 1
    for i, t in enumerate(tensor_lists[out_list]):
        _check_writable(op, t, f"tensor_lists[{out_list}][{i}]")
    if _disjoint(tensor_lists):
        return
    ranges = sorted(
        _Range(t.data_ptr(), t.data_ptr() + t.nbytes, k, i)
        for k, tensors in enumerate(tensor_lists)
        for i, t in enumerate(tensors)
        if t.nbytes > 0
    )

    def refuse(a, b):
        raise ValueError(
            f"{op}: tensor_lists[{a.list}][{a.index}] overlaps tensor_lists[{b.list}][{b.index}] in "
            "memory; an output may share memory only with its own inputs at the same index "
            "(in place), so pass separate tensors"
        )

    widest = widest_out = None  # the earlier group reaching furthest; the same among outputs
    for _, members in itertools.groupby(ranges, key=lambda r: (r.begin, r.end)):
        group = list(members)
        out = next((r for r in group if r.list == out_list), None)
        if out is not None:
            for r in group:
                if r is not out and (r.list == out_list or r.index != out.index):
                    refuse(r, out)
        representative = out if out is not None else group[0]
        earlier = widest if out is not None else widest_out
        if earlier is not None and representative.begin < earlier.end:
            refuse(representative, earlier)
        if widest is None or representative.end > widest.end:
            widest = representative
        if out is not None and (widest_out is None or representative.end > widest_out.end):
            widest_out = representative


def _check_flag(op, noop_flag, device):
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1 or noop_flag.dtype not in (
        torch.int32,
        torch.float32,
    ):
        raise ValueError(f"{op}: noop_flag must be a 1-element int32 or float32 tensor")
    if noop_flag.device != device:
        raise ValueError(
            f"{op}: noop_flag is on {noop_flag.device} but the tensors are on {device}; "
            "create the flag on the tensors' device"
        )
    _check_writable(op, noop_flag, "noop_flag")


def _fp32_scalar(op, name, value, device):
    """``value`` as a 0-dim fp32 tensor on ``device``, without a host-device synchronisation."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32 or value.device != device:
            raise ValueError(
                f"{op}: {name} must be a Python number or a 1-element float32 tensor on {device}, "
                f"got a {value.dtype} tensor of {value.numel()} elements on {value.device}"
            )
        return value.reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _flag_buffer(noop_flag):
    # The fused check writes 1.0 into a float32 buffer; an int32 flag gets a float32 stand-in.
    if noop_flag.dtype == torch.float32:
        return noop_flag
    return torch.zeros(1, dtype=torch.float32, device=noop_flag.device)


def _merge_flag(noop_flag, found):
    if found is not noop_flag:
        noop_flag.masked_fill_((found > 0).view(noop_flag.shape), 1)


def _fp32_copies(flat_tensors):
    return [t.to(torch.float32, copy=True) for t in flat_tensors]


def _scale_(fp32_tensors, scale, found):
    """Multiply in place by ``scale``; with ``found``, also flag non-finite values (checked first)."""
    if found is None:
        torch._foreach_mul_(fp32_tensors, scale)
    else:
        non_finite_check_and_unscale_(fp32_tensors, found, scale)


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out = float(in) * scale`` for ``tensor_lists = [in, out]``; flags non-finite inputs."""
    op = "multi_tensor_scale"
    _check_chunk_size(op, chunk_size)
    device = _check_lists(op, tensor_lists, ("in", "out"))
    if device is None:
        return
    _check_flag(op, noop_flag, device)
    _check_outputs(op, tensor_lists)
    scale = _fp32_scalar(op, "scale", scale, device)
    ins, outs = _paired_views(tensor_lists[0], tensor_lists[1])
    found = _flag_buffer(noop_flag)
    with torch.no_grad():
        if tensor_lists[1][0].dtype == torch.float32:
            # Widening into an fp32 output is exact, so the output can be the fp32 workspace.
            if outs is not ins:
                torch._foreach_copy_(outs, ins)
            _scale_(outs, scale, found)
        else:
            work = _fp32_copies(ins)
            _scale_(work, scale, found)
            torch._foreach_copy_(outs, work)
    _merge_flag(noop_flag, found)


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``out = a*float(x) + b*float(y)`` for ``tensor_lists = [x, y, out]``.

    ``arg_to_check``: -1 flags non-finite values in x and y, 0 only in x, 1 only in y, anything
    else checks nothing.
    """
    op = "multi_tensor_axpby"
    _check_chunk_size(op, chunk_size)
    device = _check_lists(op, tensor_lists, ("x", "y", "out"))
    if device is None:
        return
    _check_flag(op, noop_flag, device)
    _check_outputs(op, tensor_lists)
    a = _fp32_scalar(op, "a", a, device)
    b = _fp32_scalar(op, "b", b, device)
    xs, ys, outs = ([_flat(t) for t in tensors] for tensors in tensor_lists)
    found = _flag_buffer(noop_flag)
    out_is_fp32 = tensor_lists[2][0].dtype == torch.float32
    with torch.no_grad():
        # b*y goes into a private buffer first, so an output aliasing y is read before it is written.
        by = _fp32_copies(ys)
        _scale_(by, b, found if arg_to_check in (-1, 1) else None)
        if out_is_fp32:
            torch._foreach_copy_(outs, xs)
            ax = outs
        else:
            ax = _fp32_copies(xs)
        _scale_(ax, a, found if arg_to_check in (-1, 0) else None)
        torch._foreach_add_(ax, by)
        if not out_is_fp32:
            torch._foreach_copy_(outs, ax)
    _merge_flag(noop_flag, found)


def _norm_results(op, chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor, skip_if_flagged):
    """Shared body of the l2norm ops: (total [1], per-tensor [n] or [0]), both fp32."""
    _check_chunk_size(op, chunk_size)
    device = _check_lists(op, tensor_lists, ("x",))
    if device is None:
        empty = torch.zeros(0, dtype=torch.float32, device=noop_flag.device)
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), empty
    _check_flag(op, noop_flag, device)
    xs = [_flat(t) for t in tensor_lists[0]]
    with torch.no_grad():
        if inv_scale is not None:
            xs = _fp32_copies(xs)
            torch._foreach_mul_(xs, _fp32_scalar(op, "inv_scale", inv_scale, device))
        norms = torch.stack(foreach_norm(xs, 2, dtype=torch.float32))
        total = torch.linalg.vector_norm(norms).reshape(1)
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
    return _norm_results(
        "multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, None, per_tensor, False
    )


def multi_tensor_l2norm_mp(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """Like ``multi_tensor_l2norm``, but returns zeros when ``noop_flag`` was already set."""
    return _norm_results(
        "multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, None, per_tensor, True
    )


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """L2 norm of ``x * inv_scale`` without modifying x."""
    return _norm_results(
        "multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor,
        False,
    )


def _check_state_tensor(name, t, dtype, device):
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"update_scale_hysteresis: {name} must be a 1-element {dtype} tensor on {device} "
            "(the device of current_scale)"
        )


def update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                            growth_factor, backoff_factor, growth_interval, hysteresis,
                            min_scale=None, max_scale=None, inv_scale=None, should_skip=None):
    """Update the loss scale in place, on its device, from ``found_inf``; returns ``current_scale``.

    An overflow (``found_inf > 0``) decrements ``hysteresis_tracker``; while it stays above zero the
    overflow is tolerated (growth tracker zeroed, scale kept), otherwise the scale is multiplied by
    ``backoff_factor`` and the growth tracker zeroed. A clean step counts one more success in
    ``growth_tracker``: reaching ``growth_interval`` multiplies the scale by ``growth_factor`` (only if
    the result is finite) and restarts the count; either way ``hysteresis_tracker`` is reset to
    ``hysteresis``. Never synchronises with the host.

    The optional trailing arguments (not Apex's) let one call do a whole update of amp's scaler:
    the new scale is clamped into ``[min_scale, max_scale]`` (as ``torch.clamp_`` does, either may
    be None); ``inv_scale`` (1-element float32) receives ``1 / scale`` divided in fp64 and rounded
    to fp32; ``should_skip`` (1-element float32) receives 1.0 if ``found_inf`` was set, else 0.0.
    """
    device = current_scale.device
    _check_state_tensor("current_scale", current_scale, torch.float32, device)
    _check_state_tensor("growth_tracker", growth_tracker, torch.int32, device)
    _check_state_tensor("hysteresis_tracker", hysteresis_tracker, torch.int32, device)
    _check_state_tensor("found_inf", found_inf, torch.float32, device)
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if not -(2**31) <= value < 2**31:
            raise ValueError(
                f"update_scale_hysteresis: {name} must fit in int32 (the trackers' dtype), "
                f"got {value}"
            )
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        # A bound is rounded to fp32 by the clamp, so it must be one fp32 can hold.
        if value is not None and not (abs(value) == math.inf or abs(value) <= _FP32_MAX):
            raise ValueError(
                f"update_scale_hysteresis: {name} must be None, inf or a number within fp32's "
                f"range, got {value}"
            )
    outputs = [("inv_scale", inv_scale), ("should_skip", should_skip)]
    outputs = [(name, t) for name, t in outputs if t is not None]
    for name, t in outputs:
        _check_state_tensor(name, t, torch.float32, device)
    for name, t in [("current_scale", current_scale), ("growth_tracker", growth_tracker),
                    ("hysteresis_tracker", hysteresis_tracker)] + outputs:
        _check_writable("update_scale_hysteresis", t, name)
    with torch.no_grad():
        scale = current_scale.reshape(())
        growth = growth_tracker.reshape(())
        overflow = found_inf.reshape(()) > 0
        hysteresis_left = torch.where(overflow, hysteresis_tracker.reshape(()) - 1, hysteresis)
        back_off = overflow & (hysteresis_left <= 0)
        successes = growth + 1
        grow = ~overflow & (successes == growth_interval)
        grown = (scale.double() * growth_factor).float()
        shrunk = (scale.double() * backoff_factor).float()
        new_scale = torch.where(back_off, shrunk, torch.where(grow & grown.isfinite(), grown, scale))
        new_growth = torch.where(overflow | grow, 0, successes)
        if min_scale is not None or max_scale is not None:
            new_scale = new_scale.clamp(min_scale, max_scale)
        if should_skip is not None:
            should_skip.copy_(overflow)
        current_scale.copy_(new_scale)
        growth_tracker.copy_(new_growth)
        hysteresis_tracker.copy_(hysteresis_left)
        if inv_scale is not None:
            inv_scale.copy_(new_scale.double().reciprocal())
    return current_scale

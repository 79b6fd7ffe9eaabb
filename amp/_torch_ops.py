"""Pure-PyTorch implementations of the ``amp_C`` multi-tensor ops.

These run wherever PyTorch runs and are the fallback that ``amp.multi_tensor_apply`` uses when the
``amp_C`` extension is not built (or does not support the tensors' device). Each op is a handful of
``torch._foreach_*`` / ``torch._amp_foreach_non_finite_check_and_unscale_`` calls over the whole
list, never a Python loop over elements; the fused optimizer steps, whose exact fp32 arithmetic
takes a few dozen tensor operations, work through each tensor in cache-sized slices instead.
``chunk_size`` is accepted for signature compatibility and otherwise ignored (there are no launches
to chunk), but refused where ``amp_C`` refuses it.

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
* The l2norm family sums squares in a different order than a chunked kernel, so their results
  agree with the kernels within a tolerance, not bitwise. The sum of squares is an fp32 value on
  every path, as in Apex's CUDA kernel: where a tensor's sum of squares (or the total) exceeds
  fp32's range its norm (or the total) is inf, even when the norm itself would fit (any norm above
  sqrt(FLT_MAX), about 1.84e19), and an inf total sets the flag. So every path agrees on finiteness
  and on the flag.

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
    "multi_tensor_sgd",
    "multi_tensor_adam",
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


# --- fused optimizer steps --------------------------------------------------------------------------
#
# Both ops update fp32 (or low-precision) weights and optimizer state in one pass from the model's
# grads, unscaling them on the way, and write the low-precision model copy. Per element everything
# is computed in fp32 and stored rounded to the destination dtype. Unlike axpby, they use a fused
# multiply-add (``fma``: one rounding) exactly where torch.optim's CPU kernels do (``add(alpha=)``,
# ``lerp``, ``addcmul``), so that they give torch.optim's bits; every other operation is rounded to
# fp32 on its own. Host floats are rounded to fp32 as a C++ ``float`` parameter would be; a
# coefficient derived from host floats (``1 - dampening``, ``1 - lr * weight_decay``...) is computed
# in fp64 first and rounded once, as Python computes it before torch.optim hands it to a kernel.

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SGD_LISTS = {3: ("grads", "weights", "momentum_bufs"),
              4: ("grads", "weights", "momentum_bufs", "model_copies")}
_ADAM_LISTS = {4: ("grads", "params", "exp_avgs", "exp_avg_sqs"),
               5: ("grads", "params", "exp_avgs", "exp_avg_sqs", "model_copies")}
# The largest step the bias corrections support: the kernels read the step's low 31 bits.
_MAX_ADAM_STEP = 2**31 - 1


def _check_fused_lists(op, tensor_lists, forms):
    """Validate the lists of a fused optimizer op; returns (device, names) or (None, names).

    ``forms`` maps a list count to the list names. Beyond ``_check_lists``: the dtype combination
    (``_check_fused_dtypes``), no two tensors sharing memory at all (every list but the grads is
    written), and writable destinations.
    """
    if not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) not in forms:
        counts = " or ".join(f"{n} [{', '.join(names)}]" for n, names in forms.items())
        got = len(tensor_lists) if isinstance(tensor_lists, (list, tuple)) else type(tensor_lists)
        raise ValueError(f"{op} expects {counts} tensor lists, got {got}")
    names = forms[len(tensor_lists)]
    device = _check_lists(op, tensor_lists, names)
    if device is None:
        return None, names
    _check_fused_dtypes(op, [tensors[0].dtype for tensors in tensor_lists], names)
    _check_no_shared_memory(op, tensor_lists)
    for k in range(1, len(tensor_lists)):
        for i, t in enumerate(tensor_lists[k]):
            _check_writable(op, t, f"tensor_lists[{k}][{i}] ({names[k]})")
    return device, names


def _check_fused_dtypes(op, dtypes, names):
    """The accepted combinations: every list one dtype; fp16/bf16 grads with fp32 params and state
    (Adam's 4 lists); with a model-copy list, grads of any dtype, fp32 weights and state and an
    fp16/bf16 copy."""
    has_copies = names[-1] == "model_copies"
    grads, masters = dtypes[0], dtypes[1:len(dtypes) - has_copies]
    fp32_masters = all(d == torch.float32 for d in masters)
    if has_copies:
        ok = fp32_masters and dtypes[-1] in _LOW_PRECISION
    elif op == "multi_tensor_adam" and grads in _LOW_PRECISION and fp32_masters:
        ok = True
    else:
        ok = all(d == grads for d in dtypes)
    if not ok:
        combination = ", ".join(f"{name} {str(d).replace('torch.', '')}"
                                for name, d in zip(names, dtypes))
        mixed = ", fp16/bf16 grads with fp32 params and state" if op == "multi_tensor_adam" else ""
        raise ValueError(
            f"{op}: unsupported dtype combination ({combination}); supported: one dtype for every "
            f"list{mixed}, or with a model_copies list fp32 weights and state and fp16/bf16 copies"
        )


def _check_no_shared_memory(op, tensor_lists):
    """Refuse any two tensors whose bytes overlap, naming the first such pair in address order."""
    ranges = sorted(
        _Range(t.data_ptr(), t.data_ptr() + t.nbytes, k, i)
        for k, tensors in enumerate(tensor_lists)
        for i, t in enumerate(tensors)
        if t.nbytes > 0
    )
    for earlier, later in zip(ranges, ranges[1:]):
        if later.begin < earlier.end:
            raise ValueError(
                f"{op}: tensor_lists[{earlier.list}][{earlier.index}] and "
                f"tensor_lists[{later.list}][{later.index}] share memory; every grad, weight, "
                "state and model-copy tensor must be a separate tensor"
            )


def _check_host_float(op, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a Python float, got {type(value).__name__}")
    return float(value)


def _fp32(value, device):
    return torch.full((), value, dtype=torch.float32, device=device)


def _host_fp32(value):
    # What a C++ float parameter holds: the kernels test it (``wd != 0``...) after the rounding.
    return torch.tensor(value, dtype=torch.float32).item()


# Elements per slice in the fused optimizers below. On the CPU each tensor is updated one slice of
# its flat view at a time, so that the temporaries (fp64 ones in ``_fma``) stay in the caches
# instead of streaming through memory; on a GPU a slice only bounds the temporaries' memory (a
# small one would cost a kernel launch per operation for little work).
_CPU_SLICE = 131072
_DEVICE_SLICE = 2**20


class _Scratch:
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


def _slices(lists, device):
    """A scratch of the slice size, and an iterator over every tensor index's slices: ``[grad,
    weight, ...]`` lists of aligned pieces of the flat tensors."""
    size = _CPU_SLICE if device.type == "cpu" else _DEVICE_SLICE
    scratch = _Scratch(device, min(size, max(t.numel() for t in lists[0])))

    def pieces():
        for tensors in zip(*lists):
            for begin in range(0, tensors[0].numel(), size):
                yield [t[begin:begin + size] for t in tensors]

    return scratch, pieces()


def _widened(scratch, name, t):
    """``t`` as fp32: itself, or widened into the scratch."""
    if t.dtype == torch.float32:
        return t
    return scratch(name, torch.float32, t.numel()).copy_(t)


def _fp32_product(scratch, name, t, factor):
    """``fp32(t) * factor`` (a 0-dim fp32 tensor), into the scratch."""
    out = scratch(name, torch.float32, t.numel())
    if t.dtype == torch.float32:
        return torch.mul(t, factor, out=out)
    return out.copy_(t).mul_(factor)


def _as_fp64(scratch, name, t):
    """A 0-dim ``t`` as it is (it is widened exactly inside an fp64 operation), else its fp64 copy."""
    return t if t.dim() == 0 else scratch(name, torch.float64, t.numel()).copy_(t)


def _fma(a, b, c, scratch, out):
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


def _fma_cpu(a, b, c, scratch, out):
    """``_fma`` for CPU tensors, in fewer passes: rounds ``s = a * b + c`` (fp64, as in ``_fma``)
    straight to fp32, and recomputes with ``_fma`` the elements where that can differ, if any.

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
        r[index] = _fma(a if a.dim() == 0 else a[index], b[index], c[index], scratch, "fma_cpu.fix")
    return r


def _step_tools(noop_flag, device):
    """``(fma, keep_old)`` for a fused optimizer step on ``device``, or None when the step is
    skipped. On the CPU the flag is read on the host (there is no device to wait for): a set flag
    skips the step there, and the step uses ``_fma_cpu``. Elsewhere nothing is read on the host:
    ``keep_old`` is the flag as a 0-dim bool tensor, applied by ``_store``."""
    if device.type == "cpu":
        return None if noop_flag.item() != 0 else (_fma_cpu, None)
    return _fma, (noop_flag != 0).reshape(())


def _store(keep_old, scratch, destination, result):
    """``destination = result``, rounded to its dtype; with ``keep_old`` (a 0-dim bool tensor, the
    noop flag) the choice is made on the device, a flagged step storing the old values back."""
    if keep_old is None:
        destination.copy_(result)
        return
    if result.dtype != destination.dtype:
        result = scratch(f"store.{destination.dtype}", destination.dtype, result.numel()).copy_(result)
    torch.where(keep_old, destination, result, out=destination)


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov,
                     first_run, wd_after_momentum, scale):
    """One SGD step over ``[grads, weights, momentum_bufs]`` or ``[grads, weights, momentum_bufs,
    model_copies]``, Apex's ``multi_tensor_sgd``; nothing is written when ``noop_flag`` is set.

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
    1-element fp32 tensor on the tensors' device; the other coefficients are host floats.
    """
    op = "multi_tensor_sgd"
    _check_chunk_size(op, chunk_size)
    device, _ = _check_fused_lists(op, tensor_lists, _SGD_LISTS)
    wd, momentum, dampening, lr = (_check_host_float(op, name, v) for name, v in (
        ("wd", wd), ("momentum", momentum), ("dampening", dampening), ("lr", lr)))
    if device is None:
        return
    _check_flag(op, noop_flag, device)
    scale = _fp32_scalar(op, "scale", scale, device)
    wd_t, momentum_t, dc_t, neg_lr_t = (_fp32(v, device) for v in (wd, momentum, 1.0 - dampening,
                                                                    -lr))
    wd, momentum, dc = _host_fp32(wd), _host_fp32(momentum), _host_fp32(1.0 - dampening)
    lists = [[_flat(t) for t in tensors] for tensors in tensor_lists]
    tools = _step_tools(noop_flag, device)
    if tools is None:
        return
    fma, keep_old = tools
    with torch.no_grad():
        scratch, pieces = _slices(lists, device)
        for grad, weight, buf, *copy in pieces:
            g = _fp32_product(scratch, "g", grad, scale)
            w = _widened(scratch, "w", weight)
            if wd != 0 and not wd_after_momentum:
                g = fma(wd_t, w, g, scratch, "g.wd")
            if momentum != 0:
                if first_run:
                    b = g
                else:
                    b = _fp32_product(scratch, "b", buf, momentum_t)
                    # fma(1, g, b) is g + b rounded once: an fp32 add.
                    b = b.add_(g) if dc == 1 else fma(dc_t, g, b, scratch, "b.dc")
                g = fma(momentum_t, b, g, scratch, "g.nesterov") if nesterov else b
            if wd != 0 and wd_after_momentum:
                g = fma(wd_t, w, g, scratch, "g.wd_after")
            w = fma(neg_lr_t, g, w, scratch, "w.new")
            _store(keep_old, scratch, weight, w)
            if momentum != 0:
                _store(keep_old, scratch, buf, b)
            if copy:
                _store(keep_old, scratch, copy[0], w)


def _adam_step(op, step, device):
    """The step as a 0-dim int64 tensor on ``device`` (an int is checked here; a tensor's value is
    the caller's contract: an integer in [1, 2**31), read without a host synchronisation)."""
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype not in (torch.int32, torch.int64, torch.float32) \
                or step.device != device:
            raise ValueError(
                f"{op}: step must be a Python int or a 1-element int32, int64 or float32 tensor on "
                f"{device}, got a {step.dtype} tensor of {step.numel()} elements on {step.device}"
            )
        return step.reshape(()).to(torch.int64)
    if isinstance(step, bool) or not hasattr(type(step), "__index__"):
        raise TypeError(f"{op}: step must be an int or a tensor, got {type(step).__name__}")
    value = operator.index(step)
    if not 1 <= value <= _MAX_ADAM_STEP:
        raise ValueError(f"{op}: step is the step number after this update, 1 to {_MAX_ADAM_STEP}; "
                         f"got {value}")
    return torch.full((), value, dtype=torch.int64, device=device)


def _power_of_step(base, step):
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


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
                      bias_correction, weight_decay, inv_scale=1.0):
    """One Adam (``mode`` 0, L2 weight decay) or AdamW (``mode`` 1, decoupled) step over ``[grads,
    params, exp_avgs, exp_avg_sqs]`` or ``[..., model_copies]``; nothing is written when
    ``noop_flag`` is set.

    ``step`` is the step number after this update, a Python int or a 1-element int32/int64/float32
    tensor on the tensors' device (so it can stay there), 1 to 2**31 - 1. Once per call, in fp64
    (``pow`` = :func:`_power_of_step`, identical for an int and a tensor)::

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
    _check_chunk_size(op, chunk_size)
    device, _ = _check_fused_lists(op, tensor_lists, _ADAM_LISTS)
    lr, beta1, beta2, epsilon, weight_decay = (_check_host_float(op, name, v) for name, v in (
        ("lr", lr), ("beta1", beta1), ("beta2", beta2), ("epsilon", epsilon),
        ("weight_decay", weight_decay)))
    if mode not in (0, 1) or isinstance(mode, bool):
        raise ValueError(f"{op}: mode must be 0 (Adam, L2 weight decay) or 1 (AdamW), got {mode!r}")
    if device is None:
        return
    _check_flag(op, noop_flag, device)
    inv_scale = _fp32_scalar(op, "inv_scale", inv_scale, device)
    step = _adam_step(op, step, device)
    tools = _step_tools(noop_flag, device)
    if tools is None:
        return
    fma, keep_old = tools
    with torch.no_grad():
        if bias_correction:
            # A tensor divisor, not ``lr / tensor`` (which torch computes as lr * reciprocal).
            lr64 = torch.full((), lr, dtype=torch.float64, device=device)
            step_size = (lr64 / (1.0 - _power_of_step(beta1, step))).float()
            bc2_sqrt = torch.sqrt(1.0 - _power_of_step(beta2, step)).float()
        else:
            step_size, bc2_sqrt = _fp32(lr, device), _fp32(1.0, device)
        w1_host = torch.tensor(1.0 - beta1, dtype=torch.float32).item()  # on the host: no sync
        w1, w1_minus_1 = _fp32(w1_host, device), _fp32(w1_host - 1.0, device)
        small_w1 = abs(w1_host) < 0.5
        wd_t, beta2_t, w2, eps_t, decay = (_fp32(v, device) for v in (
            weight_decay, beta2, 1.0 - beta2, epsilon, 1.0 - lr * weight_decay))
        neg_step_size = -step_size
        lists = [[_flat(t) for t in tensors] for tensors in tensor_lists]
        weight_decay = _host_fp32(weight_decay)
        scratch, pieces = _slices(lists, device)
        for grad, param, exp_avg, exp_avg_sq, *copy in pieces:
            n = grad.numel()
            g = _fp32_product(scratch, "g", grad, inv_scale)
            p = _widened(scratch, "p", param)
            if weight_decay != 0:
                if mode == 0:
                    g = fma(wd_t, p, g, scratch, "g.wd")
                else:
                    p = torch.mul(p, decay, out=scratch("p.decay", torch.float32, n))
            m = _widened(scratch, "m", exp_avg)
            diff = torch.sub(g, m, out=scratch("diff", torch.float32, n))
            if small_w1:
                m = fma(w1, diff, m, scratch, "m.new")
            else:
                m = fma(w1_minus_1, diff, g, scratch, "m.new")
            v = fma(torch.mul(g, w2, out=scratch("w2g", torch.float32, n)), g,
                    _fp32_product(scratch, "v", exp_avg_sq, beta2_t), scratch, "v.new")
            # torch.sqrt of fp32 is not correctly rounded on every CPU build (MKL's is not); the
            # fp64 square root rounded to fp32 is (53 >= 2 * 24 + 2 bits).
            denom = scratch("denom.fp64", torch.float64, n).copy_(v).sqrt_()
            denom = scratch("denom", torch.float32, n).copy_(denom).div_(bc2_sqrt).add_(eps_t)
            # p + (-step_size * m) / denom (an IEEE sum is the same either way round)
            update = torch.mul(m, neg_step_size, out=scratch("p.new", torch.float32, n))
            p = update.div_(denom).add_(p)
            _store(keep_old, scratch, param, p)
            _store(keep_old, scratch, exp_avg, m)
            _store(keep_old, scratch, exp_avg_sq, v)
            if copy:
                _store(keep_old, scratch, copy[0], p)

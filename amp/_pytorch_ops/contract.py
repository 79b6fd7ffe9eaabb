"""The argument contract of the multi-tensor ops, written once for both implementations.

This package's ops call the checks below; ``amp_C`` calls their C++ mirrors
(``csrc/amp_C_contract.cpp``, function for function) in the same order, with the same exception
types and messages, so a call is refused alike whichever path runs it (``tests/test_contract.py``
holds both to it). Every rule is checked before the first write: a refused call changes nothing.

The rules, in the order they are checked; the first one broken is reported.

1. ``chunk_size``: an int (``TypeError``) below 2**63, positive.
2. ``tensor_lists``: as many lists as the op takes, all of one length: ``[in, out]`` (scale),
   ``[x, y, out]`` (axpby), ``[x]`` (the l2norm family), ``[grads, weights, momentum_bufs]`` or
   ``[..., model_copies]`` (sgd), ``[grads, params, exp_avgs, exp_avg_sqs]`` or
   ``[..., model_copies]`` (adam, lamb); sgd and adam also take bf16 weights and their masters'
   remainders in place of fp32 params: ``[grads, weights, momentum_bufs, remainders]``,
   ``[grads, weights, exp_avgs, exp_avg_sqs, remainders]``, the form chosen when the last list's
   first tensor is int16 (``remainder.py`` says what they hold).
3. ``noop_flag``: a 1-element int32 or float32 tensor.
4. The op's host numbers, in signature order: a float is a Python int or float, an int a Python
   int, never a bool (``TypeError``), except the on/off ints (``bias_correction``, lamb's
   ``grad_averaging`` and ``use_nvlamb``, also None): an int or a bool, on when nonzero; ``mode``
   is 0 or 1; lamb's ``step`` an int from 1 to 2**31 - 1.

   With no tensors in the lists the op stops here: it writes nothing (the l2norm family returns
   zero norms on the flag's device).
5. Each tensor, list by list and index by index: float32, float16 or bfloat16 (remainders:
   int16, contiguous, ``remainder.packed_numel`` of the index's numel, 4-byte aligned for their
   int32 carry words, and ``chunk_size`` a multiple of 32, so that no carry word spans two
   chunks); the dtype of the
   first tensor of its list; on the device of ``tensor_lists[0][0]``; the numel of
   ``tensor_lists[0][i]``; dense (its elements fill a gap-free block: contiguous, channels_last, a
   transposed matrix...); laid out as ``tensor_lists[0][i]``: the same shape and strides (those of
   size-1 dims aside), or both contiguous. The ops pair the elements of one index in memory order,
   so tensors that store their elements in different orders (a channels_last param and a
   contiguous grad) would be paired wrongly.
6. Chunks: no tensor spans more than 2**31 - 1 chunks of ``chunk_size`` elements, nor, for the
   l2norm family, all of them together: the CUDA launcher numbers chunks in int32.
7. Across lists: the fused steps (sgd, adam, lamb) accept some dtype combinations only
   (``check_fused_dtypes``) and no two of their tensors share a byte; an output of scale or axpby
   (the last list) shares memory only with the inputs at its own index, exactly (in place).
8. Writes: ``noop_flag`` is on the tensors' device; no written tensor (the flag, then the written
   lists in order) is an inference tensor outside ``torch.inference_mode()`` (``RuntimeError``).
9. The coefficients that may be tensors, in signature order (``scale``, ``a``, ``b``, lamb's
   ``global_grad_norm``, ``inv_scale``): a float (rule 4) or a 1-element float32 tensor on the
   tensors' device or the CPU (read on the host there: no synchronisation). Adam's ``step``, the
   step number after this update, is a whole number from 1 to 2**31 - 1: a Python int, or a
   1-element int32, int64 or float32 tensor on the tensors' device, checked like an int's on the
   CPU; elsewhere by the kernel (a host read would synchronise): out of range, the call is a
   skipped step (nothing is written) that sets ``noop_flag``.

``update_scale_hysteresis`` takes no lists. Its rules, in order: ``current_scale``,
``growth_tracker``, ``hysteresis_tracker`` and ``found_inf`` are 1-element float32, int32, int32
and float32 tensors on the device of ``current_scale``; ``growth_factor`` and ``backoff_factor``
are floats; ``growth_interval`` and ``hysteresis`` ints within int32 (the trackers' dtype);
``min_scale`` and ``max_scale`` None, an infinity or a float within fp32's range; ``inv_scale`` and
``should_skip`` None or 1-element float32 tensors on that device; then rule 8 for the tensors it
writes, in argument order.

Rule 9 and ``update_scale_hysteresis``'s checks are in ``contract_coefficients``.

Arguments that are not tensors where tensors are due: ``TypeError`` on both paths (amp_C's is
pybind11's message). amp_C also runs on CPU and CUDA tensors only.
"""
from __future__ import annotations

import collections
import itertools
import operator

import torch

from . import remainder

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The chunk size amp itself passes to every op (Apex's): its kernels' common case.
AMP_CHUNK_SIZE = 2048 * 32
INT32_MAX = 2**31 - 1
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _where(k, i, names):
    return f"tensor_lists[{k}][{i}] ({names[k]})"


def _type_name(value):
    return type(value).__name__


# ---- rules 1 to 4: the call ------------------------------------------------------------------------


def _check_chunk_size(op, chunk_size):
    """Rule 1. The first two messages name no op: amp_C's binding gives them while it converts."""
    if isinstance(chunk_size, bool) or not hasattr(type(chunk_size), "__index__"):
        raise TypeError(f"chunk_size must be an int, got {_type_name(chunk_size)}")
    value = operator.index(chunk_size)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"chunk_size must be a positive int below 2**63, got {value}")
    if value <= 0:
        raise ValueError(f"{op}: chunk_size must be positive, got {value}")


def _check_lists(op, tensor_lists, forms):
    """Rule 2; returns the names of the lists."""
    expected = " or ".join(f"{len(names)} [{', '.join(names)}]" for names in forms)
    if not isinstance(tensor_lists, (list, tuple)):
        raise TypeError(f"{op} expects {expected} tensor lists, got a {_type_name(tensor_lists)}")
    fitting = [names for names in forms if len(names) == len(tensor_lists)]
    names = fitting[0] if fitting else None
    if len(fitting) > 1 and _holds_remainders(tensor_lists[-1]):
        names = fitting[-1]
    if names is None:
        raise ValueError(f"{op} expects {expected} tensor lists, got {len(tensor_lists)}")
    lengths = [len(tensors) for tensors in tensor_lists]
    for k, length in enumerate(lengths):
        if length != lengths[0]:
            raise ValueError(
                f"{op}: tensor_lists[{k}] has {length} tensors but tensor_lists[0] has "
                f"{lengths[0]} (lengths {lengths}); every list needs one tensor per index"
            )
    return names


def _holds_remainders(tensors):
    """Whether a last list is remainders: its first tensor is int16."""
    return len(tensors) > 0 and isinstance(tensors[0], torch.Tensor) and tensors[0].dtype == torch.int16


def _check_flag(op, noop_flag):
    """Rule 3."""
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"{op}: noop_flag must be a tensor, got {_type_name(noop_flag)}")
    if noop_flag.numel() != 1 or noop_flag.dtype not in (torch.int32, torch.float32):
        raise ValueError(
            f"{op}: noop_flag must be a 1-element int32 or float32 tensor, got {noop_flag.dtype} "
            f"with {noop_flag.numel()} elements"
        )


def check_call(op, chunk_size, noop_flag, tensor_lists, forms):
    """Rules 1 to 3; returns the names of the lists. ``forms`` holds the accepted name tuples."""
    _check_chunk_size(op, chunk_size)
    names = _check_lists(op, tensor_lists, forms)
    _check_flag(op, noop_flag)
    return names


def real(op, name, value):
    """Rule 4 for a float: ``value`` as a Python float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a Python float, got {_type_name(value)}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{op}: {name} is beyond a float's range, got {value}") from None


def integer(op, name, value):
    """Rule 4 for an int."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be a Python int, got {_type_name(value)}")
    return int(value)


def switch(op, name, value):
    """Rule 4 for an on/off int (Apex's ``bias_correction``): a Python int or bool."""
    if not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be a Python int or bool, got {_type_name(value)}")
    return value != 0


def check_adam_mode(op, mode):
    mode = integer(op, "mode", mode)
    if mode not in (0, 1):
        raise ValueError(f"{op}: mode must be 0 (Adam, L2 weight decay) or 1 (AdamW), got {mode}")


# ---- rules 5 and 6: each tensor --------------------------------------------------------------------


def is_dense(t):
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


def same_layout(t, ref):
    """Whether ``t`` stores its elements in the order ``ref`` stores its own (equal numels)."""
    if t.numel() == 0:
        return True
    if t.shape != ref.shape:
        return t.is_contiguous() and ref.is_contiguous()
    return all(a == b for size, a, b in zip(t.shape, t.stride(), ref.stride()) if size > 1)


def _check_remainders(op, t, ref, where, device):
    """Rule 5 for a tensor of remainders: int16, on its device, 4-byte aligned, contiguous and
    packed for ``ref``'s numel."""
    if t.dtype != torch.int16:
        raise ValueError(f"{op}: {where} has dtype {t.dtype}; remainders are int16")
    if t.device != device:
        raise ValueError(
            f"{op}: {where} is on {t.device} but tensor_lists[0][0] is on {device}; group the "
            "tensors by device and call once per device"
        )
    expected = remainder.packed_numel(ref.numel())
    if t.data_ptr() % 4:
        raise ValueError(
            f"{op}: {where} starts at an address that is not a multiple of 4 bytes; its carry words "
            "are int32: give the remainders a tensor of their own (remainder.new_remainders)"
        )
    if t.numel() != expected or not t.is_contiguous():
        raise ValueError(
            f"{op}: {where} has {t.numel()} elements{'' if t.is_contiguous() else ' (not contiguous)'}; "
            f"the remainders of {ref.numel()} elements are a contiguous int16 tensor of {expected} "
            "(amp._pytorch_ops.remainder.packed_numel)"
        )


def _check_tensor(op, tensor_lists, names, k, i):
    t, first, ref = tensor_lists[k][i], tensor_lists[k][0], tensor_lists[0][i]
    where = _where(k, i, names)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {where} is a {_type_name(t)}, not a tensor")
    if names[k] == "remainders":
        return _check_remainders(op, t, ref, where, tensor_lists[0][0].device)
    if i == 0 and t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{op}: {where} has dtype {t.dtype}; only float32, float16 and bfloat16 are supported"
        )
    if t.dtype != first.dtype:
        raise ValueError(
            f"{op}: {where} has dtype {t.dtype} but tensor_lists[{k}][0] has {first.dtype}; a list "
            "must hold one dtype: group the tensors by dtype and call once per group"
        )
    device = tensor_lists[0][0].device
    if t.device != device:
        raise ValueError(
            f"{op}: {where} is on {t.device} but tensor_lists[0][0] is on {device}; group the "
            "tensors by device and call once per device"
        )
    if t.numel() != ref.numel():
        raise ValueError(
            f"{op}: {where} has {t.numel()} elements but {_where(0, i, names)} has {ref.numel()}; "
            "the tensors of one index must have the same numel"
        )
    if t.layout != torch.strided or not is_dense(t):
        raise ValueError(
            f"{op}: {where} is not dense (a slice with gaps, or an expanded view?); pass "
            "t.contiguous() instead"
        )
    if k > 0 and not same_layout(t, ref):
        raise ValueError(
            f"{op}: {where} stores its elements in another order than {_where(0, i, names)} "
            f"(shape {list(t.shape)}, strides {list(t.stride())} against shape {list(ref.shape)}, "
            f"strides {list(ref.stride())}); the ops pair the elements of one index in memory "
            "order, so give both one memory format (.contiguous() on both, or both "
            "torch.channels_last)"
        )


def _chunks(numel, chunk_size):
    return 0 if numel == 0 else (numel - 1) // chunk_size + 1


def _check_chunk_counts(op, chunk_size, tensors, names, in_all):
    total = 0
    for i, t in enumerate(tensors):
        chunks = _chunks(t.numel(), chunk_size)
        if chunks > INT32_MAX:
            raise ValueError(
                f"{op}: {_where(0, i, names)} has {t.numel()} elements, {chunks} chunks of "
                f"chunk_size {chunk_size}, but the CUDA launcher numbers chunks in int32 (at most "
                f"{INT32_MAX} per tensor); pass a larger chunk_size"
            )
        total += chunks
    if in_all and total > INT32_MAX:
        raise ValueError(
            f"{op}: the tensors make {total} chunks of chunk_size {chunk_size} in all, but the "
            f"CUDA launcher numbers them in int32 (at most {INT32_MAX}); pass a larger chunk_size "
            "or fewer tensors per call"
        )


def check_tensors(op, chunk_size, tensor_lists, names, chunks_in_all=False):
    """Rules 5 and 6; returns the tensors' device, or None when the lists hold no tensors.

    ``chunks_in_all``: the chunks of all tensors are numbered together (the l2norm family).
    """
    if len(tensor_lists[0]) == 0:
        return None
    for k, tensors in enumerate(tensor_lists):
        for i in range(len(tensors)):
            _check_tensor(op, tensor_lists, names, k, i)
    if names[-1] == "remainders" and operator.index(chunk_size) % 32:
        raise ValueError(f"{op}: chunk_size must be a multiple of 32 with remainders (a carry word "
                         f"holds 32 elements' bits), got {operator.index(chunk_size)}")
    _check_chunk_counts(op, operator.index(chunk_size), tensor_lists[0], names, chunks_in_all)
    return tensor_lists[0][0].device


# ---- rule 7: across lists -------------------------------------------------------------------------

# A tensor's bytes, and where it sits in tensor_lists; sorts by address first.
_Range = collections.namedtuple("_Range", ["begin", "end", "list", "index"])


def _ranges(tensor_lists):
    return sorted(
        _Range(t.data_ptr(), t.data_ptr() + t.nbytes, k, i)
        for k, tensors in enumerate(tensor_lists)
        for i, t in enumerate(tensors)
        if t.nbytes > 0
    )


def _disjoint(tensor_lists):
    """The common case, cheaply: no two tensors share a byte (a tensor that appears at the same
    index of several lists, in place, counts once). Anything else gets the full walk."""
    spans = sorted({(id(t), i): (t.data_ptr(), t.nbytes)
                    for tensors in tensor_lists for i, t in enumerate(tensors)}.values())
    end = 0
    for begin, size in spans:
        if size and begin < end:
            return False
        end = max(end, begin + size)
    return True


def check_output_overlap(op, tensor_lists):
    """Rule 7 for scale and axpby, whose outputs (the last list) are written while every list is
    read. Both implementations walk the byte ranges alike, so both name the same pair: ranges
    sorted, identical ranges grouped, each group checked against the earlier ones."""
    if _disjoint(tensor_lists):
        return
    out_list = len(tensor_lists) - 1

    def refuse(a, b):
        raise ValueError(
            f"{op}: tensor_lists[{a.list}][{a.index}] overlaps tensor_lists[{b.list}][{b.index}] in "
            "memory; an output may share memory only with its own inputs at the same index "
            "(in place), so pass separate tensors"
        )

    widest = widest_out = None  # the earlier group reaching furthest; the same among outputs
    for _, members in itertools.groupby(_ranges(tensor_lists), key=lambda r: (r.begin, r.end)):
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


def check_fused_dtypes(op, tensor_lists, names):
    """Rule 7 for sgd, adam and lamb: every list one dtype; fp16/bf16 grads with fp32 params and state
    (adam's 4 lists); with a model-copy list, grads of any dtype, fp32 weights and state and an
    fp16/bf16 copy."""
    dtypes = [tensors[0].dtype for tensors in tensor_lists]
    if names[-1] == "remainders":
        ok = dtypes[1] == torch.bfloat16 and all(d == torch.float32 for d in dtypes[2:-1])
        if not ok:
            combination = ", ".join(f"{name} {str(d).replace('torch.', '')}" for name, d in zip(names, dtypes))
            raise ValueError(f"{op}: unsupported dtype combination ({combination}); with remainders the "
                             "weights are bfloat16 and the state float32 (the grads: any)")
        return
    has_copies = names[-1] == "model_copies"
    grads, masters = dtypes[0], dtypes[1:len(dtypes) - has_copies]
    fp32_masters = all(d == torch.float32 for d in masters)
    is_adam = op in ("multi_tensor_adam", "multi_tensor_lamb")  # also low-precision grads, fp32 state
    if has_copies:
        ok = fp32_masters and dtypes[-1] in _LOW_PRECISION
    elif is_adam and grads in _LOW_PRECISION and fp32_masters:
        ok = True
    else:
        ok = all(d == grads for d in dtypes)
    if not ok:
        combination = ", ".join(f"{name} {str(d).replace('torch.', '')}"
                                for name, d in zip(names, dtypes))
        mixed = ", fp16/bf16 grads with fp32 params and state" if is_adam else ""
        raise ValueError(
            f"{op}: unsupported dtype combination ({combination}); supported: one dtype for every "
            f"list{mixed}, or with a model_copies list fp32 weights and state and fp16/bf16 copies"
        )


def check_no_shared_memory(op, tensor_lists):
    """Rule 7 for sgd, adam and lamb: every list but the grads is written, so no two tensors may share a
    byte. Names the first overlapping pair in address order."""
    ranges = _ranges(tensor_lists)
    for earlier, later in zip(ranges, ranges[1:]):
        if later.begin < earlier.end:
            raise ValueError(
                f"{op}: tensor_lists[{earlier.list}][{earlier.index}] and "
                f"tensor_lists[{later.list}][{later.index}] share memory; every grad, weight, "
                "state and model-copy tensor must be a separate tensor"
            )


# ---- rule 8: writes -------------------------------------------------------------------------------


def check_writable(op, t, name):
    # torch would refuse this in-place update only after its kernel has run.
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{op}: {name} is an inference tensor, which cannot be updated in place outside "
            "torch.inference_mode(); pass a tensor created outside inference mode (or a clone)"
        )


def check_writes(op, noop_flag, device, tensor_lists, names, first_written):
    """Rule 8: the flag on ``device``, then every tensor the op writes: the flag, then the lists
    from ``first_written`` on."""
    if noop_flag.device != device:
        raise ValueError(
            f"{op}: noop_flag is on {noop_flag.device} but the tensors are on {device}; create the "
            "flag on the tensors' device"
        )
    check_writable(op, noop_flag, "noop_flag")
    for k in range(first_written, len(tensor_lists)):
        for i, t in enumerate(tensor_lists[k]):
            check_writable(op, t, _where(k, i, names))


def check_outputs(op, noop_flag, device, tensor_lists, names):
    """Rules 7 and 8 for scale and axpby, which write their last list."""
    check_output_overlap(op, tensor_lists)
    check_writes(op, noop_flag, device, tensor_lists, names, first_written=len(tensor_lists) - 1)


def check_fused_tensors(op, chunk_size, noop_flag, tensor_lists, names):
    """Rules 5 to 8 for sgd, adam and lamb, which write every list but the grads; returns the tensors'
    device, or None when the lists hold no tensors."""
    device = check_tensors(op, chunk_size, tensor_lists, names)
    if device is not None:
        check_fused_dtypes(op, tensor_lists, names)
        check_no_shared_memory(op, tensor_lists)
        check_writes(op, noop_flag, device, tensor_lists, names, first_written=1)
    return device

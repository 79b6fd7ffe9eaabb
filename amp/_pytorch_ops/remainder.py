"""fp32 masters kept as bf16 weights plus 16-bit remainders (``master_weights="remainder"``).

A bf16 value is the top half of an fp32 one. The model's bf16 weight is its fp32 master rounded
to nearest even, exactly what ``master.to(torch.bfloat16)`` gives; beside it amp keeps the
master's low 16 bits and one carry bit, set where the rounding went up (the master's top half is
then the weight's minus one, counting in bit patterns, which order values of one sign by
magnitude). Weight, low half and carry give back the master bit for bit. The carry bit cannot be
left out: round to nearest even sends 65,537 fp32 values to each even bf16 value (both halfway
cases included), one more than 16 bits can tell apart. A NaN master comes back as a NaN (its
weight is PyTorch's NaN, low half and carry 0, whatever its payload, which devices make differently).

The remainders of an n-element tensor are one int16 tensor of ``packed_numel(n)`` elements: the n
low halves, then one int16 of padding when n is odd, then ``ceil(n / 32)`` int32 words of carry
bits (bit j of word w belongs to element 32 w + j). ``amp_C`` (``amp_C_host_device.h``,
``master_from_parts`` / ``master_to_parts``) reads and writes the same layout.
"""
import contextlib

import torch

from .storage import flat

__all__ = ["packed_numel", "carry_offset", "new_remainders", "rebuild", "split", "stepped_as_masters",
           "each_tensor_if_remainders"]


def packed_numel(n):
    """int16 elements that hold the remainders of ``n`` elements: low halves, padding, carry words."""
    return carry_offset(n) + 2 * ((n + 31) // 32)


def carry_offset(n):
    """Where the carry words begin, in int16 elements (even: the words are 4-byte aligned)."""
    return 2 * ((n + 1) // 2)


def new_remainders(n, device):
    """Zeroed remainders of ``n`` elements: a master equal to its (widened) bf16 weight."""
    return torch.zeros(packed_numel(n), dtype=torch.int16, device=device)


def _parts(packed, n):
    return packed[:n], packed[carry_offset(n):].view(torch.int32)


# Elements per slice of ``rebuild`` and ``split`` (a multiple of 32): their int64 temporaries stay
# small, so that turning a model's masters into remainders never holds more than a slice's worth
# (large freed temporaries would also leave the CPU allocator holding memory it does not give back).
_SLICE = 2**16


def _slices(n):
    return ((begin, min(begin + _SLICE, n)) for begin in range(0, n, _SLICE))


def _bit_positions(device):
    return torch.arange(32, dtype=torch.int64, device=device)


def rebuild(weight, packed):
    """The fp32 masters of a bf16 ``weight`` and its ``packed`` remainders, a new tensor laid out as
    ``weight`` (any dense layout: elements pair up in storage order)."""
    n = weight.numel()
    low, words = _parts(packed, n)
    out = torch.empty(n, dtype=torch.float32, device=weight.device)
    weight_shape, weight_strides, weight = weight.shape, weight.stride(), flat(weight)
    for begin, end in _slices(n):
        w = weight[begin:end]
        carry = (words[begin // 32:(end + 31) // 32].to(torch.int64).unsqueeze(1) >> _bit_positions(w.device)) & 1
        top = w.view(torch.int16).to(torch.int64) & 0xFFFF
        bits = ((top - carry.reshape(-1)[:end - begin]) << 16) | (low[begin:end].to(torch.int64) & 0xFFFF)
        bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
        # A NaN weight was a NaN master; its carry and low half are not to be trusted.
        out[begin:end] = torch.where(torch.isnan(w), w.to(torch.float32), bits.view(torch.float32))
    return out.as_strided(weight_shape, weight_strides)


# PyTorch's NaN as bf16 bits (c10's rounding; amp_C writes it too, where torch's vectorised CPU
# conversion gives another NaN).
_BF16_NAN = 0x7FC0


def split(master, weight, packed):
    """Write an fp32 ``master`` as its bf16 ``weight`` (rounded to nearest even; both dense, laid out
    alike) and ``packed`` remainders, both in place; returns nothing."""
    n = master.numel()
    master, weight = flat(master), flat(weight)
    low_out, words_out = _parts(packed, n)
    for begin, end in _slices(n):
        m = master[begin:end]
        nan = torch.isnan(m)
        rounded = m.to(torch.bfloat16).view(torch.int16).masked_fill_(nan, _BF16_NAN)
        bits = m.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        carry = ((rounded.to(torch.int64) & 0xFFFF) != bits >> 16) & ~nan
        low = (bits & 0xFFFF).masked_fill_(nan, 0)  # NaN: no payload kept
        low_out[begin:end] = torch.where(low >= 2**15, low - 2**16, low)
        padded = torch.zeros((end - begin + 31) // 32 * 32, dtype=torch.int64, device=m.device)
        padded[:end - begin] = carry
        words = (padded.view(-1, 32) << _bit_positions(m.device)).sum(dim=1)
        words_out[begin // 32:(end + 31) // 32] = torch.where(words >= 2**31, words - 2**32, words)
        weight[begin:end] = rounded.view(torch.bfloat16)
    if carry_offset(n) > n:
        packed[n] = 0


@contextlib.contextmanager
def stepped_as_masters(lists, keep_old):
    """``lists`` of a fused step with remainders (``[grads, weights, *state, remainders]``) as the
    model-copy form ``[grads, masters, *state, weights]`` over rebuilt fp32 masters, laid out as the
    weights; on exit the stepped masters are split back into weights and remainders (not where
    ``keep_old``, the noop flag as a 0-dim bool tensor, is set: see ``exact.store``; with None every
    master is split back, and one a skipped step left alone gives the same bits again)."""
    grads, weights, *state, packed = lists
    masters = [rebuild(w, p) for w, p in zip(weights, packed)]
    yield [grads, masters, *state, weights]
    for master, weight, remainders in zip(masters, weights, packed):
        if keep_old is None:
            split(master, weight, remainders)
            continue
        new_weight, new_remainders = torch.empty_like(weight), torch.empty_like(remainders)
        split(master, new_weight, new_remainders)
        torch.where(keep_old, weight, new_weight, out=weight)
        torch.where(keep_old, remainders, new_remainders, out=remainders)


def each_tensor_if_remainders(names, lists, keep_old, update):
    """``update(lists)`` for a fused step's flat ``lists`` (named ``names``); with remainders, one
    tensor at a time over its rebuilt master (at most one tensor's fp32 master exists at once)."""
    if names[-1] != "remainders":
        return update(lists)
    for index in range(len(lists[0])):
        with stepped_as_masters([[tensors[index]] for tensors in lists], keep_old) as one:
            update(one)

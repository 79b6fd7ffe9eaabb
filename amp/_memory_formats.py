"""The multi-tensor ops on tensors of one index stored in different memory formats.

The ops pair the elements of one index in memory order, so they refuse tensors that store them in
different orders (contract rule 5, ``amp._pytorch_ops.contract``). amp itself can hand such tensors
to an op: a ``.grad`` that the user assigned in another memory format than its param's, a model
made channels_last after ``amp.initialize`` (its fp32 masters keep the format they were made
with), optimizer state loaded from a checkpoint of a model in another format. So when an op of
``amp.multi_tensor_apply`` refuses a call, it asks ``restaged`` for the same call with each such
tensor replaced by a copy in the memory format of its index's reference tensor (the first list
the op writes: the outputs of scale and axpby, the params of sgd, adam and lamb), and runs that, copying
written copies back. Correct at the cost of a copy, and free on the common path: the retry follows
a refusal, and a refused call has written nothing.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from amp._pytorch_ops import contract

__all__ = ["restaged", "write_back"]

# The first list each op writes: its tensors are the references that the others are laid out as.
_REFERENCE_LIST = {"multi_tensor_scale": 1, "multi_tensor_axpby": 2, "multi_tensor_sgd": 1,
                   "multi_tensor_adam": 1, "multi_tensor_lamb": 1}

#: (original, copy) pairs whose copy the op writes and which ``write_back`` copies back.
WriteBack = List[Tuple[torch.Tensor, torch.Tensor]]


def _restageable(t: object, ref: object) -> bool:
    """Whether ``t`` is ``ref``'s tensor stored in another order: the same shape and device,
    dense, and only its memory format differs (anything else is the op's to refuse)."""
    return (isinstance(t, torch.Tensor) and isinstance(ref, torch.Tensor)
            and t.layout == torch.strided and t.shape == ref.shape and t.device == ref.device
            and contract.is_dense(t) and contract.is_dense(ref) and not contract.same_layout(t, ref))


def restaged(op: str, tensor_lists: Sequence[Sequence[torch.Tensor]]
             ) -> Optional[Tuple[List[List[torch.Tensor]], WriteBack]]:
    """``(tensor_lists, write_back)`` with every tensor stored in another order than its index's
    reference replaced by a copy laid out as the reference; None when there is none (the op
    refused the call for another reason, which it will give again)."""
    reference = _REFERENCE_LIST.get(op)
    if (reference is None or not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) <= reference
            or len({len(tensors) for tensors in tensor_lists}) != 1):
        return None
    lists = [list(tensors) for tensors in tensor_lists]
    staged = False
    write: WriteBack = []
    for i, ref in enumerate(tensor_lists[reference]):
        for k, tensors in enumerate(lists):
            original = tensors[i]
            if _restageable(original, ref):
                with torch.no_grad():
                    tensors[i] = torch.empty_like(ref, dtype=original.dtype).copy_(original)
                staged = True
                if k > reference:  # the fused steps' state and copies
                    write.append((original, tensors[i]))
    if not staged:
        return None
    if write:
        # The copies hide their originals from the op's check that no two tensors share memory.
        contract.check_no_shared_memory(op, tensor_lists)
    return lists, write


def write_back(write: WriteBack) -> None:
    """Copy what the op wrote into the copies back into their originals."""
    with torch.no_grad():
        for original, copy in write:
            original.copy_(copy)

"""Which low-precision params a ``torch.distributed`` call wrote: c10d does not bump their version.

Under master weights (O2/O5) each step first takes into an fp32 master the value of its
low-precision param when something other than amp wrote the param
(``_controller.masters.Masters.refresh_written_elsewhere``). PyTorch's version counter shows most
such writes, but a collective writes the memory directly: ranks synced with ``dist.broadcast(p, 0)``
or ``dist.broadcast(p.data, 0)`` after ``initialize`` kept their own masters and diverged.

So the calls of ``torch.distributed`` that write into their first argument are wrapped, once, when
the first master-weight optimizer is set up. A call made with a tensor that shares its storage with
a watched param (``p.data`` does) marks that param written, and the next step takes the param's
value into its master. Every rank makes the call, so every rank marks the same params and does the
same, with no extra communication: the source rank of a broadcast too, which drops its masters'
extra fp32 bits because the other ranks cannot have them.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ._master_weights import LOW_PRECISION_DTYPES

__all__ = ["WRITING_CALLS", "group_size_of_write", "take_written", "watch"]

# The calls that write into their first argument (a tensor or a list of tensors). send and isend only
# read it; they mark the sender's params because the receiver's recv marks its own.
WRITING_CALLS = ("broadcast", "all_reduce", "reduce", "scatter", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                 "send", "recv", "isend", "irecv")

# owner (one optimizer's masters) -> storage addresses of its watched params;
# owner -> {storage address written since its last step: size of the largest group that wrote it}.
_watched: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_written: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()
_installed = False


def _storage(tensor):
    return tensor.untyped_storage().data_ptr()


def watch(owner, params):
    """Mark ``params`` (of ``owner``) written when a torch.distributed call writes them."""
    _watched.setdefault(owner, set()).update(_storage(param) for param in params)
    if not _installed:
        _wrap_writing_calls()


def take_written(owner):
    """``owner``'s params written by a call since the last take (usually none), for ``group_size_of_write``."""
    if not _written:
        return {}
    return _written.pop(owner, {})


def group_size_of_write(param, written):
    """The size of the largest process group whose call wrote ``param`` (``written``: ``take_written``'s); 0: none.

    In a group of one there is no other rank to agree with: such a write is treated like one that
    bumped the version (the master is kept if it still rounds to the param).
    """
    return written.get(_storage(param), 0)


def _note_written(tensors, group):
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    elif not isinstance(tensors, (list, tuple)):
        return
    storages = set()
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dtype in LOW_PRECISION_DTYPES:
            try:
                storages.add(_storage(tensor))
            except (RuntimeError, NotImplementedError):
                pass  # no storage of its own (a sparse tensor, a DTensor): not a watched param's
    size = None
    for owner, watched in list(_watched.items()):
        hit = storages & watched
        if hit:
            size = dist.get_world_size(group) if size is None else size
            marks = _written.setdefault(owner, {})
            for storage in hit:
                marks[storage] = max(marks.get(storage, 0), size)


def _noting_writes(call):
    names = list(inspect.signature(call).parameters)
    group_index = names.index("group") if "group" in names else len(names)

    @functools.wraps(call)
    def noting(*args, **kwargs):
        result = call(*args, **kwargs)
        if _watched:
            group = kwargs.get("group", args[group_index] if len(args) > group_index else None)
            _note_written(args[0] if args else kwargs.get(names[0]), group)
        return result
    return noting


def _wrap_writing_calls():
    """Wrap ``WRITING_CALLS`` in ``torch.distributed`` (and ``distributed_c10d``, where they live), once."""
    global _installed
    _installed = True
    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    for name in WRITING_CALLS:
        call = getattr(dist, name, None)
        if call is None:
            continue
        wrapped = _noting_writes(call)
        setattr(dist, name, wrapped)
        if getattr(c10d, name, None) is call:
            setattr(c10d, name, wrapped)

"""``DistributedDataParallel`` with Apex's constructor, on top of torch's DDP; Apex's ``Reducer``
and its flat collective helper.

Apex-era scripts build ``apex.parallel.DistributedDataParallel(model, message_size=...,
delay_allreduce=True, ...)``. Every argument that has a meaning in torch's DDP is mapped onto it
(the bucket size, the all-reduce in fp32, the gradient pre-division and averaging, through a
communication hook); those that cannot be honoured are refused before anything is built, with
the way to get the same effect.
"""
from __future__ import annotations

import numbers
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call", "split_by_type", "extract_tensors"]

_MB = 2 ** 20

# (argument, value that needs nothing, why it is refused and what to do instead)
_REFUSED = (
    ("shared_param", None, "Apex itself deprecated it: pass delay_allreduce=True instead."),
    ("allreduce_trigger_params", None,
     "torch's DDP starts an all-reduce when a bucket of gradients is ready, not on chosen "
     "parameters; size the buckets with message_size, or pass delay_allreduce=True."),
    ("retain_allreduce_buffers", False,
     "torch's DDP does not hand out its flat all-reduce buffers; read the averaged gradients from "
     "param.grad (pass gradient_as_bucket_view=True to make them views of the buckets)."),
    ("num_allreduce_streams", 1,
     "torch's DDP overlaps its all-reduces with the backward pass on its own stream; drop the "
     "argument."),
    ("allreduce_communicators", None,
     "torch's DDP all-reduces over one process group: pass process_group=... instead."),
    ("gradient_average_split_factor", None,
     "Apex itself deprecated it: pass gradient_predivide_factor instead."),
    ("prof", False, "Apex's NVTX ranges are not reproduced: profile with torch.profiler instead."),
)


class _HookOptions:
    """What the communication hook needs: the group and Apex's scaling and precision choices."""

    def __init__(self, process_group: dist.ProcessGroup | None, allreduce_always_fp32: bool,
                 gradient_average: bool, gradient_predivide_factor: float) -> None:
        self.process_group = process_group
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor


def _apex_allreduce_hook(options, bucket):
    # type: (_HookOptions, dist.GradBucket) -> torch.futures.Future[torch.Tensor]
    # A type comment, not annotations: DDP's register_comm_hook refuses a hook whose annotations are
    # not the objects dist.GradBucket and Future[Tensor], and this module's annotations are strings.
    """Apex's all-reduce: divide by the pre-divide factor, sum (in fp32 if asked), then scale so
    the result is the mean (``gradient_average``) or the sum divided by the pre-divide factor."""
    grads = bucket.buffer()
    group = options.process_group if options.process_group is not None else dist.group.WORLD
    reduced = grads.float() if options.allreduce_always_fp32 else grads
    predivide = options.gradient_predivide_factor
    if predivide != 1:
        reduced.div_(predivide)
    post_factor = predivide / dist.get_world_size(group) if options.gradient_average else 1.0

    def finish(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = future.value()[0]
        if post_factor != 1:
            total.mul_(post_factor)
        if total is not grads:
            grads.copy_(total)
        return grads

    return dist.all_reduce(reduced, group=group, async_op=True).get_future().then(finish)


def _is_number(value: object, kind: type) -> bool:
    """``isinstance(value, kind)`` for a ``numbers`` class, bools excluded. A function, not inline:
    type checkers take an int (a float) for never a numbers.Integral (a numbers.Real)."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"DistributedDataParallel's {name} must be True or False, got {value!r}.")


def _element_size(module: torch.nn.Module) -> int:
    sizes = [param.element_size() for param in module.parameters() if param.requires_grad]
    return max(sizes, default=4)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DDP, built from Apex's arguments.

    Args (Apex's; the defaults are Apex's):
        module: the model, after ``amp.initialize``.
        message_size (int): gradient elements per all-reduce bucket (torch's ``bucket_cap_mb``,
            counted in the module's widest trainable parameter dtype). Default 10,000,000.
        delay_allreduce (bool): all-reduce once, after the whole backward pass (one bucket
            holding every gradient).
        allreduce_always_fp32 (bool): all-reduce low-precision gradients in fp32.
        gradient_average (bool): divide the summed gradients by the world size (default True).
        gradient_predivide_factor (float): divide before the all-reduce by this factor, and after
            it by ``world_size / factor`` (with ``gradient_average``), which keeps fp16 sums in
            range.
        shared_param, allreduce_trigger_params, retain_allreduce_buffers, num_allreduce_streams,
        allreduce_communicators, gradient_average_split_factor, prof: accepted only at their
            defaults; any other value raises with what to do instead.
        **ddp_kwargs: further keyword arguments for torch's DDP (``process_group``,
            ``find_unused_parameters``, ``gradient_as_bucket_view``, ...), except ``bucket_cap_mb``
            (use ``message_size``).

    ``convert_syncbn_model`` and ``LARC`` (also in ``amp.parallel``) complete Apex's module.
    """

    def __init__(self, module: torch.nn.Module, message_size: int = 10000000, delay_allreduce: bool = False,
                 shared_param: object = None, allreduce_trigger_params: object = None,
                 retain_allreduce_buffers: bool = False, allreduce_always_fp32: bool = False,
                 num_allreduce_streams: int = 1, allreduce_communicators: object = None,
                 gradient_average: bool = True, gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: object = None, prof: bool = False,
                 **ddp_kwargs: Any) -> None:
        given = dict(shared_param=shared_param, allreduce_trigger_params=allreduce_trigger_params,
                     retain_allreduce_buffers=retain_allreduce_buffers,
                     num_allreduce_streams=num_allreduce_streams,
                     allreduce_communicators=allreduce_communicators,
                     gradient_average_split_factor=gradient_average_split_factor, prof=prof)
        for name, default, advice in _REFUSED:
            value = given[name]
            if not (value is default or (type(value) is type(default) and value == default)):
                raise ValueError(f"apex.parallel.DistributedDataParallel's {name}={value!r} cannot be "
                                 f"honoured on torch's DDP: {advice}")
        if not _is_number(message_size, numbers.Integral) or message_size < 1:
            raise ValueError(f"message_size must be a positive number of gradient elements, got {message_size!r}.")
        for name, value in (("delay_allreduce", delay_allreduce),
                            ("allreduce_always_fp32", allreduce_always_fp32),
                            ("gradient_average", gradient_average)):
            _check_flag(name, value)
        factor = gradient_predivide_factor
        if not _is_number(factor, numbers.Real) or not 0 < factor < float("inf"):
            raise ValueError(f"gradient_predivide_factor must be a positive finite number, got {factor!r}.")
        if "bucket_cap_mb" in ddp_kwargs:
            raise ValueError("pass message_size (gradient elements per bucket), not bucket_cap_mb, to "
                             "apex.parallel.DistributedDataParallel; or use torch's DDP directly.")

        if delay_allreduce:
            # One bucket holds every gradient, so the single all-reduce waits for the whole backward.
            total = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            bucket_cap_mb = total / _MB + 1
        else:
            bucket_cap_mb = message_size * _element_size(module) / _MB
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(factor)
        # torch's own all-reduce already averages; the hook is only needed to do something else.
        if allreduce_always_fp32 or not gradient_average or factor != 1:
            options = _HookOptions(ddp_kwargs.get("process_group"), allreduce_always_fp32,
                                   gradient_average, float(factor))
            self.register_comm_hook(options, _apex_allreduce_hook)


def split_by_type(tensors: Iterable[torch.Tensor]) -> OrderedDict[str, list[torch.Tensor]]:
    """Apex's grouping: the tensors by ``tensor.type()`` (dtype and device kind), in first-seen order."""
    buckets: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def flat_dist_call(tensors: Iterable[torch.Tensor], call: Callable[..., Any],
                   extra_args: Sequence[Any] | None = None) -> None:
    """Run the collective ``call(flat, *extra_args)`` once per kind of tensor, on a flat copy of
    them, and copy the result back into ``tensors`` (Apex's helper, e.g.
    ``flat_dist_call(params, dist.broadcast, (0,))``). As in Apex, ``dist.all_reduce``'s sum is
    divided by the world size: the tensors end up averaged over the ranks.
    """
    buckets = list(split_by_type(tensors).values())
    for bucket in buckets:
        if len({t.device for t in bucket}) > 1:
            raise ValueError("flat_dist_call: tensors of one type must be on one device, got "
                             f"{sorted({str(t.device) for t in bucket})}.")
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        call(flat, *(extra_args or ()))
        if call is dist.all_reduce:
            flat /= dist.get_world_size()
        with torch.no_grad():
            for tensor, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(synced)


def extract_tensors(maybe_tensor: object, tensor_list: list[torch.Tensor]) -> None:
    """Append every tensor in ``maybe_tensor`` (a tensor, or nested iterables of them) to
    ``tensor_list``; anything else is skipped (Apex's helper)."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
    elif isinstance(maybe_tensor, Iterable) and not isinstance(maybe_tensor, (str, bytes)):
        for item in maybe_tensor:
            extract_tensors(item, tensor_list)


class Reducer:
    """All-reduce (average) gradients across the ranks when you call ``reduce()``, not during the
    backward pass as ``DistributedDataParallel`` does: e.g. once every few accumulation steps.

    Apex's class. Given a module, it broadcasts rank 0's parameters at construction (so the ranks
    start equal) and ``reduce()`` averages the gradients its parameters hold at that moment. Given
    tensors (nested iterables allowed), ``reduce()`` averages exactly those tensors: pass the
    gradient tensors themselves, and keep them (``zero_grad(set_to_none=False)``), since new
    ``.grad`` tensors are not seen.
    """

    def __init__(self, module_or_grads_list: torch.nn.Module | Iterable[Any]) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Reducer needs torch.distributed: call "
                               "torch.distributed.init_process_group(...) first.")
        self.module: torch.nn.Module | None
        self.grads: list[torch.Tensor] = []
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module = module_or_grads_list
            flat_dist_call([p.detach() for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """Average the gradients (or the tensors given) over the ranks, in place."""
        if self.module is None:
            flat_dist_call(self.grads, dist.all_reduce)
            return
        params = list(self.module.parameters())
        if params:
            # Per parameter, across the ranks: (has a gradient somewhere, lacks one somewhere).
            flags = torch.tensor([[p.grad is not None, p.grad is None] for p in params],
                                 dtype=torch.int32, device=params[0].device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if bool(flags.all(dim=1).any()):
                # Else the ranks would all-reduce flat buffers of different sizes: a hang or garbage.
                raise RuntimeError("Reducer.reduce: some parameters have a gradient on some ranks "
                                   "and none on others; give every rank the same parameters' "
                                   "gradients (or use DistributedDataParallel).")
        flat_dist_call([p.grad for p in params if p.grad is not None], dist.all_reduce)

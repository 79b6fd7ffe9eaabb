"""``SyncBatchNorm`` and ``convert_syncbn_model`` with Apex's signatures.

torch's own ``nn.SyncBatchNorm`` cannot train on CPU: its forward raises "SyncBatchNorm expected
input tensor to be on GPU" whenever it has to synchronise (training, more than one rank), and
torch's DDP refuses any CPU module holding one ("SyncBatchNorm layers only work with GPU
modules"). So this layer is a plain ``_BatchNorm`` that synchronises by itself, on any device:
two autograd-aware all-reduces per forward (the per-channel sums and counts, then the sums of
squared deviations), whose backward sums the statistics' gradients across ranks. Ranks may hold
different numbers of rows, none included; a step where no rank has a row leaves the running
statistics as they are, as torch's ``BatchNorm`` does with an empty batch. Evaluation, and a
single rank, are ordinary batch normalisation.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]


class _AllReduceSum(torch.autograd.Function):
    """A sum over the group whose backward is the sum of every rank's gradient (each rank's loss
    depends on every rank's input through the shared statistics). torch's own
    ``torch.distributed.nn.functional.all_reduce`` does the same but warns as deprecated in
    recent torch."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch normalisation whose statistics are taken over the whole process group.

    Apex's signature: ``SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True,
    track_running_stats=True, process_group=None, channel_last=False, fuse_relu=False)``.
    Inputs of any rank >= 2, as torch's, in any memory format: ``(N, C, ...)``, or with
    ``channel_last=True`` (Apex's meaning) ``(N, ..., C)``, the channels in the last dimension, as
    from a model that keeps NHWC tensors. ``fuse_relu=True`` is refused (apply ``torch.relu`` after
    the layer).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None, channel_last: bool = False,
                 fuse_relu: bool = False) -> None:
        if fuse_relu:
            raise ValueError("SyncBatchNorm(fuse_relu=True) is Apex's fused CUDA kernel, not offered: "
                             "apply torch.relu (or nn.ReLU) after the layer instead.")
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _group_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group or dist.group.WORLD)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.channel_last and input.dim() > 2:
            return self._forward_channels_first(input.movedim(-1, 1)).movedim(1, -1).contiguous()
        return self._forward_channels_first(input)

    def _forward_channels_first(self, input: torch.Tensor) -> torch.Tensor:
        if self.training and self._group_size() > 1:
            self._check_input_dim(input)
            return self._synchronised_forward(input)
        return super().forward(input)

    def _synchronised_forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self.process_group or dist.group.WORLD
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input.float()
        count = torch.tensor([x.numel() / channels], dtype=torch.float32, device=x.device)
        totals = _AllReduceSum.apply(torch.cat([x.sum(dims), count]), group)
        n = totals[channels]
        # Where no rank has a row the sums are 0: divided by 1 rather than 0 the statistics stay
        # finite (and the running ones are left as they are).
        rows = n.clamp(min=1)
        mean = totals[:channels] / rows
        view = [1, channels] + [1] * (input.dim() - 2)
        centred = x - mean.view(view)
        # Two passes (mean first) keep the variance exact where sum(x^2) - n*mean^2 would cancel.
        var = _AllReduceSum.apply((centred * centred).sum(dims), group) / rows
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n.detach())
        out = centred * torch.rsqrt(var + self.eps).view(view)
        if self.affine:
            out = out * self.weight.float().view(view) + self.bias.float().view(view)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        # With track_running_stats (the caller's condition) the buffers exist; torch types them Optional.
        assert (self.num_batches_tracked is not None and self.running_mean is not None
                and self.running_var is not None)
        self.num_batches_tracked.add_(1)  # also for an empty batch, as torch's BatchNorm counts it
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        # Decided on the device: no rows anywhere, no update (weight 0); one row, the biased variance.
        weight = (n > 0).to(self.running_mean.dtype) * factor
        unbiased = torch.where(n > 1, var * (n / (n - 1)), var)
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), weight)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), weight.to(self.running_var.dtype))


def convert_syncbn_model(module: nn.Module, process_group: dist.ProcessGroup | None = None,
                         channel_last: bool = False) -> nn.Module:
    """Return ``module`` with every BatchNorm layer replaced by a ``SyncBatchNorm`` (Apex's API).

    Weights, buffers, ``requires_grad`` and the train/eval mode are carried over; the layers share
    no storage with the originals. ``module`` itself is returned if it contains no BatchNorm.
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group, channel_last)
        floats = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
        if floats:
            converted.to(device=floats[0].device, dtype=floats[0].dtype)
        with torch.no_grad():
            if module.affine:
                converted.weight.copy_(module.weight)
                converted.bias.copy_(module.bias)
                converted.weight.requires_grad_(module.weight.requires_grad)
                converted.bias.requires_grad_(module.bias.requires_grad)
            if module.track_running_stats:
                for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                    getattr(converted, buffer).copy_(getattr(module, buffer))
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        new_child = convert_syncbn_model(child, process_group, channel_last)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def create_syncbn_process_group(group_size: int) -> dist.ProcessGroup | None:
    """The process group of ``group_size`` consecutive ranks that holds this rank, for
    ``SyncBatchNorm(process_group=...)`` / ``convert_syncbn_model``: statistics are then shared
    within groups of ``group_size`` ranks only (Apex's function). ``group_size=0`` means the whole
    world (returns None, the default group). Every rank must call it, with the same value: each
    group is created collectively.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size must be an int >= 0 (0: the whole world), got {group_size!r}.")
    if group_size == 0:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("create_syncbn_process_group needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) first.")
    world_size = dist.get_world_size()
    if world_size % group_size != 0:
        raise ValueError(f"group_size {group_size} must divide the world size {world_size}.")
    mine = None
    for start in range(0, world_size, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= dist.get_rank() < start + group_size:
            mine = group
    return mine

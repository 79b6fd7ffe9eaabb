"""The O2/O5 controller for amp's fused optimizers (``amp.optimizers``): Apex's FusedSGD contract.

The optimizer's kernel writes the rounded fp32 master into the low-precision model param itself, so
the master->model copy that follows every step elsewhere is skipped. With
``materialize_master_grads=False`` no fp32 master grads are made either: the model's fp16/bf16
grads stay where backward put them, still scaled, and the step divides the scale out inside the
kernel. What this controller then does at each ``scale_loss`` exit:

* a read-only check of the new grads (inf/NaN, or a value whose unscaling overflows fp32) sets the
  scaler's overflow flag, so the dynamic scale is updated there as before and the step is skipped
  on the device (a static scale checks nothing, as elsewhere);
* grads of several backward passes per step are brought to one common scale, the smaller of the
  new and the earlier one (``most_recent_scale``; Apex's rule): accumulating into fp16 can overflow
  where fp32 master grads would not, and such an overflow skips the step and backs the scale off
  like any other (unless an earlier pass of the same step overflowed already: then the step is
  skipped anyway, and the scale is not backed off twice for one overflow);
* fp32 model params (batch norm) are their own masters: their grads are unscaled in place, as
  without fused optimizers.

Code written for Apex reads or clips the masters' grads (``amp.master_params``) between
``scale_loss`` and ``step``; there and then the model's grads are unscaled into fp32 master grads,
and the rest of that step runs as with ``materialize_master_grads=True``.

The optimizer finds what it needs as attributes: ``_amp_model_copies`` (master -> model param),
``_amp_grads_from_model`` (whether this step reads the model's grads rather than master grads), and
Apex's ``most_recent_scale`` / ``scale_set_by_backward``.
"""
from __future__ import annotations

import torch

from ._compat import foreach_norm
from ._process_optimizer import (Phase, WithMasterWeights, _combine_flags, _put_back_grads,
                                 _stash_and_clear_grads, _unscale_models_are_masters)
from .multi_tensor_apply import multi_tensor_applier, multi_tensor_axpby, multi_tensor_scale

__all__ = ["FusedMasterWeights", "inverse"]


def inverse(scale: float | torch.Tensor) -> float | torch.Tensor:
    """``1 / scale`` as a 1-element fp32 tensor (or the float 1.0); the reciprocal is taken in fp64, as
    amp's scaler and GradScaler take it, so a fused step unscales to the same bits as their separate pass."""
    if not isinstance(scale, torch.Tensor):
        return 1.0 / float(scale) if float(scale) != 1.0 else 1.0
    return scale.detach().reshape(1).to(torch.float64).reciprocal().to(torch.float32)


def _smaller(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)


def _peak_magnitude(grads):
    """The largest magnitude in ``grads`` as a 0-dim fp32 tensor, NaN if an element is NaN.

    On the CPU ``aminmax`` per tensor reads each grad once at about a copy's speed, where
    ``_foreach_norm(inf)`` first widens it (about 12x slower on fp16); elsewhere ``_foreach_norm``
    is one launch for the whole list.
    """
    grads = [g for g in grads if g.numel() > 0]  # both would refuse an empty tensor
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if all(g.device.type == "cpu" for g in grads):
        extremes = [torch.aminmax(g) for g in grads]
        return torch.stack([torch.maximum(-low, high) for low, high in extremes]).amax().float()
    return torch.stack(foreach_norm(grads, float("inf"), dtype=torch.float32)).amax()


def _flag_non_finite(flag, grads, inv_scale):
    """Set ``flag`` (1-element fp32) if a grad is not finite or overflows fp32 once unscaled; grads are only read.

    The largest magnitude decides both: rounding is monotonic, so if it unscales to a finite value,
    every element does.
    """
    bad = torch.isfinite(_peak_magnitude(grads) * inv_scale).logical_not().to(flag.dtype).reshape(1)
    torch.maximum(flag, bad, out=flag)


class FusedMasterWeights(WithMasterWeights):
    """fp32 masters stepped by an ``amp.optimizers`` kernel that writes the model copy (see module doc)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.materialize_master_grads = bool(self.optimizer.materialize_master_grads)
        # This step's mode: materialize_master_grads, or True once amp.master_params made them.
        self.reads_master_grads = self.materialize_master_grads
        self._scratch_flags = {}

    def init_params(self, fp32_values=None):
        """As for any optimizer, then tell the optimizer which model param each master rounds into."""
        super().init_params(fp32_values)
        self._publish_model_copies()

    def add_param_group(self, new_group):
        super().add_param_group(new_group)
        self._publish_model_copies()

    def _publish_model_copies(self):
        self.optimizer._amp_model_copies = dict(zip(self.all_fp32_from_fp16_params, self.all_fp16_params))
        self._set_mode(self.reads_master_grads)

    def _set_mode(self, reads_master_grads):
        self.reads_master_grads = reads_master_grads
        self.optimizer._amp_grads_from_model = not reads_master_grads

    def prepare_master_grads(self):
        """Unscale the model's grads, which wait for step(), into fp32 master grads (Apex's state there)."""
        if self.reads_master_grads or self.phase is not Phase.UNSCALED:
            return
        models, masters = [], []
        for index, (param, master) in enumerate(zip(self.all_fp16_params, self.all_fp32_from_fp16_params)):
            if param.grad is not None:
                master.grad = self._master_grad_buffer(index, master)
                models.append(param.grad)
                masters.append(master.grad)
        if models:
            # Checked at the scale_loss exit already (an overflow skips the step): the flag is a throwaway.
            flag = torch.zeros(1, dtype=torch.float32, device=models[0].device)
            multi_tensor_applier(multi_tensor_scale, flag, [models, masters], inverse(self.optimizer.most_recent_scale))
        self._set_mode(True)

    def _check_step(self, closure):
        if self.optimizer.materialize_master_grads != self.materialize_master_grads:
            raise RuntimeError(f"{type(self.optimizer).__name__}.materialize_master_grads was changed after "
                               "amp.initialize, which reads it once. Construct the optimizer with the "
                               "value you want, then call amp.initialize.")
        super()._check_step(closure)

    def _after_step(self, copy_masters):
        """The kernel wrote the model copies: only the masters' grads and the carried scale are reset."""
        self._note_model_versions()
        for master in self.all_fp32_from_fp16_params:
            master.grad = None
        self._forget_scale()

    def _forget_scale(self):
        self.optimizer.most_recent_scale = 1.0
        self.optimizer.scale_set_by_backward = False
        self._set_mode(self.materialize_master_grads)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self._forget_scale()

    # The rest holds only without materialised master grads: the model's grads are the step's input.

    def begin_backward(self, set_aside_grads=True):
        """A ``delay_unscale`` block right after an unscaled one sets the grads aside too: they carry
        the earlier scale, which its exit may have changed."""
        if not self.reads_master_grads:
            set_aside_grads = set_aside_grads or self.phase is Phase.UNSCALED
        super().begin_backward(set_aside_grads)

    def set_grads_aside(self):
        if self.reads_master_grads:
            return super().set_grads_aside()
        if self.optimizer.scale_set_by_backward:
            _stash_and_clear_grads(self.all_fp16_params, self.all_fp16_grad_stash)
        else:
            # Left from before the last step (no zero_grad): dropped, as the masters' grads were.
            for param in self.all_fp16_params:
                param.grad = None
        _stash_and_clear_grads(self.all_fp32_from_fp32_params, self.all_fp32_from_fp32_grad_stash)

    def _restore_grads(self):
        if self.reads_master_grads:
            return super()._restore_grads()
        _put_back_grads(self.all_fp16_params, self.all_fp16_grad_stash)
        _put_back_grads(self.all_fp32_from_fp32_params, self.all_fp32_from_fp32_grad_stash)

    def unscale_grads(self, scaler):
        """Check the new low-precision grads and bring every grad to one scale; nothing is unscaled."""
        if self.reads_master_grads:
            return super().unscale_grads(scaler)
        fresh, new, old, alone = [], [], [], []
        for param in self.all_fp16_params:
            if param.grad is not None and param.grad.is_sparse:
                raise RuntimeError(
                    f"{self.param_names.get(param, 'A parameter')} has a sparse gradient, which "
                    f"{type(self.optimizer).__name__}(materialize_master_grads=False) cannot read. Pass "
                    "materialize_master_grads=True, or use dense gradients.")
        for index, param in enumerate(self.all_fp16_params):
            stashed, self.all_fp16_grad_stash[index] = self.all_fp16_grad_stash[index], None
            if param.grad is None:
                if stashed is not None:
                    param.grad = stashed
                    alone.append(stashed)
            elif stashed is None:
                fresh.append(param.grad)
            else:
                new.append(param.grad)
                old.append(stashed)
        scale = scaler.scale_tensor_copy() if scaler.dynamic else scaler.loss_scale()
        optimizer = self.optimizer
        earlier = optimizer.most_recent_scale if optimizer.scale_set_by_backward else None
        if scaler.dynamic and (fresh or new):
            # Before the grads are combined: this backward's own overflow, as without fused optimizers.
            _flag_non_finite(scaler.found_inf(), fresh + new, scaler._ratio(1.0, scale))
        if earlier is None:
            out_scale = scale
        else:
            out_scale = _smaller(scale, earlier)
            self._combine(scaler, scale, earlier, out_scale, fresh, new, old, alone)
        optimizer.most_recent_scale = out_scale
        optimizer.scale_set_by_backward = True
        _unscale_models_are_masters(scaler, self.all_fp32_from_fp32_params, self.all_fp32_from_fp32_grad_stash)

    def _combine(self, scaler, scale, earlier, out_scale, fresh, new, old, alone):
        """Grads at ``scale`` (``fresh``, ``new``) and at ``earlier`` (``old``, ``alone``) -> ``out_scale``."""
        if not (new or alone or isinstance(out_scale, torch.Tensor) or out_scale != scale):
            return
        scratch = self._scratch_flag(scaler.found_inf())
        if fresh:
            multi_tensor_applier(multi_tensor_scale, scratch, [fresh, fresh], scaler._ratio(out_scale, scale))
        if alone:
            multi_tensor_applier(multi_tensor_scale, scratch, [alone, alone], scaler._ratio(out_scale, earlier))
        if new:
            multi_tensor_applier(multi_tensor_axpby, scratch, [new, old, new], scaler._ratio(out_scale, scale),
                                 scaler._ratio(out_scale, earlier), -1)
            if scaler.dynamic:
                # A sum that overflowed fp16 counts as this backward's overflow unless the step is
                # skipped already (its stash may hold the inf an earlier pass was flagged for).
                summed = torch.zeros_like(scratch)
                _flag_non_finite(summed, new, scaler._ratio(1.0, out_scale))
                if self.found_inf_by_loss:
                    summed.mul_(1 - _combine_flags(list(self.found_inf_by_loss.values())))
                torch.maximum(scaler.found_inf(), summed, out=scaler.found_inf())

    def _scratch_flag(self, like):
        """A flag the combining ops may set (their inputs were checked already); never read."""
        flag = self._scratch_flags.get(like.device)
        if flag is None:
            flag = self._scratch_flags[like.device] = torch.zeros_like(like)
        return flag

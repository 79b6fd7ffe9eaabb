"""Master weights for amp's fused optimizers (``amp.optimizers``): Apex's FusedSGD contract.

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
and the rest of that step runs as with ``materialize_master_grads=True``. Until then each master
whose model param has a grad holds an ``UnmadeGrad``, which raises if read: masters reached
otherwise (a list kept from an earlier step) would show no grad, and a clip would clip nothing.

The optimizer finds what it needs as attributes: ``_amp_model_copies`` (master -> model param),
``_amp_grads_from_model`` (whether this step reads the model's grads rather than master grads), and
Apex's ``most_recent_scale`` / ``scale_set_by_backward``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .._compat import foreach_norm
from ..multi_tensor_apply import Scalar, multi_tensor_applier, multi_tensor_axpby, multi_tensor_scale
from ..scaler import ScaledBy, Unscaler
from .grads import GradStash, MasterGrads, put_back, set_aside
from .masters import Masters
from .phase import Phase, combine_flags
from .unmade_grad import UnmadeGrad
from .weights import MasterWeights

__all__ = ["FusedMasterWeights", "inverse"]


def inverse(scale: float | torch.Tensor) -> float | torch.Tensor:
    """``1 / scale`` as a 1-element fp32 tensor (or the float 1.0); the reciprocal is taken in fp64, as
    amp's scaler and GradScaler take it, so a fused step unscales to the same bits as their separate pass."""
    if not isinstance(scale, torch.Tensor):
        return 1.0 / float(scale) if float(scale) != 1.0 else 1.0
    return scale.detach().reshape(1).to(torch.float64).reciprocal().to(torch.float32)


def _smaller(a: Scalar, b: Scalar) -> Scalar:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)


def _peak_magnitude(grads: Sequence[torch.Tensor]) -> torch.Tensor:
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


def _flag_non_finite(flag: torch.Tensor, grads: Sequence[torch.Tensor], inv_scale: Scalar) -> None:
    """Set ``flag`` (1-element fp32) if a grad is not finite or overflows fp32 once unscaled; grads are only read.

    The largest magnitude decides both: rounding is monotonic, so if it unscales to a finite value,
    every element does.
    """
    bad = torch.isfinite(_peak_magnitude(grads) * inv_scale).logical_not().to(flag.dtype).reshape(1)
    torch.maximum(flag, bad, out=flag)


class FusedMasterWeights:
    """fp32 masters stepped by an ``amp.optimizers`` kernel that writes the model copy (see module doc).

    With materialised master grads (``reads_master_grads``) every backward goes through the plain
    ``MasterWeights`` it holds; the kernel's reading of the model's grads is this class's own.
    """

    master_weights = True

    def __init__(self, optimizer: Any, param_names: dict[torch.Tensor, str], remainders: bool = False) -> None:
        self.optimizer = optimizer
        self.param_names = param_names
        self.plain = MasterWeights(optimizer, param_names, remainders)
        self.materialize_master_grads = bool(optimizer.materialize_master_grads)
        # This step's mode: materialize_master_grads, or True once amp.master_params made them.
        self.reads_master_grads = self.materialize_master_grads
        self._scratch_flags: dict[torch.device, torch.Tensor] = {}
        self._unmade_grads: dict[int, UnmadeGrad] = {}  # master index -> its stand-in grad, made once

    @property
    def masters(self) -> Masters:
        return self.plain.masters

    @property
    def fp32(self) -> GradStash:
        return self.plain.fp32

    @property
    def master_grads(self) -> MasterGrads:
        return self.plain.master_grads

    @property
    def low_params(self) -> list[torch.Tensor]:
        return self.plain.low_params

    @property
    def low_slots(self) -> list[torch.Tensor | None]:
        return self.plain.low_slots

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None) -> None:
        """As for any optimizer, then tell the optimizer which model param each master rounds into."""
        self.plain.init_params(fp32_values)
        self._unmade_grads = {}
        self._publish_model_copies()

    def add_group(self, group: dict[str, Any]) -> None:
        self.plain.add_group(group)

    def group_added(self) -> None:
        self._publish_model_copies()

    def parts(self) -> list[object]:
        return self.plain.parts()

    def model_params(self) -> list[torch.Tensor]:
        return self.plain.model_params()

    def _publish_model_copies(self) -> None:
        self.optimizer._amp_model_copies = dict(zip(self.masters.masters, self.masters.model_params))
        self._set_mode(self.reads_master_grads)

    def _set_mode(self, reads_master_grads: bool) -> None:
        self.reads_master_grads = reads_master_grads
        self.optimizer._amp_grads_from_model = not reads_master_grads

    def prepare_master_grads(self, phase: Phase) -> None:
        """Unscale the model's grads, which wait for step(), into fp32 master grads (Apex's state there)."""
        if self.reads_master_grads or phase is not Phase.UNSCALED:
            return
        models, masters = [], []
        for index, (param, master) in enumerate(zip(self.masters.model_params, self.masters.masters)):
            master.grad = None  # its UnmadeGrad, if any
            if param.grad is not None:
                master.grad = self.master_grads.buffer(index, master)
                models.append(param.grad)
                masters.append(master.grad)
        if models:
            # Checked at the scale_loss exit already (an overflow skips the step): the flag is a throwaway.
            flag = torch.zeros(1, dtype=torch.float32, device=models[0].device)
            multi_tensor_applier(multi_tensor_scale, flag, [models, masters], inverse(self.optimizer.most_recent_scale))
        self._set_mode(True)

    def check_step(self, closure: Callable[[], Any] | None, phase: Phase) -> None:
        if self.optimizer.materialize_master_grads != self.materialize_master_grads:
            raise RuntimeError(f"{type(self.optimizer).__name__}.materialize_master_grads was changed after "
                               "amp.initialize, which reads it once. Construct the optimizer with the "
                               "value you want, then call amp.initialize.")
        self.plain.check_step(closure, phase)

    def before_step(self) -> None:
        if not self.reads_master_grads:
            self.masters.clear_grads()  # the stand-ins: the step reads the model's grads
        self.plain.before_step()

    def after_step(self, copy_masters: bool) -> None:
        """The kernel wrote the model copies: only the masters' grads and the carried scale are reset."""
        self.masters.note_versions()
        self.masters.clear_grads()
        self._forget_scale()

    def _forget_scale(self) -> None:
        self.optimizer.most_recent_scale = 1.0
        self.optimizer.scale_set_by_backward = False
        self._set_mode(self.materialize_master_grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.plain.zero_grad(set_to_none)
        self._forget_scale()

    def copy_to_model(self) -> None:
        self.plain.copy_to_model()

    # The rest holds only without materialised master grads: the model's grads are the step's input.

    def sets_grads_aside(self, requested: bool, phase: Phase) -> bool:
        """A ``delay_unscale`` block right after an unscaled one sets the grads aside too: they carry
        the earlier scale, which its exit may have changed."""
        if not self.reads_master_grads:
            return requested or phase is Phase.UNSCALED
        return requested

    def set_grads_aside(self) -> None:
        if self.reads_master_grads:
            return self.plain.set_grads_aside()
        if self.optimizer.scale_set_by_backward:
            set_aside(self.low_params, self.low_slots)
        else:
            # Left from before the last step (no zero_grad): dropped, as the masters' grads were.
            for param in self.low_params:
                param.grad = None
        self.fp32.set_aside()

    def restore_grads(self) -> None:
        if self.reads_master_grads:
            return self.plain.restore_grads()
        put_back(self.low_params, self.low_slots)
        self.fp32.put_back()

    def unscale_grads(self, unscaler: Unscaler, earlier_flags: Sequence[torch.Tensor]) -> None:
        """Check the new low-precision grads and bring every grad to one scale; nothing is unscaled."""
        if self.reads_master_grads:
            return self.plain.unscale_grads(unscaler, earlier_flags)
        fresh, new, old, alone = [], [], [], []
        for param in self.low_params:
            if param.grad is not None and param.grad.is_sparse:
                raise RuntimeError(
                    f"{self.param_names.get(param, 'A parameter')} has a sparse gradient, which "
                    f"{type(self.optimizer).__name__}(materialize_master_grads=False) cannot read. Pass "
                    "materialize_master_grads=True, or use dense gradients.")
        slots = self.low_slots
        for index, param in enumerate(self.low_params):
            stashed, slots[index] = slots[index], None
            if param.grad is None:
                if stashed is not None:
                    param.grad = stashed
                    alone.append(stashed)
            elif stashed is None:
                fresh.append(param.grad)
            else:
                new.append(param.grad)
                old.append(stashed)
        # Under a block nested in this one, ``unscaler`` holds the scale this block's loss was multiplied by.
        scale = unscaler.grads_scale()
        scaler = unscaler.scaler if isinstance(unscaler, ScaledBy) else unscaler
        optimizer = self.optimizer
        earlier = optimizer.most_recent_scale if optimizer.scale_set_by_backward else None
        if scaler.dynamic and (fresh or new):
            # Before the grads are combined: this backward's own overflow, as without fused optimizers.
            _flag_non_finite(scaler.found_inf(), fresh + new, scaler._ratio(1.0, scale))
        if earlier is None:
            out_scale = scale
        else:
            out_scale = _smaller(scale, earlier)
            self._combine(scaler, scale, earlier, out_scale, fresh, new, old, alone, earlier_flags)
        optimizer.most_recent_scale = out_scale
        optimizer.scale_set_by_backward = True
        self.fp32.unscale(unscaler)
        self._stand_in_for_master_grads()

    def _stand_in_for_master_grads(self) -> None:
        """Give each master whose model param has a grad an ``UnmadeGrad``, until the step or ``amp.master_params``."""
        for index, (param, master) in enumerate(zip(self.masters.model_params, self.masters.masters)):
            if param.grad is None:
                continue
            grad = self._unmade_grads.get(index)
            if grad is None:
                name = self.param_names.get(master, f"parameter {index} of the optimizer")
                grad = self._unmade_grads[index] = UnmadeGrad(master, name, type(self.optimizer).__name__)
            master.grad = grad

    def _combine(self, scaler: Any, scale: Any, earlier: Any, out_scale: Any, fresh: list[torch.Tensor],
                 new: list[torch.Tensor], old: list[torch.Tensor], alone: list[torch.Tensor],
                 earlier_flags: Sequence[torch.Tensor]) -> None:
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
                if earlier_flags:
                    summed.mul_(1 - combine_flags(earlier_flags))
                torch.maximum(scaler.found_inf(), summed, out=scaler.found_inf())

    def _scratch_flag(self, like: torch.Tensor) -> torch.Tensor:
        """A flag the combining ops may set (their inputs were checked already); never read."""
        flag = self._scratch_flags.get(like.device)
        if flag is None:
            flag = self._scratch_flags[like.device] = torch.zeros_like(like)
        return flag

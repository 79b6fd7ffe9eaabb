"""What an optimizer steps under amp: the model's own params, or fp32 masters in their place.

The controller (``controller.py``) drives one of these through each backward and step. They are
interchangeable parts (``Weights``), chosen once by ``amp.initialize``:

* ``OwnWeights`` (no master weights: O0, O1, O3, O4): the model's params are stepped and their
  grads unscaled in place;
* ``MasterWeights`` (O2/O5): fp32 masters are stepped and rounded into the low-precision model
  params after every step; the model's grads are unscaled into the masters' grads;
* ``fused.FusedMasterWeights``: the same for ``amp.optimizers``, whose kernel can read the model's
  grads and writes the model copy itself.

Each holds the model's low-precision params (``low_params``, with ``low_slots`` for their grads
set aside), its fp32 params, which are their own masters (``fp32``), and under master weights the
masters (``masters``) and the buffers of their grads (``master_grads``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from .._logging import warn_at_caller
from .._master_weights import LOW_PRECISION_DTYPES, check_trainable_dtype
from .grads import GradStash, MasterGrads
from .masters import Masters
from .phase import Phase

if TYPE_CHECKING:
    from ..scaler import Unscaler

__all__ = ["MasterWeights", "OwnWeights", "Weights"]

Closure = Callable[[], Any]


class Weights(Protocol):
    """What the controller asks of the part that says what is stepped."""

    master_weights: bool

    @property
    def fp32(self) -> GradStash:
        """The fp32 params, their own masters."""

    @property
    def low_params(self) -> list[torch.Tensor]:
        """The model's low-precision params."""

    @property
    def low_slots(self) -> list[torch.Tensor | None]:
        """Where their grads wait during a backward (not under plain master weights)."""

    @property
    def masters(self) -> Masters | None: ...

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None) -> None:
        """Build the param lists from the optimizer's groups (``fp32_values``: exact masters)."""

    def add_group(self, group: dict[str, Any]) -> None:
        """Take in the params of a new param group (``group_added`` follows once the optimizer has it)."""

    def group_added(self) -> None: ...

    def parts(self) -> list[object]:
        """The objects whose lists ``add_group`` extends (a rejected group is rolled back by length)."""

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters this optimizer trains."""

    def sets_grads_aside(self, requested: bool, phase: Phase) -> bool:
        """Whether a backward entered in ``phase`` sets the existing grads aside (``requested``: by default)."""

    def set_grads_aside(self) -> None: ...

    def unscale_grads(self, unscaler: Unscaler, earlier_flags: Sequence[torch.Tensor]) -> None:
        """Unscale a backward's grads; ``earlier_flags``: the overflow flags of this step's earlier backwards."""

    def restore_grads(self) -> None:
        """After a failed backward: put back the grads set aside."""

    def prepare_master_grads(self, phase: Phase) -> None: ...

    def check_step(self, closure: Closure | None, phase: Phase) -> None:
        """Raise (or warn) before a step that this part cannot take."""

    def before_step(self) -> None: ...

    def after_step(self, copy_masters: bool) -> None:
        """After every step, applied or skipped (``copy_masters``: the masters may have changed)."""


class OwnWeights:
    """The model's own params (fp32 and low precision) are stepped; their grads are unscaled in place."""

    master_weights = False
    masters = None

    def __init__(self, optimizer: Any, param_names: dict[torch.Tensor, str]) -> None:
        self.optimizer = optimizer
        self.param_names = param_names
        self.low, self.fp32 = GradStash(), GradStash()

    @property
    def low_params(self) -> list[torch.Tensor]:
        return self.low.params

    @property
    def low_slots(self) -> list[torch.Tensor | None]:
        return self.low.slots

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None) -> None:
        """Sort the params into the low-precision and the fp32 ones (``fp32_values``: unused)."""
        self.low, self.fp32 = GradStash(), GradStash()
        for group in self.optimizer.param_groups:
            self.add_group(group)

    def add_group(self, group: dict[str, Any]) -> None:
        for param in group["params"]:
            check_trainable_dtype(param, self.param_names.get(param, "<parameter of the optimizer>"))
            (self.low if param.dtype in LOW_PRECISION_DTYPES else self.fp32).add([param])

    def group_added(self) -> None:
        pass

    def parts(self) -> list[object]:
        return [self.low, self.fp32]

    def model_params(self) -> list[torch.Tensor]:
        return self.low.params + self.fp32.params

    def sets_grads_aside(self, requested: bool, phase: Phase) -> bool:
        return requested

    def set_grads_aside(self) -> None:
        """Apex's ``_prepare_amp_backward``: the grads so far wait while a backward adds new ones."""
        self.low.set_aside()
        self.fp32.set_aside()

    def unscale_grads(self, unscaler: Unscaler, earlier_flags: Sequence[torch.Tensor]) -> None:
        """Apex's ``_post_amp_backward``: unscale the new grads and add back those set aside."""
        self.low.unscale(unscaler)
        self.fp32.unscale(unscaler)

    def restore_grads(self) -> None:
        self.low.put_back()
        self.fp32.put_back()

    def prepare_master_grads(self, phase: Phase) -> None:
        pass

    def check_step(self, closure: Closure | None, phase: Phase) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_step(self, copy_masters: bool) -> None:
        pass


class MasterWeights:
    """fp32 masters are stepped in place of the low-precision params, then copied into them.

    The model's low-precision grads stay scaled; each backward is unscaled into the masters' grads,
    which hold what was accumulated since the last step.
    """

    master_weights = True

    def __init__(self, optimizer: Any, param_names: dict[torch.Tensor, str], remainders: bool = False) -> None:
        self.optimizer = optimizer
        self.param_names = param_names
        self.masters = Masters(optimizer, param_names, remainders)
        self.master_grads = MasterGrads()
        self.fp32 = GradStash()
        # Slots for the model's low-precision grads, where they are the step's input (``fused``).
        self.low_slots: list[torch.Tensor | None] = []
        self._warned_step_without_backward = False

    @property
    def low_params(self) -> list[torch.Tensor]:
        return self.masters.model_params

    def init_params(self, fp32_values: dict[int, torch.Tensor] | None) -> None:
        """Swap in an fp32 master for each low-precision param (exact values from ``fp32_values``)."""
        self.masters.reset()
        self.master_grads, self.fp32, self.low_slots = MasterGrads(), GradStash(), []
        for group in self.optimizer.param_groups:
            self._add_group(group, fp32_values)
        for param in self.masters.masters + self.fp32.params:
            param.grad = None
        # Recast existing optimizer state (momentum, ...) to the masters' fp32.
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self.masters.note_versions()

    def add_group(self, group: dict[str, Any]) -> None:
        self._add_group(group, None)

    def _add_group(self, group: dict[str, Any], fp32_values: dict[int, torch.Tensor] | None) -> None:
        """Swap each low-precision param of ``group`` for an fp32 master and record all three kinds."""
        for param in group["params"]:
            if param.requires_grad:
                check_trainable_dtype(param, self.param_names.get(param, "<parameter of the optimizer>"))
        before = len(self.masters.masters)
        self.fp32.add(self.masters.swap_in(group, fp32_values))
        added = len(self.masters.masters) - before
        self.low_slots += [None] * added
        self.master_grads.add(added)

    def group_added(self) -> None:
        pass

    def parts(self) -> list[object]:
        return [self, self.masters, self.master_grads, self.fp32]

    def model_params(self) -> list[torch.Tensor]:
        """The model's own parameters this optimizer trains (not the masters)."""
        return self.masters.model_params + self.fp32.params

    def sets_grads_aside(self, requested: bool, phase: Phase) -> bool:
        return requested

    def set_grads_aside(self) -> None:
        """Apex's ``_prepare_amp_backward``: the grads so far wait while a backward adds new ones."""
        # The masters hold what was accumulated so far; the model's fp16 grads start afresh.
        for param in self.masters.model_params:
            if param.grad is not None:
                param.grad = None
        self.fp32.set_aside()

    def unscale_grads(self, unscaler: Unscaler, earlier_flags: Sequence[torch.Tensor]) -> None:
        """Apex's ``_post_amp_backward``: unscale the model's grads into (or onto) the masters'."""
        self.master_grads.unscale(unscaler, self.masters.model_params, self.masters.masters)
        self.fp32.unscale(unscaler)

    def restore_grads(self) -> None:
        for param in self.masters.model_params:
            param.grad = None
        self.fp32.put_back()

    def prepare_master_grads(self, phase: Phase) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's grads and the masters' (which ``optimizer.zero_grad`` would not reach)."""
        for param in self.masters.model_params + self.fp32.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()
        self.masters.clear_grads()

    def copy_to_model(self) -> None:
        """Apex's ``_master_params_to_model_params``: round the masters into the model's params."""
        self.masters.copy_to_model()

    def check_step(self, closure: Closure | None, phase: Phase) -> None:
        """Refuse a closure, and warn (once) of a step with nothing to train."""
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers under master "
                               "weights (O2/O5): call the closure yourself, then optimizer.step().")
        if phase is Phase.READY and not self._warned_step_without_backward:
            self._warned_step_without_backward = True
            warn_at_caller("optimizer.step() was called under master weights (O2/O5) with no "
                          "amp.scale_loss backward since the last step: the fp32 master weights have no "
                          "gradients, so nothing is trained. Run the backward inside "
                          "`with amp.scale_loss(loss, optimizer) as scaled_loss:`. (Warned once.)")

    def before_step(self) -> None:
        self.masters.refresh_written_elsewhere()

    def after_step(self, copy_masters: bool) -> None:
        """Master->model copy and master-grad clearing that follow every step, applied or skipped."""
        if copy_masters:
            self.masters.copy_to_model()
        self.masters.clear_grads()

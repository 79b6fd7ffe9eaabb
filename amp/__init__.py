"""Apex-style mixed precision for PyTorch 2.x: ``import amp`` where you had ``from apex import amp``.

The path of a training step through the package: ``amp.initialize`` (``frontend.py``, its options
in ``options.py``) hands models and optimizers to ``_initialize.py``, which makes the run
(``_run.py``): its loss scalers (``scaler.py``), a controller per optimizer (``_controller/``) and
the O1/O4 casts (``casting/``). ``amp.scale_loss`` (``handle.py``) checks its arguments and runs
the block through the optimizers' controllers (``_controller/block.py``), whose scaler unscales
the grads with the multi-tensor kernels (``multi_tensor_apply.py``). ``optimizer.step()`` is the
controller's step, applied or skipped. Under ``torch.compile`` the block's entry and exit and the
controller's part of the step run eagerly (``_compat.eager_under_compile``), as GradScaler's
do: the models' forward (with amp's hooks) and the optimizer's own step are what is compiled.
Apex's names that amp's own code does not use live in ``_apex_compat.py``.
"""
from . import multi_tensor_apply, normalization, optimizers
from ._amp_state import _amp_state
from ._overflow_report import LossScaleFloorError, NonFiniteGradientsError
from .casting import (bfloat16_function, deactivate, disable_casts, float_function,
                      half_function, init, promote_function, register_bfloat16_function,
                      register_float_function, register_half_function, register_promote_function)
from .frontend import (initialize, last_step_applied, load_state_dict, loss_scale,
                       loss_scale_tensor, loss_scaler, master_params, skipped_steps, state_dict)
from .handle import scale_loss
from .scaler import LossScaler

__version__ = "0.1.0"

__all__ = [
    "initialize", "scale_loss", "disable_casts", "state_dict", "load_state_dict", "master_params",
    "last_step_applied", "skipped_steps", "loss_scale", "loss_scale_tensor", "loss_scaler", "init",
    "half_function", "float_function", "promote_function", "bfloat16_function",
    "register_half_function", "register_float_function", "register_promote_function",
    "register_bfloat16_function", "LossScaler",
    "NonFiniteGradientsError", "LossScaleFloorError", "multi_tensor_apply", "deactivate",
    "optimizers", "normalization",
]

"""Fused optimizers with Apex's names and arguments: one pass per step reads the gradients, updates
the parameters and the optimizer state, and under amp's O2/O5 also unscales the model's
low-precision gradients and writes the low-precision model copy.

They are ordinary ``torch.optim.Optimizer`` s: they work without amp, with LR schedulers and with
``torch.amp.GradScaler``, on the CPU and on CUDA.
"""
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_sgd import FusedSGD

__all__ = ["FusedSGD", "FusedAdam", "FusedLAMB"]

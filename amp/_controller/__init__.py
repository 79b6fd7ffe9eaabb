"""The per-optimizer controller (``optimizer._amp_stash``) and the ``scale_loss`` block it runs.

``attach.py`` gives an optimizer its controller at ``initialize``; ``block.py`` runs one
``scale_loss`` block over the controllers of its optimizers; ``controller.py`` moves an optimizer
through backward passes and steps; ``weights.py`` (with ``masters.py``, ``grads.py`` and
``fused.py``) says what is stepped and how grads are set aside and unscaled.
"""
from .attach import attach_controller
from .block import controller_of, scale_loss_block
from .controller import OptimizerController

__all__ = ["attach_controller", "controller_of", "scale_loss_block", "OptimizerController"]

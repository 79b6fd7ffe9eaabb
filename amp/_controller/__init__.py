"""The per-optimizer controller (``optimizer._amp_stash``) and the ``scale_loss`` block it runs.

``attach.py`` gives an optimizer its controller at ``initialize``; ``block.py`` runs one
``scale_loss`` block over the controllers of its optimizers; ``controller.py`` moves an optimizer
through backward passes and steps (its ``Phase`` in ``phase.py``, ``add_param_group``'s checks in
``param_groups.py``); ``weights.py`` says what is stepped, from the parts in ``masters.py`` (fp32
master weights) and ``grads.py`` (grads set aside and unscaled); ``fused.py`` is the variant for
``amp.optimizers``.
"""

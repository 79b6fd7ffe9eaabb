"""``optimizer.add_param_group`` under amp: the new group is checked before anything changes.

The checks are torch's own (it would make them only after amp had taken the group in) and amp's:
a trainable dtype, no parameter twice, none that this optimizer or amp already tracks.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import required

from .._master_weights import check_trainable_dtype

__all__ = ["validated_param_group"]


def validated_param_group(optimizer: Any, new_group: object, tracked_params: list[torch.Tensor]) -> dict[str, Any]:
    """A copy of ``new_group`` with its params as a list, checked as torch checks it and against
    the model params amp already tracks. Raises before anything changes."""
    if not isinstance(new_group, dict):
        raise TypeError(f"param group must be a dict, got {type(new_group).__name__}.")
    if "params" not in new_group:
        raise ValueError("param group must have a 'params' entry.")
    group = dict(new_group)
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                        "ordering of tensors in sets will change between runs. Please use a list instead.")
    params = group["params"] = list(params)
    for index, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is "
                            f"{type(param).__name__}.")
        if not param.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor.")
        check_trainable_dtype(param, f"<parameter {index} of the new param group>")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("the new param group contains the same parameter more than once; amp would "
                         "unscale and step it twice. Pass each parameter once.")
    existing = {id(p) for p in tracked_params}
    existing.update(id(p) for g in optimizer.param_groups for p in g["params"])
    if any(id(p) in existing for p in params):
        raise ValueError("some parameters appear in more than one parameter group (the new group "
                         "holds a parameter this optimizer already has).")
    for name, default in optimizer.defaults.items():
        if default is required and name not in group:
            raise ValueError(f"parameter group didn't specify a value of required optimization "
                             f"parameter {name}")
    return group

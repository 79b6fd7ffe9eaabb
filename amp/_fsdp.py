"""amp on models sharded by FSDP2 (``fully_shard``), and the refusal of FSDP1.

Order: ``fully_shard`` first (each unit, then the root), then build the optimizer on the sharded
parameters, then ``amp.initialize``. What each level becomes:

* O0, O1, O4: as without FSDP2. The grads are ``DTensor`` s; ``scale_loss`` unscales their local
  shards (``multi_tensor_apply`` sees the local tensors).
* O2, O5: FSDP2's own mixed precision. amp sets ``MixedPrecisionPolicy(param_dtype=fp16/bf16,
  reduce_dtype=float32)`` on every unit, so compute runs in low precision on the all-gathered
  copies while the sharded fp32 parameters stay the masters (each rank holds its shard of them and
  of the optimizer state). The optimizer steps those fp32 shards directly, with their grads
  unscaled in place; loss scaling and exact skips are those of every other level. With
  ``keep_batchnorm_fp32`` every BatchNorm must be its own ``fully_shard`` unit, which keeps fp32.
* O3 (fp16 weights, no masters) has no FSDP2 form and is refused.

The overflow flag is all-reduced (MAX) over the mesh's process group unless
``overflow_process_group`` was given, so a step is skipped on every rank or on none.
"""
import sys
import weakref

import torch
from torch import nn

from ._compat import fsdp2, loaded_fsdp2
from ._master_weights import LOW_PRECISION_DTYPES
from .options import REMAINDER

__all__ = []

_HOW_TO_ORDER = ("Call fully_shard on the model (its units, then the root) first, build the optimizer "
                 "on the sharded parameters, then call amp.initialize.")


def _is_fsdp2(module):
    found = loaded_fsdp2()
    return found is not None and isinstance(module, found[1])


def _is_fsdp1(module):
    # Like FSDP2's, an FSDP1 model exists only once its module was imported: amp does not import it.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel)


def _units(model):
    """The FSDP2 units in ``model`` with the modules whose parameters each of them manages."""
    units = []

    def walk(module, owner):
        if _is_fsdp2(module):
            owner = (module, [])
            units.append(owner)
        if owner is not None:
            owner[1].append(module)
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return units


def _direct_params(modules):
    return [p for m in modules for p in m.parameters(recurse=False)]


def _policy_for(unit, managed, dtype, keep_batchnorm_fp32):
    """The policy amp gives ``unit``: ``dtype`` compute, fp32 reduction; BN-only units stay fp32."""
    policy_class = fsdp2()[2]
    current = unit._get_fsdp_state()._mp_policy
    params = _direct_params(managed)
    batchnorm = [m for m in managed if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and list(m.parameters(recurse=False))]
    wanted = dtype
    if keep_batchnorm_fp32 and batchnorm:
        if len(_direct_params(batchnorm)) != len(params):
            raise RuntimeError(
                f"keep_batchnorm_fp32 with FSDP2: the fully_shard unit {type(unit).__name__} holds "
                "BatchNorm parameters together with others, and one unit has one compute dtype. Call "
                "fully_shard on each BatchNorm module by itself (before its parents), or pass "
                "keep_batchnorm_fp32=False.")
        wanted = None
    if current.param_dtype not in (None, wanted) or current.reduce_dtype not in (None, torch.float32):
        raise RuntimeError(
            f"The fully_shard unit {type(unit).__name__} has mp_policy={current}, which differs from "
            f"what this opt_level needs. Call fully_shard without mp_policy (amp sets it), or with "
            f"mp_policy=MixedPrecisionPolicy(param_dtype={wanted}, reduce_dtype=torch.float32).")
    return policy_class(param_dtype=wanted, reduce_dtype=torch.float32,
                        output_dtype=current.output_dtype,
                        cast_forward_inputs=current.cast_forward_inputs)


def _set_policy(unit, policy):
    # FSDP2 reads the policy from its state at each forward and applies it to its parameters at
    # its lazy init; amp sets both places, so it works before and after a first forward.
    state = unit._get_fsdp_state()
    state._mp_policy = policy
    group = state._fsdp_param_group
    if group is not None:
        group.mp_policy = policy
        for fsdp_param in group.fsdp_params:
            fsdp_param.init_dtype_attrs(policy)


def _mesh_group(models):
    for model in models:
        for param in model.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is None:
                continue
            if mesh.ndim != 1:
                raise RuntimeError("amp agrees on overflows over a 1-D FSDP2 mesh by itself; with a "
                                   f"{mesh.ndim}-D mesh pass overflow_process_group= (a group of "
                                   "every rank that shares this model) to amp.initialize.")
            return mesh.get_group()
    return None


class ShardedRun:
    """What amp does for FSDP2 models in one ``initialize``: validated by ``plan``, done by ``apply``."""

    def __init__(self, models, policies, overflow_group):
        self.models = models
        self.policies = policies
        self.overflow_group = overflow_group

    @property
    def sharded_masters(self):
        """Whether the sharded fp32 params are the masters (O2/O5) rather than amp's copies."""
        return bool(self.policies)

    def apply(self, context):
        for unit, policy in self.policies:
            _set_policy(unit, policy)
        if context.overflow_process_group is None:
            context.overflow_process_group = self.overflow_group
        context.sharded_masters = self.sharded_masters


def plan(models, optimizers, context):
    """Check FSDP models against ``context``'s options; a ``ShardedRun`` for FSDP2, else None."""
    options = context.options
    for model in models:
        if options.enabled and options.opt_level != "O0" and any(map(_is_fsdp1, model.modules())):
            raise RuntimeError(
                "amp does not support FullyShardedDataParallel (FSDP1): its flat parameters hide the "
                "model's dtypes and shards from amp. Use FSDP2 instead (torch.distributed.fsdp."
                f"fully_shard on each unit, then on the root), then amp.initialize. {_HOW_TO_ORDER}")
    units = [unit for model in models for unit in _units(model)]
    if not units:
        return None
    for model in models:
        if _units(model) and not _is_fsdp2(model):
            raise RuntimeError(f"Some submodules of {type(model).__name__} are fully_shard units but "
                               "the model is not: call fully_shard on the root model too. "
                               + _HOW_TO_ORDER)
    model_params = {id(p) for model in models for p in model.parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(id(p) not in model_params for p in group["params"]):
                raise RuntimeError("An optimizer holds parameters that the fully_shard model does not "
                                   "have (fully_shard replaces them): build the optimizer on "
                                   "model.parameters() after fully_shard. " + _HOW_TO_ORDER)
    cast_type = options.cast_model_type if options.enabled else None
    policies = []
    if cast_type in LOW_PRECISION_DTYPES:
        if not options.master_weights:
            raise RuntimeError(f"{options.opt_level} keeps no fp32 master weights, which has no "
                               "FSDP2 form: use O2 (fp16) or O5 (bf16), whose masters are the "
                               "sharded fp32 parameters.")
        if options.master_weights == REMAINDER:
            raise RuntimeError(
                "master_weights='remainder' is not offered with FSDP2: there the masters are the "
                "sharded fp32 parameters, which fully_shard's MixedPrecisionPolicy casts to bf16 for "
                "each forward, so the model holds no bf16 weights to keep remainders beside. Use "
                "master_weights=True (the O5 default) with fully_shard, or train without fully_shard "
                "(DDP works with remainders).")
        policies = [(unit, _policy_for(unit, managed, cast_type, options.keep_batchnorm_fp32))
                    for unit, managed in units]
    group = _mesh_group(models) if context.overflow_process_group is None else None
    return ShardedRun(models, policies, group)


def remember_unsharded(models, context):
    """Note the models that were not FSDP2 units at ``initialize``, for ``check_order``."""
    context.unsharded_models = [weakref.ref(model) for model in models if not _is_fsdp2(model)]


def check_order(context):
    """Refuse a model that ``fully_shard`` wrapped after ``amp.initialize`` (its optimizer and
    masters point at parameters the model no longer has, so nothing would train)."""
    for ref in context.unsharded_models:
        model = ref()
        if model is not None and _is_fsdp2(model):
            raise RuntimeError("fully_shard was called on a model after amp.initialize: amp's "
                               "optimizer no longer holds the model's parameters. " + _HOW_TO_ORDER)

"""Apex's legacy mixed-precision utilities: fp32 master weights by hand (``fp16util``), the
legacy loss scalers, and ``FP16_Optimizer``. Deprecated in Apex; kept so old code runs.

``from fp16_utils import *`` (``from apex.fp16_utils import *`` through the drop-in switch) binds
the names Apex's package gave, its three modules included."""
from . import fp16_optimizer, fp16util, loss_scaler
from ._deprecation import DeprecatedFeatureWarning
from .fp16_optimizer import FP16_Optimizer
from .fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "FP16_Optimizer",
    "LossScaler",
    "DynamicLossScaler",
    "BN_convert_float",
    "network_to_half",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "tofp16",
    "to_python_float",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "FP16Model",
    "DeprecatedFeatureWarning",
    "fp16util",
    "fp16_optimizer",
    "loss_scaler",
]

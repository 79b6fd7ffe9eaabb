"""Apex's fused normalization layers (``apex.normalization``) on PyTorch's own kernels.

``FusedLayerNorm`` and ``FusedRMSNorm`` return the input's dtype; ``MixedFusedLayerNorm`` and
``MixedFusedRMSNorm`` (Megatron's) return their parameters' dtype, so fp32 parameters take fp16 or
bf16 inputs and give fp32 out. Either way the statistics and the affine step are computed in
fp32 for fp16/bf16 tensors, on CPU and CUDA. Under O1/O4 they run in fp32, as ``F.layer_norm``
does there (it is on amp's fp32 list). The functional forms (``fused_layer_norm_affine`` ...)
are in the module ``amp.normalization.fused_layer_norm``, as in Apex. The switch (``python -m
amp.apex enable``) serves this package as ``apex.normalization`` where NVIDIA Apex is not installed.
"""
from .fused_layer_norm import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"]

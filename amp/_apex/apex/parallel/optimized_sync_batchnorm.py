"""``apex.parallel.optimized_sync_batchnorm``: Apex's ``SyncBatchNorm`` on its ``syncbn`` CUDA
kernels; here the same class as ``apex.parallel.sync_batchnorm`` (``amp.parallel.SyncBatchNorm``),
so a model built with either imports and trains."""
from amp.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]

"""``apex.parallel.sync_batchnorm``: Apex's pure-Python ``SyncBatchNorm`` module; amp has one
``SyncBatchNorm`` (``amp.parallel.sync_batchnorm``), which trains on any device."""
from amp.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]

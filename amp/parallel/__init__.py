"""Apex's ``apex.parallel`` on torch: ``DistributedDataParallel``, ``SyncBatchNorm``,
``convert_syncbn_model`` and ``LARC``. With the drop-in switch on (``python -m amp.apex enable``)
and no NVIDIA Apex installed, ``apex.parallel`` is this package."""
from .distributed import DistributedDataParallel
from .larc import LARC
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model

__all__ = ["DistributedDataParallel", "LARC", "SyncBatchNorm", "convert_syncbn_model"]

"""Apex's ``apex.parallel`` on torch: ``DistributedDataParallel``, ``Reducer``, ``SyncBatchNorm``,
``convert_syncbn_model``, ``create_syncbn_process_group`` and ``LARC``. With the drop-in switch on
(``python -m amp.apex enable``), ``apex.parallel`` serves these under Apex's module layout
(``amp._apex.apex.parallel``) wherever the installed NVIDIA Apex ships no ``parallel``."""
from .distributed import DistributedDataParallel, Reducer
from .larc import LARC
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = ["DistributedDataParallel", "Reducer", "LARC", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group"]

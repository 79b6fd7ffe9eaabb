"""``apex.parallel`` with Apex's layout: the names of Apex's ``apex/parallel/__init__.py``, and its
modules (``LARC``, ``distributed``, ``sync_batchnorm``, ``optimized_sync_batchnorm``,
``multiproc``), all on ``amp.parallel``.

As in Apex, ``apex.parallel.LARC`` is the module (``from apex.parallel.LARC import LARC``);
``amp.parallel.LARC`` is the class.
"""
import torch.distributed

from amp.parallel import (
    DistributedDataParallel,
    Reducer,
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
)

from . import LARC  # noqa: F401  (imported up front, so the attribute is the module in any order)

ReduceOp = torch.distributed.ReduceOp

__all__ = ["DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group", "ReduceOp"]

"""``apex.multi_tensor_apply`` as the package Apex had: ``multi_tensor_applier`` is amp's applier
(``amp.multi_tensor_apply``), whose ``available`` says whether amp's ``amp_C`` is built."""
from amp.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

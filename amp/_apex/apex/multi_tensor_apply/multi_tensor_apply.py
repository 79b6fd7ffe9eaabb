"""``apex.multi_tensor_apply.multi_tensor_apply``: Apex's module of ``MultiTensorApply``."""
from amp.multi_tensor_apply import MultiTensorApply

__all__ = ["MultiTensorApply"]

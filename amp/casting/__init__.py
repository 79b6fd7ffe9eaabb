"""O1/O4 casting: patch torch functions so they run in fp16/bf16 or fp32 by Apex's lists."""
from .patcher import (AmpHandle, NoOpHandle, deactivate, disable_casts, init, installed_handle,
                      register_bfloat16_function, register_float_function, register_half_function,
                      register_promote_function, set_installed_handle, use_run_policy)
from .policy import track as track_forward
from .registry import bfloat16_function, float_function, half_function, promote_function

__all__ = [
    "init", "deactivate", "disable_casts", "AmpHandle", "NoOpHandle", "use_run_policy",
    "installed_handle", "set_installed_handle", "track_forward",
    "half_function", "float_function", "promote_function", "bfloat16_function",
    "register_half_function", "register_float_function", "register_promote_function",
    "register_bfloat16_function",
]

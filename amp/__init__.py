"""Apex-style mixed precision for PyTorch 2.x."""
from ._amp_state import _amp_state
from .casting import (bfloat16_function, disable_casts, float_function, half_function, init,
                      promote_function, register_bfloat16_function, register_float_function,
                      register_half_function, register_promote_function)

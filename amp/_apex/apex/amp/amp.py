"""``apex.amp.amp``: Apex's module of ``init`` and the cast decorators and registries, with what it
imported (``from apex.amp import amp`` then ``amp.initialize(...)`` worked); all of them amp's."""
from amp import _amp_state
from amp.casting import (AmpHandle, NoOpHandle, float_function, half_function, init, promote_function,
                         register_float_function, register_half_function, register_promote_function)
from amp.frontend import O0, O1, O2, O3, Properties, initialize, load_state_dict, opt_levels, state_dict

from . import compat, rnn_compat, utils, wrap
from .lists import functional_overrides, tensor_overrides, torch_overrides

__all__ = ["init", "half_function", "float_function", "promote_function", "register_half_function",
           "register_float_function", "register_promote_function", "AmpHandle", "NoOpHandle",
           "initialize", "state_dict", "load_state_dict", "Properties", "O0", "O1", "O2", "O3",
           "opt_levels", "compat", "rnn_compat", "utils", "wrap", "functional_overrides",
           "tensor_overrides", "torch_overrides", "_amp_state"]

"""The process-wide amp state that Apex code and tests poke (``amp._amp_state``).

Only ``frontend.initialize`` writes the configuration fields; everything else reads them.
"""
import torch.distributed as dist


class AmpState:
    def __init__(self):
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1
        self.opt_properties = None
        self.loss_scalers = []
        self.handle = None
        self.min_loss_scale = None
        self.max_loss_scale = 2.0**24
        self.overflow_process_group = None


_amp_state = AmpState()


def _is_rank_zero():
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def maybe_print(msg, rank0=False):
    """Print ``msg`` when verbosity > 0 (and, with ``rank0``, only on rank 0)."""
    if _amp_state.verbosity > 0 and (not rank0 or _is_rank_zero()):
        print(msg)


def warn_or_err(msg):
    """Raise ``RuntimeError(msg)``, or only print it when ``_amp_state.hard_override`` is set."""
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)

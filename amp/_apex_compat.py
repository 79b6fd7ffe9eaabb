"""What amp keeps only because code written for NVIDIA Apex reads or calls it.

amp's own modules speak amp; the Apex names they must still answer to are gathered here, each
working exactly as in Apex (and as before this module existed):

* ``warn_or_err``: Apex's ``hard_override`` leniency (``amp._amp_state.hard_override``) turns an
  option that does not fit its opt level into a warning; ``amp.initialize`` reads the flag and
  passes it down, so nothing below it reads amp's state.
"""
from __future__ import annotations

import warnings

__all__ = ["warn_or_err"]


def warn_or_err(msg: str, lenient: bool) -> None:
    """Raise ``RuntimeError(msg)``, or only warn when ``lenient`` (Apex's ``hard_override``)."""
    if lenient:
        warnings.warn(msg, stacklevel=3)
    else:
        raise RuntimeError(msg)

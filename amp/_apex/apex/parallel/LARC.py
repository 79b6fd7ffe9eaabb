"""``apex.parallel.LARC``: Apex's module of the ``LARC`` optimizer wrapper (``amp.parallel.larc``)."""
from amp.parallel.larc import LARC

__all__ = ["LARC"]

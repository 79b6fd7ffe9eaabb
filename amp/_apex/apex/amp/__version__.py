"""``apex.amp.__version__``: Apex's version module, holding amp's version."""
from amp import __version__

VERSION = tuple(int(part) for part in __version__.split("."))

__all__ = ["VERSION", "__version__"]

"""``python -m amp.check``: see ``amp.check``."""
import sys

from . import main

sys.exit(main())

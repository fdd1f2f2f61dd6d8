"""Face of :mod:`speedtronic.engine.stopping`: the same module under this older path."""

import sys

from speedtronic.engine import stopping as _module

sys.modules[__name__] = _module

"""Face of :mod:`speedtronic.engine.precision`: the same module under this older path."""

import sys

from speedtronic.engine import precision as _module

sys.modules[__name__] = _module

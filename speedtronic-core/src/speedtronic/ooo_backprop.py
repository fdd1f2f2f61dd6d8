"""Face of :mod:`speedtronic.engine.ooo_backprop`: the same module under this older path."""

import sys

from speedtronic.engine import ooo_backprop as _module

sys.modules[__name__] = _module

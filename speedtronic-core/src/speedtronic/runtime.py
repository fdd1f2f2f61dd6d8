"""Face of :mod:`speedtronic.engine.runtime`: the same module under this older path."""

import sys

from speedtronic.engine import runtime as _module

sys.modules[__name__] = _module

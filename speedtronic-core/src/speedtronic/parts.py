"""Face of :mod:`speedtronic.engine.parts`: the same module under this older path."""

import sys

from speedtronic.engine import parts as _module

sys.modules[__name__] = _module

"""Face of :mod:`speedtronic.engine.eval`: the same module under this older path."""

import sys

from speedtronic.engine import eval as _module

sys.modules[__name__] = _module

"""Face of :mod:`speedtronic.engine.batch`: the same module under this older path."""

import sys

from speedtronic.engine import batch as _module

sys.modules[__name__] = _module

"""Face of :mod:`speedtronic.engine.trainer`: the same module under this older path."""

import sys

from speedtronic.engine import trainer as _module

sys.modules[__name__] = _module

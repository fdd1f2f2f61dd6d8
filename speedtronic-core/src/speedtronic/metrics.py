"""Face of :mod:`speedtronic.observe.metrics`: the same module under this older path."""

import sys

from speedtronic.observe import metrics as _module

sys.modules[__name__] = _module

"""Face of :mod:`speedtronic.observe.flops`: the same module under this older path."""

import sys

from speedtronic.observe import flops as _module

sys.modules[__name__] = _module

"""Face of :mod:`speedtronic.observe.plot`: the same module under this older path."""

import sys

from speedtronic.observe import plot as _module

sys.modules[__name__] = _module

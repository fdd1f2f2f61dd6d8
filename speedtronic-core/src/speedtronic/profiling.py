"""Face of :mod:`speedtronic.observe.profiling`: the same module under this older path."""

import sys

from speedtronic.observe import profiling as _module

sys.modules[__name__] = _module

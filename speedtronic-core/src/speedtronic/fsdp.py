"""Face of :mod:`speedtronic.parallel.fsdp`: the same module under this older path."""

import sys

from speedtronic.parallel import fsdp as _module

sys.modules[__name__] = _module

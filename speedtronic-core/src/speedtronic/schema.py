"""Face of :mod:`speedtronic.config.schema`: the same module under this older path."""

import sys

from speedtronic.config import schema as _module

sys.modules[__name__] = _module

"""Face of :mod:`speedtronic.inference.generation`: the same module under this older path."""

import sys

from speedtronic.inference import generation as _module

sys.modules[__name__] = _module

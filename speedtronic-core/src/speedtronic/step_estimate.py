"""Face of :mod:`speedtronic.observe.step_estimate`: the same module under this older path."""

import sys

from speedtronic.observe import step_estimate as _module

sys.modules[__name__] = _module

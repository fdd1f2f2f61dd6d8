"""Former import path of :mod:`speedtronic_diloco.transports`.

Kept so that existing code keeps working; new code imports ``speedtronic_diloco.transports``.
"""

from speedtronic_diloco.transports import *  # noqa: F403
from speedtronic_diloco.transports import __all__  # noqa: F401

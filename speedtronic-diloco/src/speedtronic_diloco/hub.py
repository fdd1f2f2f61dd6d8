"""Former import path of :mod:`speedtronic_diloco.transports.hub`.

Kept so that existing code keeps working; new code imports ``speedtronic_diloco.transports.hub``.
"""

from speedtronic_diloco.transports.hub import *  # noqa: F403
from speedtronic_diloco.transports.hub import __all__  # noqa: F401

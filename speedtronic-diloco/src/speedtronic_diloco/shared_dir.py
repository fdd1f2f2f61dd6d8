"""Former import path of :mod:`speedtronic_diloco.transports.shared_dir`.

Kept so that existing code keeps working; new code imports
``speedtronic_diloco.transports.shared_dir``.
"""

from speedtronic_diloco.transports.shared_dir import *  # noqa: F403
from speedtronic_diloco.transports.shared_dir import __all__  # noqa: F401

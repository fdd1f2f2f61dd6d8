"""``python -m speedtronic``."""

import sys

from speedtronic.cli import main

sys.exit(main())

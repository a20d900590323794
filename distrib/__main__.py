"""`python -m distrib train|info`."""

import sys

from distrib.cli import main

sys.exit(main())

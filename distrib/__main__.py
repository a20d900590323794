"""`python -m distrib train|bench|info`."""

import sys

from distrib.cli import main

sys.exit(main())

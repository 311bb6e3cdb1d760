"""`python -m training.planner`: the planner's command line (training.planner.cli)."""

import sys

from training.planner.cli import main

sys.exit(main())

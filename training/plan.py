"""`python -m training.plan`: the planner's command line under its earlier name; see training.planner."""

import sys

from training.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m training.agent`: one node's agent (training.agent.node_agent), from its command
line (training.agent.cli)."""

import sys

from training.agent.cli import main

sys.exit(main())

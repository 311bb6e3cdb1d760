"""`python -m training.agent`: one node's agent (training.agent.node_agent)."""

import sys

from training.agent.node_agent import main

sys.exit(main())

#!/usr/bin/env python
"""Django's command-line utility for Fathom's control plane."""

import os
import sys
from pathlib import Path

# platform/ is a folder, not a package (a package would shadow the stdlib `platform`): its
# Django project and apps are importable because the folder itself is on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "platform"))
sys.path.insert(1, str(Path(__file__).resolve().parent))


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()

"""``python -m serialized_restore run [--k K | --auto] -- <command ...>``: the launcher (``_launch.py``)."""

import sys

from serialized_restore._launch import main

if __name__ == "__main__":
    sys.exit(main())

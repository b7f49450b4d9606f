"""``python -m serialized_restore run [--k K] -- <command ...>``: the command line (``_launcher/cli.py``)."""

from serialized_restore._launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

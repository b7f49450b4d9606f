"""``python -m serialized_restore run [--k K] -- <command ...>``: the launcher (``_launch.py``)."""

from serialized_restore._launch import main

if __name__ == "__main__":
    raise SystemExit(main())

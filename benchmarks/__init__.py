"""Benchmarks of the serialized restore; see ``docs/benchmarks.md``. ``_measure.py`` is shared with ``demo/``."""

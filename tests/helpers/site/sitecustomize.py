"""Imported at start-up by every Python process the tests start (``tests/conftest.py`` puts this folder on
``PYTHONPATH``): the cyclic garbage collector runs less often. Importing torch and Lightning allocates millions of
objects, none of them garbage, and with the default thresholds the collector walks them again and again: about 0.5 s
of CPU per process, and the suite starts hundreds of processes on 2 cores. Thresholds change when cycles are
collected, not what a program does; the benchmarks, run on their own for the figures in ``docs/``, keep the
defaults."""

import gc

gc.set_threshold(20_000, 50, 100)

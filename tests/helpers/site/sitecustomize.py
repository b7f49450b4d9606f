"""Imported at start-up by every Python process the tests start (``tests/conftest.py`` puts this folder on
``PYTHONPATH``), to spare the CPU of starting hundreds of processes on 2 cores without changing what they do:

* the cyclic garbage collector runs less often. Importing torch and Lightning allocates millions of objects, none of
  them garbage, and with the default thresholds the collector walks them again and again: about 0.5 s of CPU per
  process. Thresholds change when cycles are collected, not what a program does;
* the benchmark's plotting libraries (``requirements/plots.txt``, which ``scripts/env.sh`` installs apart, in
  ``.venv/plots``) are left off the path: torchmetrics, which Lightning imports, imports matplotlib whenever it is
  installed, about 0.4 s of CPU per process. The jobs run as where matplotlib is not installed, as it need not be
  for Lightning or this package. The one process that draws plots, ``benchmarks/restore_benchmark.py`` itself (its
  smoke test checks them), keeps them; the jobs it starts do not.

The benchmarks' smoke tests and the GPU check's CPU rehearsal start their programs with this folder on the path too.
The benchmarks, run on their own for the figures in ``docs/``, keep the defaults and the plots."""

import gc
import os
import sys

gc.set_threshold(20_000, 50, 100)
_PLOTS = os.path.realpath(os.path.join(sys.prefix, "plots"))
if os.path.basename((getattr(sys, "argv", None) or [""])[0]) != "restore_benchmark.py":
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry) != _PLOTS]

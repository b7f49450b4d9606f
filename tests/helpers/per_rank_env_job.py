"""``job.py`` with environment variables that differ between the local ranks of a node.

Usage: ``python tests/helpers/per_rank_env_job.py '<json config>'``, where ``config["env_by_local_rank"]`` maps a
local rank (as a string) to the variables that rank sets before the job starts. Lightning's ``ddp`` launcher re-runs
this same command line for the other local ranks, with ``LOCAL_RANK`` set; local rank 0 has none.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.processes import end_finished_rank  # noqa: E402
from tests.helpers.job import main  # noqa: E402

if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    os.environ.update(config.get("env_by_local_rank", {}).get(os.environ.get("LOCAL_RANK", "0"), {}))
    main(config)
    end_finished_rank()

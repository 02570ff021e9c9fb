#!/usr/bin/env python3
"""Run `stockade` under py-spy, for the benches' STOCKADE_BENCH_PROFILE hook:

    .venv/bin/pip install py-spy
    STOCKADE_BENCH_PROFILE=bench/pyspy_wrap.py STOCKADE_PYSPY_OUT=/tmp/gw.txt \\
        .venv/bin/python bench/gateway_bench.py --only gateway --latency-runs 10000 ...

py-spy samples this process (the gateway; not its inspector child) from its start and
writes collapsed stacks (`--format raw`, one `frame;frame;... count` a line: flamegraph
input) to STOCKADE_PYSPY_OUT once the gateway exits. Only active samples count (py-spy's
default), so the totals are CPU, not wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stockade.cli import main

if __name__ == "__main__":
    out = os.environ.get("STOCKADE_PYSPY_OUT", "stockade-gateway-pyspy.txt")
    spy = Path(sys.executable).parent / "py-spy"
    subprocess.Popen(  # outlives us long enough to write its file when we exit
        [str(spy), "record", "--pid", str(os.getpid()), "--rate", "1000", "--format", "raw",
         "--output", out],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    sys.exit(main(sys.argv[1:]))

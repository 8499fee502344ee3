"""Clean teardown: run the training example many times and count what went wrong at exit.

Each run is ``torchrun --nproc-per-node 2 examples/train_gpt.py --steps 5`` (the example
ends with a barrier and ``destroy_process_group``). Counts the runs that exited non-zero, the
stderr lines of gloo or c10d aborting (``abort``, ``SIGABRT``, ``Connection reset``), and
``terminate called`` lines (a C++ exception escaping a thread at exit); prints the stderr tail
of any failed run:

    python benchmarks/teardown.py [--runs 50]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABORT = re.compile(r"abort|SIGABRT|Connection reset", re.I)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "examples/train_gpt.py",
        "--steps",
        str(args.steps),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failed = aborts = terminates = 0
    start = time.perf_counter()
    for i in range(args.runs):
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = out.stderr.splitlines()
        run_aborts = sum(bool(ABORT.search(line)) for line in lines)
        run_terminates = sum("terminate called" in line for line in lines)
        aborts += run_aborts
        terminates += run_terminates
        if out.returncode or run_aborts or run_terminates:
            failed += out.returncode != 0
            tail = "\n".join(lines[-20:])
            print(f"run {i + 1}: exit status {out.returncode}\n{tail}", flush=True)
    seconds = time.perf_counter() - start
    print(
        f"{args.runs} runs of {' '.join(cmd[1:])} in {seconds:.0f} s: {failed} non-zero exits, "
        f"{aborts} abort lines, {terminates} 'terminate called' lines"
    )


if __name__ == "__main__":
    main()

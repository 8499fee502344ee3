"""A finished job exits 0: the end-of-job patterns under torchrun, on real gloo processes.

A gloo worker that still releases the job's last collective while Python finalizes aborts the
process ("terminate called without an active exception"), about 1 run in 10 at 4 ranks before
the fix. That race is rare, so each CI run also checks what makes it impossible: after the
library's exit hook no gloo thread is left (``tests/_exit_script.py`` writes each rank's
threads from an ``atexit`` hook that runs after the library's). Without the hook, the group's
worker and transport threads are still there, deterministically.

``FF_EXIT_STRESS=50`` runs every pattern 50 times at 2 and at 4 ranks and counts aborts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from functional_fsdp.distributed.process import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_exit_script.py"
pytestmark = pytest.mark.multiprocess

ABORTS = re.compile(r"terminate called|Aborted|core dumped|SIGABRT|Signal 6")
GLOO_THREADS = re.compile(r"gloo|pt_gloo")


def _run(pattern: str, nproc: int, tmp: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FF_EXIT_THREADS": str(tmp / "threads"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(SCRIPT),
        pattern,
        str(tmp),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    threads = [
        (tmp / f"threads.{r}").read_text() for r in range(nproc) if (tmp / f"threads.{r}").exists()
    ]
    return out, threads


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads in /proc")
@pytest.mark.parametrize(("pattern", "nproc"), [("destroy", 2), ("save", 2)])
def test_a_finished_job_exits_zero_with_no_gloo_thread_left_for_finalization(
    pattern, nproc, tmp_path
):
    out, threads = _run(pattern, nproc, tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert not ABORTS.search(log), log
    assert len(threads) == nproc, log  # every rank reached the end of its exit hooks
    for names in threads:
        assert not GLOO_THREADS.search(names), f"threads left for finalization: {names}"


@pytest.mark.timeout(7200)
@pytest.mark.skipif(not os.environ.get("FF_EXIT_STRESS"), reason="set FF_EXIT_STRESS=<runs>")
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("pattern", ["gather", "destroy", "export", "save", "close"])
def test_stress_end_of_job_patterns_never_abort(pattern, nproc, tmp_path):
    runs = int(os.environ["FF_EXIT_STRESS"])
    failed = []
    for i in range(runs):
        out, _ = _run(pattern, nproc, tmp_path / str(i))
        log = out.stdout + out.stderr
        if out.returncode != 0 or ABORTS.search(log):
            failed.append((i, out.returncode, log[-2000:]))
    print(f"{pattern} at {nproc} ranks: {runs} runs, {len(failed)} failed")
    assert not failed, failed[0]

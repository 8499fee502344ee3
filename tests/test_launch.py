"""ff.launch and ProcessPool: argument checks, output, teardown, and failures reported fast.

Every failure here is provoked on real worker processes (gloo), and each test runs under a
pytest timeout, so a launcher that hangs fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp import launcher as launch_module
from functional_fsdp.launcher import ProcessPool, WorkerError, _Failure

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess

# Lines a gloo or C++ runtime prints when a process group is torn down badly.
ABORTS = re.compile(r"terminate called|Connection (reset|closed) by peer|Aborted|core dumped")


def _noop() -> None:
    return None


def _greet_and_sum(x: int) -> int:
    rank = dist.get_rank()
    print(f"hello from rank {rank}")
    print(f"warning from rank {rank}", file=sys.stderr)
    t = __import__("torch").tensor([float(rank + x)])
    dist.all_reduce(t)
    return int(t.item())


def _rank1_sleeps() -> int:
    if dist.get_rank() == 1:
        time.sleep(60)
    return dist.get_rank()


def _rank1_killed() -> None:
    if dist.get_rank() == 1:
        print("rank 1 is about to be killed", file=sys.stderr, flush=True)
        os.kill(os.getpid(), 9)
    dist.barrier()  # rank 0 waits here for the dead rank


def _rank0_waits_alone() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 skips it


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("n", [0, -1])
def test_launch_rejects_a_world_size_below_one(n):
    with pytest.raises(
        ValueError,
        match=rf"launch: world_size must be at least 1 .*got {n}; e\.g\. launch\(fn, 2\)",
    ):
        ff.launch(_noop, n)


@pytest.mark.parametrize("n", [1.5, True, "2"])
def test_launch_rejects_a_world_size_that_is_not_an_int(n):
    with pytest.raises(
        TypeError, match=r"launch: world_size must be an int \(the number of processes\)"
    ):
        ff.launch(_noop, n)


def test_process_pool_rejects_bad_sizes_and_timeouts_before_starting_anything():
    with pytest.raises(
        ValueError, match=r"ProcessPool: world_size must be at least 1 .*ProcessPool\(2\)"
    ):
        ProcessPool(0)
    with pytest.raises(
        ValueError, match=r"ProcessPool\(timeout=0\): the timeout must be a positive"
    ):
        ProcessPool(2, timeout=0)
    with pytest.raises(ValueError, match=r"ProcessPool\(collective_timeout=-1\)"):
        ProcessPool(2, collective_timeout=-1)


def test_an_unpicklable_argument_is_a_type_error_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(launch_module, "ProcessPool", None)  # launch must not get this far
    with pytest.raises(
        TypeError,
        match=r"cannot send _noop and its arguments to the worker processes: TypeError: cannot pickle '_thread.lock'",
    ):
        ff.launch(_noop, 2, threading.Lock())


# --------------------------------------------------------------------------- normal calls


@pytest.mark.timeout(120)
def test_output_is_prefixed_with_the_rank_and_teardown_is_clean(capfd):
    pool = ProcessPool(2, device_type="cpu")
    try:
        assert pool.run(_greet_and_sum, 10) == [21, 21]  # (0 + 10) + (1 + 10) on both ranks
        out, err = capfd.readouterr()  # printed before run returned
        assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out
        assert "[rank 0] warning from rank 0" in err and "[rank 1] warning from rank 1" in err
        assert pool.run(_greet_and_sum, 0) == [1, 1]  # the pool is reused
    finally:
        pool.close()
    out, err = capfd.readouterr()
    # Barrier, then destroy_process_group: every worker exits 0 and nothing aborts.
    assert [w.proc.returncode for w in pool._workers] == [0, 0]
    assert not ABORTS.search(out + err), out + err


# --------------------------------------------------------------------------- failures


@pytest.mark.timeout(120)
def test_a_hang_names_the_rank_that_did_not_answer_and_where_it_was():
    with ProcessPool(2, device_type="cpu", timeout=3) as pool:
        pool.run(_noop)  # started: the 3 s below are the call's alone
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            pool.run(_rank1_sleeps)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert re.search(r"_rank1_sleeps timed out: ranks \[1\] did not answer within 3 s", message)
    assert "ProcessPool(timeout=3)); ranks [0] finished." in message
    assert re.search(r"--- rank 1: no answer; where it was ---\n.*in _rank1_sleeps", message, re.S)
    assert 3 <= elapsed < 10, elapsed


@pytest.mark.timeout(120)
def test_a_killed_rank_is_reported_within_seconds_not_after_the_timeout():
    with ProcessPool(2, device_type="cpu", timeout=200) as pool:
        pool.run(_noop)
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            pool.run(_rank1_killed)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith(
        "_rank1_killed failed: rank 1 died (killed by signal SIGKILL); rank 0 raised"
    ), message
    assert "Its last output lines:\nrank 1 is about to be killed" in message
    assert "out-of-memory killer" in message  # the likely fix
    assert "Another rank failed or died while this one waited" in message  # rank 0's hint
    assert elapsed < 10, elapsed
    assert pool.broken
    with pytest.raises(WorkerError, match="failed earlier and was closed; make a new one"):
        pool.run(_noop)


def test_an_exit_without_exception_is_explained():
    # Pure: the report for a worker that left with os._exit(3) (a killed one is tested above).
    failure = _Failure.died(3, "about to leave\n")
    assert failure.summary == "died (exited with code 3)"
    assert failure.detail.startswith("Its last output lines:\nabout to leave\n")
    assert "e.g. with os._exit(); raise an exception instead" in failure.detail
    assert _Failure.died(-11, "").summary == "died (killed by signal SIGSEGV)"
    assert "crashed in native code" in _Failure.died(-11, "").detail


@pytest.mark.timeout(120)
def test_a_skipped_collective_fails_after_the_collective_timeout():
    with ProcessPool(2, device_type="cpu", timeout=200, collective_timeout=2) as pool:
        pool.run(_noop)
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            pool.run(_rank0_waits_alone)
    message = str(info.value)
    assert "_rank0_waits_alone failed: rank 0 raised" in message
    assert "waited longer than the collective timeout (2 seconds" in message
    assert time.monotonic() - start < 12


@pytest.mark.timeout(120)
def test_a_function_the_workers_cannot_import_names_the_fix(monkeypatch, pools):
    # A module only the caller has (e.g. made at run time): pickled by reference, so the
    # workers must import it, and cannot. A worker that cannot load a function keeps serving,
    # so the session's pool does (no process of its own to start).
    module = types.ModuleType("made_in_the_caller_only")
    exec("def compute():\n    return 1\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(WorkerError) as info:
        pools.run(1, module.compute)
    message = str(info.value)
    assert "compute failed: rank 0 could not load the function." in message
    assert "ModuleNotFoundError: No module named 'made_in_the_caller_only'" in message
    assert "Put it in a module on sys.path or PYTHONPATH" in message
    assert pools.run(1, _noop) == [None]  # the pool still serves


@pytest.mark.timeout(120)
def test_a_worker_that_cannot_join_the_process_group_is_reported():
    with pytest.raises(WorkerError) as info, ProcessPool(1, backend="no-such-backend") as pool:
        pool.run(_noop)
    message = str(info.value)
    assert "_noop failed: rank 0 failed to start." in message
    assert "init_distributed(backend='no-such-backend'): not a c10d backend" in message
    assert "Check the backend and device" in message


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_works(tmp_path):
    # With multiprocessing's spawn, workers re-run an unguarded script and die on import;
    # these workers never run the caller's __main__, and its functions travel by value.
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import functional_fsdp as ff

            OFFSET = 40

            def answer(x):
                print("computing")
                return x + OFFSET

            print("results:", ff.launch(answer, 1, 2))
            """
        )
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("results: [42]") == 1, out.stdout
    assert "[rank 0] computing" in out.stdout


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_destroy_process_group_leaves_no_collective_threads_for_interpreter_exit(tmp_path):
    # A process group still alive when Python finalizes keeps gloo's worker thread running
    # while the interpreter is torn down, and a thread that touches Python then aborts the
    # process at exit ("terminate called without an active exception"). After the usual
    # teardown, and once the script drops its mesh, the groups must be gone with their threads.
    script = tmp_path / "teardown.py"
    script.write_text(
        textwrap.dedent(
            """
            import gc
            import json
            import os

            import torch
            import torch.distributed as dist

            import functional_fsdp as ff


            def threads():
                names = []
                for t in os.listdir("/proc/self/task"):
                    with open(f"/proc/self/task/{t}/comm") as f:
                        names.append(f.read().strip())
                return sorted(names)


            def main():
                ff.init_distributed(device_type="cpu")
                mesh = ff.make_mesh({"dp": 2}, device_type="cpu")
                x = ff.shard({"w": torch.arange(8.0)}, mesh, ff.P("dp"))
                assert torch.equal(ff.gather(x)["w"], torch.arange(8.0))
                dist.barrier()
                dist.destroy_process_group()


            before = threads()
            main()
            gc.collect()
            # One file per rank: the ranks share torchrun's stdout, where their lines interleave.
            out = os.path.join(os.environ["OUT_DIR"], os.environ["RANK"] + ".json")
            with open(out, "w") as f:
                json.dump({"before": before, "after": threads()}, f)
            """
        )
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OUT_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in range(2):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["after"] == seen["before"], (rank, seen)

"""Shared fixtures: reusable gloo worker pools and simulated meshes.

Real multi-process pools are started once per session and per world size (starting
processes and a process group costs seconds on a 2-core machine), and replaced if a test
breaks one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from functional_fsdp.launcher import ProcessPool

_POOLS: dict[int, ProcessPool] = {}

# How many tests the whole suite has, when this run collected all of it (README.md states the
# number; tests/test_docs.py compares).
SUITE_SIZE = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect drop any
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    whole = config.args_source is pytest.Config.ArgsSource.TESTPATHS and not (
        config.getoption("ignore") or config.getoption("ignore_glob")
    )
    if whole:
        config.stash[SUITE_SIZE] = len(items)


class Pools:
    """``pools.run(world_size, fn, *args)`` runs ``fn`` on a reused pool of that size."""

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        pool = _POOLS.get(world_size)
        if pool is None or pool.broken:
            # One pool per world size, kept for the session: an idle worker blocks on its pipe
            # and costs memory, not CPU, while restarting a pool costs seconds of imports and
            # rendezvous each time a test switches between 2 and 4 ranks.
            if pool is not None:
                _POOLS.pop(world_size).close()
            pool = _POOLS[world_size] = ProcessPool(world_size, device_type="cpu", timeout=240)
        return pool.run(fn, *args, **kwargs)


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    yield Pools()
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

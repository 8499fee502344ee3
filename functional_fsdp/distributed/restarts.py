"""Joining the default process group so that a ``torchrun`` restart works as well as the start.

Since torch 2.4, ``torchrun``'s c10d rendezvous hands its workers a TCP store that the agent
keeps for the whole job (``TORCHELASTIC_USE_AGENT_STORE=True``), and ``init_process_group``
writes its keys there under fixed names. A restarted attempt finds the dead attempt's keys
still in the store: a gloo (or NCCL) group of the new attempt can read a dead worker's
address before the new one is written, and fails to connect or hangs (pytorch/pytorch#135712).
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it by giving every attempt a fresh store.

Without it, :func:`init_process_group` gives every attempt its own key prefix in the shared
store: a token that rank 0 draws and hands to each rank in answer to a greeting that rank
drew itself, so no rank can take a dead attempt's token. (``TORCHELASTIC_RESTART_COUNT`` is
not enough: each node's agent counts its own restarts, so the count can differ between
nodes.) Every group made afterwards, the mesh axes' groups included, lives under the prefix.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist

_KEY = "functional_fsdp/attempt"


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group(backend, timeout=timeout)`` from the ``torchrun`` environment,
    under a key prefix of this attempt's own when the agent's store is shared across attempts.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout
    )
    token = attempt_token(store, rank, world, timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{_KEY}/{token}/", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def attempt_token(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> str:
    """A token that every rank of this attempt gets, and no rank of an earlier attempt had.

    Each rank writes a fresh greeting under ``hello/<rank>``; rank 0 answers every greeting it
    sees with its own fresh token under ``reply/<greeting>`` (an earlier attempt's greeting
    gets an answer too, which nobody reads), and returns once every rank has confirmed the
    token under ``<token>/joined/<rank>``. Only the current attempt knows its greetings, so
    only it can read the answers.
    """
    mine = uuid.uuid4().hex
    store.set(f"{_KEY}/hello/{rank}", mine)
    if rank != 0:
        token = store.get(f"{_KEY}/reply/{mine}").decode()  # waits up to the store's timeout
        store.set(f"{_KEY}/{token}/joined/{rank}", "1")
        return token
    answered: dict[int, str] = {}
    joined = [f"{_KEY}/{mine}/joined/{r}" for r in range(1, world)]
    deadline = time.monotonic() + timeout.total_seconds()
    while joined and not store.check(joined):
        for r in range(1, world):
            if not store.check([f"{_KEY}/hello/{r}"]):
                continue
            hello = store.get(f"{_KEY}/hello/{r}").decode()
            if answered.get(r) != hello:
                store.set(f"{_KEY}/reply/{hello}", mine)
                answered[r] = hello
        if time.monotonic() > deadline:
            missing = [r for r, key in zip(range(1, world), joined) if not store.check([key])]
            raise RuntimeError(
                f"init_distributed: rank 0 waited {timeout.total_seconds():g} s for ranks "
                f"{missing} to join this attempt of the job (over torchrun's shared store at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}). Check that they "
                f"started and reach ff.init_distributed(); a longer timeout: "
                f"ff.init_distributed(timeout=...)."
            )
        time.sleep(0.005)
    return mine

"""Replica groups that survive a member's death: per-step fault tolerance on torchft.

A job is made of replica groups. Inside a group the mesh is the usual one (``dp``, ``tp``,
...) on plain c10d; across groups the model is replicated, and every step's gradients are
averaged over the groups that are alive at that step, through torchft's reconfigurable
process group. A group that dies costs the other groups the step it died in (the step is
not committed and is run again), never the job; a group that (re)joins receives the whole
training state, shard for shard, from a healthy group at a step boundary, with no checkpoint
read.

torchft's pieces do the distributed work: its lighthouse forms a quorum each step, its
``Manager`` reconfigures the cross-group process group, moves the state to a joining group
(HTTP, group rank to the same group rank) and decides whether a step commits. This module
adapts them to a pure ``train_step``: the state goes in and comes out, and torchft's
``state_dict`` / ``load_state_dict`` callbacks read the state the current step started from
and hand back the one a joining group received.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import optree
import torch
import torch.distributed as dist

from .._tree import NAMESPACE, keystr
from ..distributed.mesh import axis_sizes
from ..rng import traced
from ..sharded import Sharded
from ..spec import format_mesh

__all__ = ["ReplicaGroup", "ReplicaMismatchError"]


class ReplicaMismatchError(ValueError):
    """A joining replica group's training state does not match the quorum's."""


def _describe(leaf: Any) -> str:
    if isinstance(leaf, Sharded):
        kind = str(leaf.dtype).removeprefix("torch.")
        return f"{tuple(leaf.global_shape)} {kind} {leaf.spec.trimmed()} on {format_mesh(axis_sizes(leaf.mesh))}"
    if isinstance(leaf, torch.Tensor):
        return f"{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
    return type(leaf).__name__


def _signature(state: Any) -> tuple[Any, list[str], list[str]]:
    """The state's structure (down to the local tensors), and the key path and description
    (global shape, dtype, spec and mesh) of each of its values."""
    treedef = optree.tree_structure(state, namespace=NAMESPACE)
    paths, values, _ = optree.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, Sharded), namespace=NAMESPACE
    )
    return treedef, [keystr(p) for p in paths], [_describe(x) for x in values]


class ReplicaGroup:
    """This process's replica group in a fault-tolerant job (torchft).

    Give it to :func:`~functional_fsdp.train_step` (``replicas=``). Each step then

    1. forms a quorum of the groups alive (torchft's lighthouse); a group that joins, or
       that fell behind, first receives the training state (parameters, optimizer state,
       step, random key, buffers) from a healthy group, each rank from the rank with the
       same position in its group;
    2. computes the gradients of the group's own batch on the group's mesh, as without
       fault tolerance;
    3. sums the gradients, the loss and the count over the quorum's groups (one all-reduce
       of the gradients, one of the loss; a lost group's batch is skipped, not
       redistributed): the step's loss and gradients are those of the union of the
       participating groups' batches (the mean over the groups for a scalar loss, the
       token mean for a ``(sum, count)`` loss);
    4. commits only if every participant finished its collectives (torchft's
       ``should_commit``); otherwise it returns the input state, ``metrics["committed"]``
       is false, and the caller runs the step again (a loop that indexes its data by
       ``state.step`` feeds it the same batch).

    Every group must build the same model, mesh shape, optimizer and state structure: a
    group whose state differs from the state it receives raises
    :class:`ReplicaMismatchError` naming the first difference; the others go on.

    Args:
        replica_id: this group's name, the same on every rank of the group and different
            between groups (e.g. ``"0"``, ``"1"``; a trailing number orders them).
        lighthouse: the lighthouse's address (``http://host:port``); default: the
            ``TORCHFT_LIGHTHOUSE`` environment variable.
        min_replicas: the fewest groups a step may commit with.
        timeout: seconds any collective, commit vote or state transfer may take.
        quorum_timeout: seconds to wait for a quorum.
        store: ``(host, port)`` of this group's c10d store (torchrun's ``MASTER_ADDR`` and
            ``MASTER_PORT`` by default): torchft's manager server of the group registers
            there.

    Example:
        >>> import functional_fsdp as ff
        >>> group = ff.ft.ReplicaGroup("0", min_replicas=1)  # connects at the first step
        >>> group.replica_id, group.min_replicas
        ('0', 1)
        >>> # Under torchrun, with TORCHFT_LIGHTHOUSE set (docs/guides/fault-tolerance.md):
        >>> step = ff.train_step(loss_fn, opt, model=sm, replicas=group)  # doctest: +SKIP
        >>> while state.step < 1000:  # doctest: +SKIP
        ...     state, metrics = step(state, batch_of(group.replica_id, state.step))
        >>> group.shutdown()
    """

    def __init__(
        self,
        replica_id: str,
        *,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        timeout: float = 60.0,
        quorum_timeout: float = 60.0,
        store: tuple[str, int] | None = None,
    ) -> None:
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError(
                f"ReplicaGroup: replica_id must be a non-empty string naming this group "
                f"(the same on its ranks, different between groups), got {replica_id!r}."
            )
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError(
                f"ReplicaGroup: min_replicas must be an int >= 1 (the fewest groups a step may "
                f"commit with), got {min_replicas!r}."
            )
        self.replica_id = replica_id
        self.min_replicas = min_replicas
        self._lighthouse = lighthouse
        self._timeout = datetime.timedelta(seconds=timeout)
        self._quorum_timeout = datetime.timedelta(seconds=quorum_timeout)
        self._store = store
        self._manager: Any = None
        self._current: Any = None  # the state the running step started from
        self._received: Any = None  # the state a heal handed over, until the step takes it
        self.contributes = 1.0  # 0.0 in a step this group joins at: its batch counts nothing
        self.contributors: Any = 1  # how many groups' batches the current step counts

    # torchft's callbacks: the state served to a joining group, and the state received.
    def _state_dict(self) -> dict[str, Any]:
        _, paths, described = _signature(self._current)
        leaves = optree.tree_leaves(self._current, namespace=NAMESPACE)
        return {"paths": paths, "described": described, "leaves": leaves}

    def _load_state_dict(self, sd: dict[str, Any]) -> None:
        treedef, paths, described = _signature(self._current)
        for what, mine, theirs in (
            ("paths", paths, sd["paths"]),
            ("leaves", described, sd["described"]),
        ):
            if mine != theirs:
                raise ReplicaMismatchError(
                    _mismatch(self.replica_id, what, paths, mine, theirs, sd)
                )
        self._received = optree.tree_unflatten(treedef, sd["leaves"])

    def _start(self) -> Any:
        try:
            import torchft
        except ImportError as e:  # pragma: no cover - the extra is installed in CI
            raise ImportError(
                "ReplicaGroup needs torchft: pip install 'functional_fsdp[ft]' (or torchft)."
            ) from e
        if not dist.is_initialized():
            raise RuntimeError(
                "ReplicaGroup: initialise this group's processes first (torchrun, or "
                "ff.init_distributed()); each replica group is its own c10d world."
            )
        host, port = self._store or (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        return torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=self._timeout),
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # a joining group heals before its forward
            timeout=self._timeout,
            quorum_timeout=self._quorum_timeout,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=host,
            store_port=port,
            lighthouse_addr=self._lighthouse,
            replica_id=self.replica_id,
            # No transfer at step 0: every group starts from the same state (the same seed,
            # as every data-parallel rank does). torchft would otherwise heal rank by rank
            # from sources picked per rank, leaving every group with a rank that took
            # another group's state, and no batch counted in step 0.
            init_sync=False,
        )

    def connect(self) -> None:
        """Join the job now: start this group's torchft manager, which registers with the
        lighthouse (the first step does it otherwise). Groups that all connect before any of
        them steps are all in the first quorum; one that connects later joins a later
        quorum and takes the state from a healthy group.

        Example:
            >>> import functional_fsdp as ff
            >>> group = ff.ft.ReplicaGroup("0")
            >>> group.connect()  # doctest: +SKIP
        """
        if self._manager is None:
            self._manager = self._start()

    # What train_step calls, in order, once per step.
    def begin(self, state: Any) -> Any:
        """Form this step's quorum; return the state to step from (a healthy group's when
        this one joins or fell behind)."""
        first = next(iter(optree.tree_leaves(state, namespace=NAMESPACE)), None)
        if isinstance(first, torch.Tensor) and traced(first):
            raise TypeError(
                "ff.jit cannot trace a step with replicas= (its quorum, commit vote and state "
                "transfer run on the host each step): run that step eagerly."
            )
        self.connect()
        self._current, self._received = state, None
        self._manager.start_quorum()
        if self._manager.errored() is not None:
            return state
        healed, self._received = self._received, None
        # torchft heals rank by rank (each rank from a source group picked for its group
        # rank), so one rank of this group may have taken a state while the others kept
        # theirs. The group's batch counts only if none did: each rank holds a shard of it.
        kept = torch.tensor([1.0 if healed is None else 0.0])
        dist.all_reduce(kept, op=dist.ReduceOp.MIN)
        self.contributes = float(kept)
        return state if healed is None else healed

    def sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sums over the quorum's groups of ``tensors``: one all-reduce, in float32
        (float64 if any tensor is), each result rounded back to its tensor's dtype."""
        if not tensors:
            return []
        wide = any(t.dtype == torch.float64 for t in tensors)
        dtype = torch.float64 if wide else torch.float32
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
        if not self.contributes:  # a joining group's step: its values (even NaN) count nothing
            flat = torch.zeros_like(flat)
        self._manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        out, at = [], 0
        for t in tensors:
            out.append(flat[at : at + t.numel()].reshape(t.shape).to(t.dtype))
            at += t.numel()
        return out

    def sum_outputs(self, total: torch.Tensor) -> torch.Tensor:
        """``total`` (the step's loss, count and auxiliary values, flat) summed over the
        quorum, with the number of groups whose batch counts (:attr:`contributors`)."""
        flag = torch.ones(1, dtype=total.dtype, device=total.device)
        summed = self.sum([torch.cat([total.reshape(-1), flag])])[0]
        self.contributors = summed[-1].round()
        return summed[:-1]

    def commit(self) -> bool:
        """Whether every participant's step succeeded (the same answer in the group)."""
        return bool(self._manager.should_commit())

    def shutdown(self) -> None:
        """Leave the job: stop this group's manager server and process group."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None


def _mismatch(
    replica: str, what: str, paths: list[str], mine: list[str], theirs: list[str], sd: Any
) -> str:
    if what == "paths":
        extra = sorted(set(mine) ^ set(theirs))[:4]
        first = f"the leaves differ ({len(mine)} here, {len(theirs)} received; e.g. {extra})"
    else:
        i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        first = f"{paths[i]}: {mine[i]} here, {theirs[i]} in the quorum's state"
    return (
        f"replica group {replica!r} cannot join: its training state differs from the "
        f"quorum's: {first}. Every group must build the same model, mesh shape, optimizer "
        f"and TrainState (same trainable parameters, opt_specs and buffers)."
    )

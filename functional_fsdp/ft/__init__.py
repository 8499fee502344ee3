"""Fault tolerance across replica groups, on torchft: :class:`ReplicaGroup`, given to
``ff.train_step(..., replicas=)``, makes each step run on the replica groups alive at that
step, and a group that (re)joins receive the training state from a healthy one. See
docs/guides/fault-tolerance.md.

Example:
    >>> import functional_fsdp as ff
    >>> ff.ft.ReplicaGroup("1").replica_id  # this group's name in the job
    '1'
"""

from .replicas import ReplicaGroup as ReplicaGroup
from .replicas import ReplicaMismatchError as ReplicaMismatchError

__all__ = ["ReplicaGroup", "ReplicaMismatchError"]

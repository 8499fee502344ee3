"""Fault tolerance across replica groups, on torchft: :class:`ReplicaGroup`, given to
``ff.train_step(..., replicas=)``, makes each step run on the replica groups alive at that
step, and a group that (re)joins receive the training state from a healthy one;
:func:`launch` runs such a job on this machine with failures injected. See
docs/guides/fault-tolerance.md.

Example:
    >>> import functional_fsdp as ff
    >>> ff.ft.ReplicaGroup("1").replica_id  # this group's name in the job
    '1'
"""

from .launch import StepRecord as StepRecord
from .launch import launch as launch
from .replicas import ReplicaGroup as ReplicaGroup
from .replicas import ReplicaMismatchError as ReplicaMismatchError

__all__ = ["ReplicaGroup", "ReplicaMismatchError", "StepRecord", "launch"]

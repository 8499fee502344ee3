"""Context parallelism: a mesh axis (``"cp"``) that splits the sequence.

On ``ff.make_mesh({"dp": 2, "cp": 2})`` the batch is split over ``dp`` and each sequence over
``cp`` (two chunks per rank, load-balanced for causal attention: :func:`chunk_layout`).
Parameters are sharded over ``dp × cp`` as FSDP shards them over any data axes, and their
gradients reduced over both: ``cp`` ranks hold different tokens of the same examples, so it is
a data axis whose share is a slice of the sequence rather than of the batch. Attention is the
one layer that needs the other ranks' tokens: :func:`attention` all-gathers keys and values
over ``cp`` and masks by global position, so the loss and gradients are one process's on the
global batch. See docs/guides/context-parallel.md.

Example:
    >>> import functional_fsdp as ff
    >>> ff.cp.chunk_layout(8, 2)  # the global token indices each cp rank holds
    [[0, 1, 6, 7], [2, 3, 4, 5]]
"""

from .attention import ATTENTION_NAME as ATTENTION_NAME
from .attention import attention as attention
from .attention import hf_attention as hf_attention
from .attention import positions as positions
from .attention import register_attention as register_attention
from .layout import chunk_layout as chunk_layout
from .layout import pad_sequence as pad_sequence

__all__ = [
    "ATTENTION_NAME",
    "attention",
    "chunk_layout",
    "hf_attention",
    "pad_sequence",
    "positions",
    "register_attention",
]

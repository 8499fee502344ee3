"""Graph passes this library hands to inductor when :func:`~functional_fsdp.jit` compiles a
step (imported only then: importing inductor takes about a second)."""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ._fx import writes_in_place


class EarlyMatmuls(CustomGraphPass):
    """Run each matrix product of a folded ``mm(a, b) + c`` where ``a`` and ``b`` are ready.

    Inductor's pattern matcher folds ``mm(a, b) + c`` into one ``addmm(c, a, b)``, placed
    where ``c`` is ready. A tied weight gets such a sum: an LM head sharing the token
    embedding has the head's gradient matmul added to the embedding's gradient, which is
    ready only at the end of the backward. Folded, the head's matmul waits there, and its
    inputs (the final norm's output and the logits' gradient, activation-sized) stay alive
    through the whole backward: 0.5 MiB of a 4-layer GPT's 19.6 MiB step at width 128. Split
    back, the matmul runs where its inputs are ready and only its (smaller) result waits.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        writes = [order[n] for n in graph.nodes if writes_in_place(n)]
        for node in list(graph.nodes):
            if (
                node.target is not torch.ops.aten.addmm.default
                or node.kwargs.get("beta", 1) != 1
                or node.kwargs.get("alpha", 1) != 1
            ):
                continue
            c, a, b = node.args[:3]
            if not all(isinstance(x, torch.fx.Node) and "val" in x.meta for x in (c, a, b)):
                continue
            ready = a if order[a] > order[b] else b
            if order[c] < order[ready] or _bytes(node) >= _bytes(a) + _bytes(b):
                continue
            if any(order[ready] < i < order[node] for i in writes):
                continue  # an in-place write in between: the matmul reads what it leaves
            while ready.next.op == "placeholder":  # after the graph's inputs
                ready = ready.next
            with graph.inserting_after(ready):
                mm = graph.call_function(torch.ops.aten.mm.default, (a, b))
            with graph.inserting_before(node):
                total = graph.call_function(torch.ops.aten.add.Tensor, (c, mm))
            mm.meta["val"] = node.meta["val"].new_empty(node.meta["val"].shape)
            total.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(total)
            graph.erase_node(node)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


def _bytes(node: torch.fx.Node) -> int:
    value = node.meta["val"]
    return value.numel() * value.element_size()

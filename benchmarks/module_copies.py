"""What the per-call module copies cost: ``FSDP.apply`` runs each call on its own shallow
copies of the module tree (so the user's module is never changed, even during a call).

Builds Llama-7B's shape (``transformers.LlamaConfig()``'s defaults) on ``meta`` and times
``copy_modules`` over its module tree, in wall and CPU time per copy:

    python benchmarks/module_copies.py [--repeat 100]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from functional_fsdp.fsdp.runtime import copy_modules

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig())
    named = tuple(model.named_modules(remove_duplicate=False))
    copy_modules(named)  # warm-up
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.repeat):
        copy_modules(named)
    wall = (time.perf_counter() - wall) / args.repeat * 1e3
    cpu = (time.process_time() - cpu) / args.repeat * 1e3
    print(f"{len(named)} modules: {wall:.2f} ms wall, {cpu:.2f} ms CPU per copy")


if __name__ == "__main__":
    main()

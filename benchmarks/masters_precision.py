"""How far ``ff.master_weights`` is from fp32 parameters computing in the same bf16 policy.

Run from the repository root: ``python benchmarks/masters_precision.py`` (2 gloo ranks on
CPU). Per case (model, strategy, accumulate, reduce dtype): the largest difference of any
gradient the optimizer got and of any master after 2 AdamW steps (absolute, and relative to
the largest reference value of that tensor), whether each is bitwise equal, and the dtype of
the gradients the optimizer got. The workers are the tests' (``tests/_masters_workers.py``).
"""

from __future__ import annotations

import time

import torch

from functional_fsdp.launcher import ProcessPool
from tests import _masters_workers as W

CASES = [("llama", "fsdp", k, rd) for rd in (torch.float32, torch.bfloat16) for k in (1, 2, 16)]
CASES += [("llama", s, k, torch.float32) for s in ("zero2", "zero1", "fsdp_local") for k in (1, 16)]


def main() -> None:
    pool = ProcessPool(2, device_type="cpu", timeout=900)
    start = time.time()
    try:
        results = pool.run(W.compare_many, CASES)[0]
    finally:
        pool.close()
    for (model, strategy, k, rd), r in results.items():
        print(
            f"{model} {strategy} k={k} reduce={str(rd).removeprefix('torch.')}: "
            f"grads {r['grad_abs']:.2g} ({r['grad_rel']:.2g}), "
            f"masters {r['value_abs']:.2g} ({r['value_rel']:.2g}), "
            f"bitwise {r['grads_equal'] and r['values_equal']}, grads in {r['grad_dtypes']}"
        )
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""A torchrun job whose first attempt fails on purpose, for the restart test.

Both ranks join the group and run a collective; then, on the first attempt only, rank 1
exits with an error. torchrun (``--max-restarts 1``) starts a second attempt, which joins a
new group in the same shared store and runs a collective. Each rank of it prints one line.
"""

from __future__ import annotations

import os
import sys

import torch

import functional_fsdp as ff


def main() -> None:
    ff.init_distributed()
    mesh = ff.make_mesh({"dp": 2})
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = torch.distributed.get_rank()
    ff.all_reduce(torch.ones(1), mesh, "dp")
    if attempt == 0 and rank == 1:
        sys.exit("rank 1 fails on purpose in the first attempt")
    total = ff.all_reduce(torch.tensor([rank + 1.0]), mesh, "dp")
    store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    # One write per line: two ranks share torchrun's stdout, and print() writes the text and
    # its newline separately, so the two lines could interleave.
    line = f"attempt {attempt} rank {rank} sum {float(total)} shared store {store}\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

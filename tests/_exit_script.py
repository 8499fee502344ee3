"""End-of-job patterns under torchrun: train a few steps, then end as real jobs end.

``torchrun --nproc-per-node N tests/_exit_script.py PATTERN DIR`` with PATTERN one of
:data:`PATTERNS`. A finished job must exit 0 on every rank; a gloo worker still releasing the
last collective while Python finalizes aborted it ("terminate called without an active
exception"). With ``FF_EXIT_THREADS`` set, each rank writes the threads still alive after the
library's exit hook (an ``atexit`` hook registered before it runs after it) to
``$FF_EXIT_THREADS.<rank>``.
"""

from __future__ import annotations

import atexit
import os
import sys


def _threads() -> list[str]:
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def _write_threads() -> None:
    with open(f"{os.environ['FF_EXIT_THREADS']}.{os.environ['RANK']}", "w") as f:
        f.write(" ".join(_threads()))


PATTERNS = ("gather", "destroy", "export", "save", "close")

# Under a main guard (pytest's doctest collection imports this file), yet at module level on
# purpose: the mesh, the state (whose Sharded values hold the mesh) and the manager are module
# globals that stay alive until the interpreter exits, as in a plain training script.
if __name__ == "__main__":
    if os.environ.get("FF_EXIT_THREADS"):
        atexit.register(_write_threads)  # before torch and the library register theirs

    import torch
    import torch.distributed as dist

    import functional_fsdp as ff
    from functional_fsdp.models import GPT, GPTConfig, lm_loss

    pattern, directory = sys.argv[1], sys.argv[2]
    ff.init_distributed(device_type="cpu")
    mesh = ff.make_mesh({"dp": dist.get_world_size()}, device_type="cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=64))
    sharded = ff.fsdp(model, mesh)
    optimizer = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(1e-3))

    def loss_fn(params, batch):
        return lm_loss(sharded.apply(params, batch[:, :-1]), batch[:, 1:])

    step = ff.train_step(loss_fn, optimizer, model=sharded)
    state = ff.TrainState.create(sharded.shard(), optimizer)
    gen = torch.Generator().manual_seed(1)
    manager = None
    if pattern in ("save", "close"):
        manager = ff.checkpoint.CheckpointManager(
            directory, save_every=2, async_save=pattern == "close"
        )
    for _ in range(4):
        state, metrics = step(state, torch.randint(0, 97, (8, 17), generator=gen))
        if manager is not None:
            manager.save(state.step, {"state": state})
    if pattern in ("gather", "destroy", "export"):
        full = ff.gather(state.params)  # the job's last collective
        if pattern == "export" and dist.get_rank() == 0:
            torch.save(full, os.path.join(directory, "model.pt"))
        if pattern == "destroy":
            dist.destroy_process_group()
    elif pattern == "save":  # a synchronous save is the last collective; the manager stays open
        manager.save(int(state.step), {"state": state}, force=True)
    elif pattern == "close":
        manager.close()
    else:
        raise SystemExit(f"unknown pattern {pattern!r}; one of {PATTERNS}")

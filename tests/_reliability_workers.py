"""Worker functions for the reliability tests: crashes, corrupt files, the manager (real gloo)."""

from __future__ import annotations

import contextlib
import datetime
import os
import resource
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import functional_fsdp as ff
from functional_fsdp.checkpoint import CheckpointError, CheckpointManager, _atomic
from functional_fsdp.distributed.process import free_port
from functional_fsdp.models import GPT, GPTConfig, lm_loss

from ._fsdp_workers import CFG
from ._hf import tiny_llama_config

# --------------------------------------------------------------------------- a tiny run


def batch(gen: torch.Generator, cfg: GPTConfig = CFG) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (4, 13), generator=gen)


def setup(cfg: GPTConfig = CFG, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(cfg)
    f = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.adamw(1e-2, eps=1e-6, weight_decay=0.01)
    step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
    return f, opt, step, ff.TrainState.create(f.shard(), opt)


def trained(steps: int) -> ff.TrainState:
    """The state after ``steps`` steps (deterministic: the same on every call)."""
    _, _, step, state = setup()
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        state, _ = step(state, batch(gen))
    return state


def template() -> ff.TrainState:
    return setup(seed=123)[3]


def full(state: ff.TrainState) -> dict[str, torch.Tensor]:
    return ff.gather(state.params)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- crashes


def _crash_entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    ff.init_distributed(device_type="cpu", timeout=datetime.timedelta(seconds=60))
    fn(*args)
    dist.barrier()
    dist.destroy_process_group()


def run_until_killed(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60
) -> list[int | None]:
    """Run ``fn`` on ``world`` fresh processes; once one dies, SIGKILL the rest (as torchrun's
    agent would). Returns the exit codes (``-9`` for SIGKILL)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # torch imported once, processes fork quickly
    port = free_port()
    procs = [
        ctx.Process(target=_crash_entry, args=(r, world, port, fn, args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while all(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join(timeout=10)
    return [p.exitcode for p in procs]


def _kill_at(phase: str, rank: int) -> None:
    def hook(name: str) -> None:
        if name == phase and dist.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGKILL)

    _atomic._on_phase = hook


def save_then_crash(path: str, target: str, phase: str, crash_rank: int) -> None:
    """Save the 1-step state to ``path``, then save the 2-step state to ``target`` and
    SIGKILL ``crash_rank`` at ``phase`` of that save."""
    ff.checkpoint.save(path, trained(1))
    _kill_at(phase, crash_rank)
    ff.checkpoint.save(target, trained(2))


def manager_then_crash(directory: str, phase: str, crash_rank: int, async_save: bool) -> None:
    """Manager saves steps 2 and 4; the save of step 6 is killed at ``phase``."""
    _, _, step, state = setup()
    gen = torch.Generator().manual_seed(1)
    mgr = CheckpointManager(directory, save_every=2, keep_last=2, async_save=async_save)
    for _ in range(6):
        state, _ = step(state, batch(gen))
        if state.step == 6:
            mgr.wait()
            _kill_at(phase, crash_rank)
        mgr.save(state.step, {"state": state, "rng": gen.get_state()})
    mgr.close()


def after_crash(path: str, target: str) -> dict:
    """What a restarted job sees at ``path`` and ``target``: the params loaded there
    (compared with the 1- and 2-step states) or the error message."""
    expected = {1: full(trained(1)), 2: full(trained(2))}
    out: dict[str, Any] = {}
    for name, p in (("path", path), ("target", target)):
        try:
            got = full(ff.checkpoint.load(p, template()))
            out[name] = next((k for k, v in expected.items() if _same(got, v)), "other")
        except CheckpointError as e:
            out[name] = str(e)
    out["leftovers"] = sorted(x.name for x in Path(path).parent.iterdir())
    return out


def manager_after_crash(directory: str) -> dict:
    mgr = CheckpointManager(directory, save_every=2, keep_last=2)
    latest = mgr.latest_step()
    like = {"state": template(), "rng": torch.Generator().get_state()}
    got = mgr.restore(like)
    mgr.close()
    return {
        "latest": latest,
        "restored_step": got["state"].step,
        "bitwise": _same(full(got["state"]), full(trained(4))),
        "listing": sorted(p.name for p in Path(directory).iterdir()),
    }


# --------------------------------------------------------------------------- damage


def _damage(src: Path, dst: Path, how: str) -> None:
    shutil.copytree(src, dst)
    data = sorted(dst.glob("__1_*.distcp"))[0]
    if how == "flip_16_bytes":
        raw = bytearray(data.read_bytes())
        mid = len(raw) // 2
        raw[mid : mid + 16] = bytes(b ^ 0xFF for b in raw[mid : mid + 16])
        data.write_bytes(bytes(raw))
    elif how == "truncate_data":
        os.truncate(data, data.stat().st_size // 2)
    elif how == "truncate_metadata":
        meta = dst / ".metadata"
        os.truncate(meta, meta.stat().st_size // 2)
    elif how == "no_marker":
        (dst / _atomic.MARKER).unlink()
    elif how == "garbled_marker":
        (dst / _atomic.MARKER).write_text("{not json")
    elif how == "missing_file":
        data.unlink()


def damaged_loads(root: str, cases: list[str]) -> dict[str, str]:
    """Save once, copy it with one kind of damage per case, load each: the error messages."""
    good = Path(root) / "good"
    ff.checkpoint.save(good, trained(1))
    if dist.get_rank() == 0:
        for how in cases:
            _damage(good, Path(root) / how, how)
    dist.barrier()
    out = {}
    for how in [*cases, "missing_dir"]:
        try:
            ff.checkpoint.load(Path(root) / how, template())
            out[how] = "loaded"
        except CheckpointError as e:  # an OSError: `except Exception` catches it
            out[how] = str(e)
    # Without verification DCP's own failure still comes out as a CheckpointError.
    for how in ("truncate_data", "truncate_metadata"):
        try:
            ff.checkpoint.load(Path(root) / how, template(), verify=False)
            out[how + "_unverified"] = "loaded"
        except CheckpointError as e:
            out[how + "_unverified"] = str(e)
    out["good_bitwise"] = str(_same(full(ff.checkpoint.load(good, template())), full(trained(1))))
    return out


def other_model(root: str) -> dict[str, str]:
    """A checkpoint loaded into another model's template: ValueErrors that name the key."""
    path = Path(root) / "gpt"
    ff.checkpoint.save(path, trained(1))
    out = {}
    wider = GPTConfig(n_layer=2, vocab_size=61, n_embd=48, n_head=3, block_size=16)
    deeper = GPTConfig(n_layer=3, vocab_size=61, n_embd=36, n_head=3, block_size=16)
    for name, cfg in (("wider", wider), ("deeper", deeper)):
        try:
            ff.checkpoint.load(path, setup(cfg)[3])
            out[name] = "loaded"
        except ValueError as e:
            out[name] = str(e)
    return out


@contextlib.contextmanager
def _unprivileged() -> Iterator[None]:
    """Permission bits bind root too: run as ``nobody`` (effective uid only, reversible)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def unwritable(kind: str) -> dict[str, Any]:
    """Save into a read-only directory or a full disk (``RLIMIT_FSIZE``): the error message,
    and whether the previous checkpoint there still loads bitwise."""
    root = None
    if dist.get_rank() == 0:
        root = tempfile.mkdtemp(prefix="ff-unwritable-")
        os.chmod(root, 0o755)
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    path = Path(root) / "ckpt"
    ff.checkpoint.save(path, trained(1))
    dist.barrier()
    if kind == "read_only" and dist.get_rank() == 0:
        os.chmod(root, 0o555)
    dist.barrier()
    message = "saved"
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        if kind == "full":
            resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))
        with _unprivileged() if kind == "read_only" else contextlib.nullcontext():
            ff.checkpoint.save(path, trained(2))
    except Exception as e:  # what a training loop would write: it must catch the error
        message = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, old_handler)
    previous = _same(full(ff.checkpoint.load(path, template())), full(trained(1)))
    dist.barrier()
    if dist.get_rank() == 0:
        os.chmod(root, 0o755)
        leftovers = sorted(p.name for p in Path(root).iterdir())
        shutil.rmtree(root)
    else:
        leftovers = []
    return {"message": message, "previous_bitwise": previous, "leftovers": leftovers}


# --------------------------------------------------------------------------- the manager


def manager_run(directory: str, async_save: bool, steps: int = 9) -> dict:
    """Save every 2 steps, keep the last 2 and every 4th; restore the latest into a fresh
    template and continue: the losses equal the uninterrupted run's, bitwise."""
    _, _, step, state = setup()
    gen = torch.Generator().manual_seed(1)
    losses = []
    mgr = CheckpointManager(
        directory, save_every=2, keep_last=2, keep_every=4, async_save=async_save
    )
    saved = []
    for _ in range(steps):
        state, metrics = step(state, batch(gen))
        losses.append(float(metrics["loss"]))
        saved.append(mgr.save(state.step, {"state": state, "rng": gen.get_state()}))
    mgr.wait()
    kept = mgr.all_steps()
    again = mgr.save(8, {"state": state, "rng": gen.get_state()})  # exists: not rewritten
    mgr.close()

    # A restarted job: fresh template, a fresh generator, restore the latest, continue.
    mgr = CheckpointManager(directory, save_every=2, keep_last=2, keep_every=4)
    latest = mgr.latest_step()
    fresh_gen = torch.Generator().manual_seed(999)
    got = mgr.restore({"state": template(), "rng": fresh_gen.get_state()})
    fresh_gen.set_state(got["rng"])
    resumed = got["state"]
    resumed_losses = []
    for _ in range(latest, steps):
        resumed, metrics = step(resumed, batch(fresh_gen))
        resumed_losses.append(float(metrics["loss"]))
    older = mgr.restore({"state": template(), "rng": fresh_gen.get_state()}, step=4)
    try:
        mgr.restore({"state": template(), "rng": fresh_gen.get_state()}, step=2)
        missing = "restored"
    except CheckpointError as e:
        missing = str(e)
    mgr.close()
    return {
        "saved": saved,
        "kept": kept,
        "again": again,
        "latest": latest,
        "resumed_losses": resumed_losses,
        "tail_losses": losses[latest:],
        "final_bitwise": _same(full(resumed), full(state)),
        "older_step": older["state"].step,
        "missing": missing,
    }


def empty_manager(directory: str) -> str:
    mgr = CheckpointManager(directory, save_every=2)
    try:
        mgr.restore({"state": template()})
        return "restored"
    except CheckpointError as e:
        return str(e)
    finally:
        mgr.close()


def hf_resume(directory: str, async_save: bool) -> dict:
    """A transformers Llama (from a config, attention dropout 0.1) trained 4 steps; restore
    step 2 into a fresh model's state (another seed, another random key) and take steps 3-4
    again: the losses are bitwise equal (the key came back with the state)."""
    from transformers import LlamaForCausalLM

    def build(seed: int):
        torch.manual_seed(seed)
        cfg = tiny_llama_config(attention_dropout=0.1)
        model = LlamaForCausalLM(cfg)
        model.config.use_cache = False
        f = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
        opt = ff.adamw(1e-2, eps=1e-6, weight_decay=0.01)
        step = ff.train_step(lambda p, b: f.apply(p, input_ids=b, labels=b).loss, opt, model=f)
        return step, ff.TrainState.create(f.shard(), opt, rng=seed)

    step, state = build(0)
    gen = torch.Generator().manual_seed(3)
    losses = []
    with CheckpointManager(directory, save_every=2, async_save=async_save) as mgr:
        for _ in range(4):
            state, metrics = step(state, torch.randint(0, 96, (4, 10), generator=gen))
            losses.append(float(metrics["loss"]))
            mgr.save(state.step, {"state": state, "rng": gen.get_state()})
        mgr.wait()
        step2, fresh = build(7)
        got = mgr.restore({"state": fresh, "rng": gen.get_state()}, step=2)
    gen2 = torch.Generator()
    gen2.set_state(got["rng"])
    resumed, again = got["state"], []
    for _ in range(2):
        resumed, metrics = step2(resumed, torch.randint(0, 96, (4, 10), generator=gen2))
        again.append(float(metrics["loss"]))
    return {
        "tail": losses[2:],
        "again": again,
        "bitwise": _same(ff.gather(resumed.params), ff.gather(state.params)),
    }

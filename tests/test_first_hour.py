"""What a newcomer meets in the first hour: each mistake gets an error that names the real fix.

A model built inside a simulation and used by another, a checkpoint on a simulated mesh, a
notebook function that reads a global torch cannot pickle, a tensor-parallel axis not named
``"tp"``, and ``finetune_lora.py --resume`` with nothing left to train.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import functional_fsdp as ff
from functional_fsdp import launcher
from functional_fsdp.models import GPT, GPTConfig, gpt_plan

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)


# --------------------------------------------------------------------------- simulated meshes


def test_a_model_built_inside_one_simulation_is_refused_by_the_next_naming_the_fix():
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    ff.simulated_mesh({"dp": 2}, persistent=True)
    try:
        inside = build()  # one tensor per simulated rank
    finally:
        ff.end_simulation()
    with (
        ff.simulated_mesh({"dp": 4}) as mesh,
        pytest.raises(
            ValueError,
            match=r"ff\.fsdp\(module, mesh\): the module's tensor '0\.weight' \(shape \(8, 4\)\) "
            r"holds one tensor per rank of a 2-rank simulation.*Build the model before the "
            r"simulation starts \(outside ff\.simulated_mesh",
        ),
    ):
        ff.fsdp(inside, mesh)
    # The fix: built outside any simulation, the same model runs in both.
    outside = build()
    x = torch.randn(3, 4)
    for world in (2, 4):
        with ff.simulated_mesh({"dp": world}) as mesh:
            sm = ff.fsdp(outside, mesh)
            for value in ff.rank_values(sm.apply(sm.shard(), x)):
                torch.testing.assert_close(value, outside(x))


def test_metrics_on_a_simulated_mesh_are_plain_tensors():
    # docs/guides/jupyter.md: metrics format directly; rank_values of one is [it].
    torch.manual_seed(0)
    model = GPT(CFG)
    batch = torch.randint(0, CFG.vocab_size, (4, 9))
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(model, mesh)
        opt = ff.adamw(1e-3)
        step = ff.train_step(
            lambda p, b: F.cross_entropy(sm.apply(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()),
            opt,
            model=sm,
        )
        _, metrics = step(ff.TrainState.create(sm.shard(), opt), batch)
        loss = metrics["loss"]
        assert type(loss) is torch.Tensor
        assert ff.rank_values(loss) == [loss]
    expected = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    assert f"{loss:.4f}" == f"{expected:.4f}"


@pytest.mark.parametrize("call", ["save", "load", "CheckpointManager"])
def test_checkpoints_on_a_simulated_mesh_name_real_processes_as_the_fix(call, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        params = ff.fsdp(model, mesh).shard()
        match = r"on ff\.simulated_mesh: .*one real process per rank.*torchrun.*ff\.launch"
        where = {"save": r"ff\.checkpoint\.save", "load": r"ff\.checkpoint\.load"}.get(call, call)
        with pytest.raises(ValueError, match=f"^{where} {match}"):
            if call == "save":
                ff.checkpoint.save(tmp_path / "c", params)
            elif call == "load":
                ff.checkpoint.load(tmp_path / "c", params)
            else:
                ff.checkpoint.CheckpointManager(tmp_path / "c", save_every=1)
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------- ff.launch


def _notebook_function(name: str, body: str, **globals_: object) -> types.FunctionType:
    """A function defined in a notebook: its module is not importable, so it is sent by value."""
    namespace = {"__name__": "__notebook_cell__", **globals_}
    exec(compile(body, "<cell>", "exec"), namespace)
    return namespace[name]


@pytest.mark.multiprocess
def test_a_notebook_function_reading_torchs_config_modules_is_sent_by_name(pools):
    import torch.distributed.config as dist_config

    body = "def f(x):\n    import os\n    return cfg.__name__, x, os.getpid()\n"
    fn = _notebook_function("f", body, cfg=dist_config)
    loaded, args, kwargs = pickle.loads(launcher._pack(fn, (1,), {}))
    assert loaded.__globals__["cfg"] is dist_config and args == (1,) and kwargs == {}
    # On the worker processes, as ff.launch sends it (it failed with "cannot pickle
    # 'ConfigModuleInstance'" before).
    results = pools.run(2, fn, 7)
    assert [r[:2] for r in results] == [("torch.distributed.config", 7)] * 2
    assert len({r[2] for r in results} | {__import__("os").getpid()}) == 3


def test_a_global_that_cannot_be_pickled_is_named_with_the_fix():
    lock = threading.Lock()
    fn = _notebook_function(
        "train", "def train():\n    with lock:\n        return torch.zeros(1)\n", lock=lock
    )
    with pytest.raises(
        TypeError,
        match=r"cannot send train .*train reads the global 'lock' \(lock: TypeError: .*\), "
        r"which cannot be pickled\. Create or import it inside the function",
    ):
        launcher._pack(fn, (), {})


# --------------------------------------------------------------------------- 2D


def test_a_tensor_parallel_axis_not_named_tp_needs_the_plans_data_axes():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (4, 8))
    with ff.simulated_mesh({"dp": 2, "model": 2}) as mesh:
        tp = ff.tensor_parallel(model, mesh, gpt_plan(cfg, loss_parallel=False), axis="model")
        with pytest.raises(
            ValueError,
            match=r"ff\.fsdp: wrappers= holds tensor-parallel styles over mesh axis 'model' "
            r".*data axes \('dp', 'model'\) include it.*Pass data_axes=tp\.data_axes",
        ):
            ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        sm = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers, data_axes=tp.data_axes)
        assert sm.data_axes == ("dp",)
        logits = ff.rank_values(sm.apply(sm.shard(), x))
    with torch.no_grad():
        expected = model(x)
    for value in logits:
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the examples


def test_finetune_lora_resume_with_nothing_left_to_train_says_to_raise_steps(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location(
        "_finetune_lora", ROOT / "examples" / "finetune_lora.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_finetune_lora", module)
    spec.loader.exec_module(module)
    module.check_steps_left(100, 200, "ckpt")  # steps left: nothing to say
    with pytest.raises(
        ValueError,
        match=r"--resume: the latest checkpoint in 'ckpt' is at step 200 and --steps is 200, so "
        r"there is nothing left to train\. Pass --steps N with N above 200",
    ):
        module.check_steps_left(200, 200, "ckpt")

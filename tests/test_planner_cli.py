"""The planner's command line (``python -m functional_fsdp.planner``, ``ff-plan``): its figures
are the Python API's (``ff.compare_strategies`` with the same inputs), and its tables fit an
80-column terminal with colour off."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.planner import _cli
from functional_fsdp.planner._render import short

from ._hf import tiny_llama_config

pytest.importorskip("transformers")


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _cli_json(*argv: str) -> dict:
    out = io.StringIO()
    assert _cli.run([*argv, "--json"], file=out) == 0
    return json.loads(out.getvalue())


def _api_json(cmp: ff.Comparison) -> list[dict]:
    return json.loads(json.dumps(cmp.to_dict()))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_config().save_pretrained(path)  # config.json, as a hub checkout has it
    return path


def test_a_config_dir_and_a_2d_mesh_give_the_apis_figures(llama_dir):
    bf16 = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    config = tiny_llama_config()
    expected = ff.compare_strategies(
        _meta(config),
        4,
        batch=(8, 16),
        tp_plan=ff.llama_plan(config, loss_parallel=False),
        tp=2,
        mixed_precision=bf16,
        checkpoint=True,
        strategies=("ddp", "zero1", "zero2", "shard_grad_op", "zero3", "fsdp+tp"),
    )
    got = _cli_json(
        str(llama_dir),
        "--mesh",
        "dp=2,tp=2",
        "--batch",
        "8",
        "--seq",
        "16",
        "--param-dtype",
        "bf16",
        "--checkpoint",
    )
    assert [r["name"] for r in got["reports"]] == [
        "ddp",
        "zero1",
        "zero2",
        "shard_grad_op",
        "zero3",
        "fsdp+tp",
    ]
    assert got["reports"] == _api_json(expected)
    assert got["params"] == sum(p.numel() for p in _meta(config).parameters())
    # config.json itself, HSDP on a replicate x shard mesh, no optimizer, plain fp32
    expected = ff.compare_strategies(
        _meta(config), 4, batch=(4, 8), hsdp_shard=2, strategies=("zero3", "hsdp"), optimizer=None
    )
    got = _cli_json(
        str(llama_dir / "config.json"),
        "--mesh",
        "replicate=2,shard=2",
        "--strategies",
        "zero3,hsdp",
        "--batch",
        "4",
        "--seq",
        "8",
        "--optimizer",
        "none",
    )
    assert got["reports"] == _api_json(expected)


def test_the_zero_papers_setup_gives_the_apis_figures():
    # The ZeRO paper's running example: a 7.5B model on 64 devices with mixed-precision Adam,
    # model states only (no activations).
    from transformers import GPT2Config

    config = GPT2Config(n_embd=4096, n_layer=36, n_head=32, n_positions=1024)
    model = _meta(config)
    params = sum(p.numel() for p in model.parameters())
    assert 7.4e9 < params < 7.6e9
    fp16 = ff.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    expected = ff.compare_strategies(
        model,
        64,
        strategies=("ddp", "zero1", "zero2", "zero3"),
        mixed_precision=fp16,
        optimizer="adam",
    )
    got = _cli_json(
        "zero-7.5b",
        "--mesh",
        "dp=64",
        "--param-dtype",
        "fp16",
        "--optimizer",
        "adam",
        "--no-activations",
        "--strategies",
        "ddp,zero1,zero2,zero3",
    )
    assert got["params"] == params
    assert got["reports"] == _api_json(expected)
    # Model states of plain data parallelism: fp16 parameters (2 bytes), gradients reduced in
    # fp32 and kept so for the fp32 masters (4), the masters and Adam's two moments (12): 18
    # bytes per parameter, where the paper's 16 counts fp16 gradients (reduce_dtype=fp16);
    # full sharding divides them over the 64 devices.
    ddp, zero3 = got["reports"][0], got["reports"][3]
    states = ("param_bytes", "grad_bytes", "opt_state_bytes")
    assert [ddp[k] // params for k in states] == [2, 4, 12]
    assert sum(ddp[k] for k in states) == 18 * params
    assert sum(zero3[k] for k in states) == pytest.approx(18 * params / 64, rel=1e-3)


def test_the_tables_fit_80_columns_with_colour_off(llama_dir, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()  # not a terminal: no escape codes either
    assert _cli.run([str(llama_dir), "--mesh", "dp=2,tp=2", "--gib", "0.001"], file=out) == 0
    text = out.getvalue()
    lines = text.splitlines()
    assert "\x1b[" not in text
    assert max(map(len, lines)) <= 80, "\n".join(line for line in lines if len(line) > 80)
    assert "…" not in text  # no cell cut short
    expected = ff.compare_strategies(
        _meta(tiny_llama_config()),
        4,
        batch=(4, 4096),
        tp_plan=ff.llama_plan(tiny_llama_config(), loss_parallel=False),
        tp=2,
        strategies=("ddp", "zero1", "zero2", "shard_grad_op", "zero3", "fsdp+tp"),
    )
    for report in expected.reports:
        # Each strategy's row holds its peak, and "NO" in words (not only in a colour).
        memory = text.split("traffic per step")[0].splitlines()
        (row,) = [line for line in memory if line.split()[:1] == [report.name]]
        assert short(report.peak_bytes) in row.split()
        assert row.split()[-1] == ("fits" if report.fits(0.001) else "NO")
    assert "fits in 0.001 GiB: " in text


def test_the_module_runs_as_a_command_and_names_bad_input(llama_dir):
    # One fresh interpreter (an import of torch costs seconds) checks two things: importing
    # the package leaves ff.checkpoint (torch's distributed checkpointing and DTensor, about a
    # second) until it is used, so the command line does not pay for it; and the module runs
    # as `python -m functional_fsdp.planner --list` runs it (runpy, as -m does).
    code = (
        "import sys, runpy, functional_fsdp as ff; from functional_fsdp.planner import _cli; "
        "assert 'torch.distributed.checkpoint' not in sys.modules, 'ff.checkpoint loaded early'; "
        "assert callable(ff.checkpoint.save) and 'torch.distributed.checkpoint' in sys.modules; "
        "sys.argv = ['python -m functional_fsdp.planner', '--list']; "
        "runpy.run_module('functional_fsdp.planner', run_name='__main__', alter_sys=True)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.split()[0] == "llama3-8b"
    assert {line.split()[0] for line in done.stdout.splitlines()} == set(_cli.SHAPES)
    with pytest.raises(SystemExit, match=r"neither a built-in shape nor a config\.json"):
        _cli.run(["no-such-model"])
    err = io.StringIO()
    with pytest.raises(SystemExit), _redirect_stderr(err):
        _cli.run(["gpt2", "--mesh", "dp=8,pp=2"])
    assert "unknown axis 'pp'" in err.getvalue()
    with pytest.raises(SystemExit, match="fsdp\\+tp needs a tp axis"):
        _cli.run(["gpt2", "--strategies", "fsdp+tp"])


def _redirect_stderr(target: io.StringIO):
    import contextlib

    return contextlib.redirect_stderr(target)


def test_a_cp_axis_splits_sequences_in_every_strategy(llama_dir, monkeypatch):
    config = tiny_llama_config()
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=ff.cp.register_attention()
        )
    strategies = ("zero2", "zero3")
    expected = ff.compare_strategies(model, 4, cp=2, batch=(2, 16), strategies=strategies)
    got = _cli_json(
        str(llama_dir), "--mesh", "dp=2,cp=2", "--seq", "16", "--strategies", "zero2,zero3"
    )
    assert got["reports"] == _api_json(expected)  # the batch: one sequence per cp group
    for report in got["reports"]:
        assert report["mesh"] == {"dp": 2, "cp": 2} and report["sequence_axis"] == "cp"
        assert {c["source"] for c in report["comms"] if c["axis"] == "cp"} >= {"cp", "fsdp"}
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    assert _cli.run([str(llama_dir), "--mesh", "dp=2,cp=2", "--seq", "16"], file=out) == 0
    text = out.getvalue()
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text
    traffic = text.split("traffic per step")[1].splitlines()
    header = next(line for line in traffic if line.split()[:2] == ["strategy", "mesh"])
    assert header.split() == ["strategy", "mesh", "collective", "axis", "by", "count", "bytes"]
    cp_rows = [line.split() for line in traffic if line.split()[-4:-2] == ["cp", "cp"]]
    assert len(cp_rows) == 2 * 5  # the attention's gathers and reduce-scatters, per strategy
    assert "source cp: context-parallel attention" in text

"""The example scripts run end to end under torchrun (tiny settings)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess


def _torchrun(script: str, *args: str, nproc: int = 2) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        script,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize(
    "extra",
    [
        ["--strategy", "fsdp"],
        ["--strategy", "zero1", "--accumulate", "2"],
        ["--strategy", "zero2", "--mixed-precision", "bf16"],
        ["--strategy", "fsdp", "--compile"],
    ],
    ids=["fsdp", "zero1_accumulate", "zero2_bf16", "fsdp_compiled"],
)
def test_train_gpt_loss_falls(extra, tmp_path):
    args = ["--steps", "30", "--layers", "1", "--width", "64", "--sample-chars", "20", *extra]
    ckpt = tmp_path / "gpt"
    if extra == ["--strategy", "fsdp"]:  # and resumes from its checkpoint directory
        args += ["--checkpoint-dir", str(ckpt), "--save-every", "15"]
    out = _torchrun("examples/train_gpt.py", *args)
    first, last = map(float, re.search(r"loss: first ([\d.]+), last ([\d.]+)", out).groups())
    assert last < first - 0.5, out
    assert "sample:" in out
    if ckpt.exists():
        assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000015", "step_00000030"]
        shutil.rmtree(ckpt / "step_00000030")  # as if the job died before its last checkpoint
        again = _torchrun("examples/train_gpt.py", *args, "--resume")
        assert f"resumed from step 15 of {ckpt}" in again, again
        resumed = re.search(r"last ([\d.]+)", again)
        assert resumed and float(resumed.group(1)) == last, (out, again)


# --------------------------------------------------------------------------- the docs' figures


def _docs_training_example() -> tuple[re.Match, str]:
    """docs/results.md's paragraph on the training example (its defaults and losses), and the
    sample text it quotes."""
    readme = (ROOT / "docs" / "results.md").read_text()
    found = re.search(
        r"\*\*Training example\*\* \(`torchrun --nproc-per-node 2 examples/train_gpt\.py`, "
        r"the defaults: (\d+) steps,\s+(\d+) layers, width (\d+), global batch (\d+)×(\d+),"
        r".*?fell from ([\d.]+) to ([\d.]+) \(mean of the last 10 steps: ([\d.]+)\)"
        r".*?```text\n(.*?)```",
        readme,
        re.S,
    )
    assert found, "docs/results.md's training example paragraph has changed its form"
    return found, found.group(9)


def test_the_docs_state_the_training_examples_defaults(monkeypatch):
    # The figures and the sample the results page quotes are those of the example's defaults.
    found, _ = _docs_training_example()
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", ["train_gpt.py"])
    spec = importlib.util.spec_from_file_location("_train_gpt", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args()
    stated = tuple(int(found.group(i)) for i in range(1, 6))
    assert stated == (args.steps, args.layers, args.width, args.batch_size, args.block_size)


@pytest.mark.skipif(
    not os.environ.get("FF_README_EXAMPLE"),
    reason="runs the README's first command's example in full (600 steps: about 1 min on an idle "
    "2-core machine, 3 min under load); set FF_README_EXAMPLE=1",
)
def test_the_docs_quote_what_the_training_example_prints():
    found, quoted = _docs_training_example()
    out = _torchrun("examples/train_gpt.py")
    losses = re.search(r"loss: first ([\d.]+), last ([\d.]+) \(mean of last 10: ([\d.]+)\)", out)
    assert losses, out
    assert losses.groups() == found.group(6, 7, 8), out
    printed = out.split("sample:\n", 1)[1]
    assert [line.rstrip() for line in printed.strip("\n").splitlines()] == [
        line.rstrip() for line in quoted.strip("\n").splitlines()
    ], printed


def test_shard_gather_demo():
    out = _torchrun("examples/shard_gather_demo.py")
    assert "shard -> gather is exact: True" in out
    assert re.search(r"all_gather\s+dp\s+6\s", out) and re.search(r"reduce_scatter\s+dp\s+3\s", out)


def test_train_gpt_2d_loss_falls():
    out = _torchrun(
        "examples/train_gpt_2d.py", "--steps", "20", "--layers", "1", "--width", "64", nproc=4
    )
    first, last = map(float, re.search(r"loss: first ([\d.]+), last ([\d.]+)", out).groups())
    assert last < first - 0.5, out
    assert re.search(r"all_reduce\s+tp\s+\d+", out)


def test_finetune_lora_trains_and_exports(tmp_path):
    # Its resume from a checkpoint: the QLoRA run below (the same script and resume path).
    ckpt = str(tmp_path / "ckpt")
    args = ["--steps", "4", "--save-every", "2", "--checkpoint-dir", ckpt, "--sample-tokens", "10"]
    out = _torchrun("examples/finetune_lora.py", *args)
    first = re.search(r"steps 0\.\.4: loss ([\d.]+) -> ([\d.]+)", out)
    assert first and float(first.group(2)) < float(first.group(1)), out
    assert (
        "sample: 'The " in out and (tmp_path / "ckpt" / "adapter" / "adapter_config.json").exists()
    )
    assert (tmp_path / "ckpt" / "step_00000004").is_dir()


def test_finetune_lora_qlora_on_local_jsonl_resumes_exactly(tmp_path):
    """The QLoRA recipe (--quantize nf4) on a JSONL file read by datasets, with a tokenizer
    trained on it; the resumed run ends on the uninterrupted run's loss."""
    import json

    data = tmp_path / "train.jsonl"
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "seven",
        "wizards",
        "quietly",
        "hex",
    ]
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": " ".join(words[i % 5 :] + words[: i % 7])}) + "\n")
    ckpt = str(tmp_path / "ckpt")
    args = ["--steps", "3", "--save-every", "2", "--checkpoint-dir", ckpt, "--sample-tokens", "4"]
    args += ["--quantize", "nf4", "--data", str(data), "--batch-size", "4", "--block-size", "32"]
    out = _torchrun("examples/finetune_lora.py", *args)
    first = re.search(r"steps 0\.\.3: loss ([\d.]+) -> ([\d.]+)", out)
    assert first, out
    shutil.rmtree(tmp_path / "ckpt" / "step_00000003")
    out = _torchrun("examples/finetune_lora.py", *args, "--resume")
    assert "resumed at step 2" in out, out
    resumed = re.search(r"steps 2\.\.3: loss [\d.]+ -> ([\d.]+)", out)
    assert resumed and resumed.group(1) == first.group(2), out


def _trl_tokenized_file(path: Path) -> int:
    """The SFT tests' chat conversations as TRL's tokenization writes them (``input_ids`` and
    ``assistant_masks``; ``tests/test_sft.py`` checks that these are TRL's labels), one JSON
    line each; returns the largest token id."""
    from . import _sft_workers as W

    D, tok = W.sft_data(), W.tokenizer()
    largest = 0
    with open(path, "w") as f:
        for c in W.conversations():
            e = D.encode({"messages": c}, tok)
            masks = [int(label != -100) for label in e["labels"]]
            f.write(json.dumps({"input_ids": e["input_ids"], "assistant_masks": masks}) + "\n")
            largest = max(largest, *e["input_ids"])
    return largest


def test_finetune_sft_packed_qlora_on_trl_tokenized_data_resumes_exactly(tmp_path):
    """SFT on a TRL-tokenized file taken as it is (no tokenizer: the vocabulary and the
    padding id read from the data), packed, with the QLoRA recipe (--quantize nf4): the token
    mean as the loss; a run resumed from a checkpoint (train state and loader position) ends
    on the uninterrupted run's loss, bit for bit."""
    data = tmp_path / "tokenized.jsonl"
    largest = _trl_tokenized_file(data)
    ckpt = str(tmp_path / "ckpt")
    args = ["--steps", "3", "--save-every", "2", "--checkpoint-dir", ckpt, "--data", str(data)]
    args += ["--batching", "pack", "--quantize", "nf4", "--batch-size", "4"]
    out = _torchrun("examples/finetune_sft.py", *args)
    assert f"vocabulary read from the data: padding id {largest + 1}" in out, out
    first = re.search(r"steps 0\.\.3: loss ([\d.]+) -> ([\d.]+); (\d+) answer tokens", out)
    assert first and int(first.group(3)) > 0, out
    assert re.search(r"padding [\d.]+% of rank 0's slots \(pack\)", out), out
    shutil.rmtree(tmp_path / "ckpt" / "step_00000003")
    out = _torchrun("examples/finetune_sft.py", *args, "--resume")
    assert "resumed at step 2" in out, out
    resumed = re.search(r"steps 2\.\.3: loss [\d.]+ -> ([\d.]+)", out)
    assert resumed and resumed.group(1) == first.group(2), out


def test_finetune_dpo_full_with_a_sharded_reference_resumes_exactly(tmp_path):
    """DPO with every weight trained and a frozen reference sharded on the same mesh: the
    first loss is log 2 (the policy starts as the reference), and a run resumed from a
    checkpoint (train state and loader position) ends on the uninterrupted run's loss. Then
    LoRA over a 4-bit base (--quantize nf4), whose reference is the base without adapters."""
    ckpt = str(tmp_path / "ckpt")
    args = ["--full", "--steps", "3", "--save-every", "2", "--checkpoint-dir", ckpt]
    args += ["--pairs", "16", "--batch-size", "2"]
    out = _torchrun("examples/finetune_dpo.py", *args)
    first = re.search(r"steps 0\.\.3: loss ([\d.]+) -> ([\d.]+); reward accuracy", out)
    assert first and abs(float(first.group(1)) - 0.693147) < 1e-5, out
    shutil.rmtree(tmp_path / "ckpt" / "step_00000003")
    out = _torchrun("examples/finetune_dpo.py", *args, "--resume")
    assert "resumed at step 2" in out, out
    resumed = re.search(r"steps 2\.\.3: loss [\d.]+ -> ([\d.]+)", out)
    assert resumed and resumed.group(1) == first.group(2), out
    # LoRA over a 4-bit base: the reference is that base with the adapters disabled, so the
    # loss starts at log 2 and leaves it as the adapters train (it stayed at log 2 when the
    # disabled adapters did not reach the 4-bit storage view: the reference was the policy).
    args = ["--quantize", "nf4", "--steps", "3", "--checkpoint-dir", str(tmp_path / "q")]
    out = _torchrun("examples/finetune_dpo.py", *args, "--pairs", "16", "--batch-size", "2")
    qlora = re.search(r"steps 0\.\.3: loss ([\d.]+) -> ([\d.]+);.*\(LoRA, 4-bit reference\)", out)
    assert qlora and abs(float(qlora.group(1)) - 0.693147) < 1e-5, out
    assert float(qlora.group(2)) < 0.69, out


def test_train_long_context_equals_one_process_and_trains():
    """Context parallelism (dp=2, cp=2): the first step's loss is one process's on the same
    global batch, and the loss falls."""
    out = _torchrun(
        "examples/train_long_context.py",
        "--steps",
        "4",
        "--seq-len",
        "256",
        "--lr",
        "1e-2",
        nproc=4,
    )
    both = re.search(r"step 1 loss ([\d.]+), one process on the same batch ([\d.]+)", out)
    assert both and abs(float(both.group(1)) - float(both.group(2))) < 1e-5, out
    losses = re.search(r"loss: first ([\d.]+), last ([\d.]+)", out)
    assert losses and float(losses.group(2)) < float(losses.group(1)), out

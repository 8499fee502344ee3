"""GPU readiness on a CPU: device placement, and an audit of real train steps for CUDA bugs.

``tests/_audit_workers.py`` explains how the audit tells host tensors from device tensors on
a machine that has only a CPU. The self-tests here show what it catches; the gloo tests run
it over every strategy's full train step and over a resharding checkpoint load. The GPU
tests (skipped without CUDA) run the same steps on CUDA with torch's sync debug mode.
"""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.distributed import mesh as M
from functional_fsdp.launcher import ProcessPool

from . import _audit_workers as A

# --------------------------------------------------------------------------- the audit itself


class _HostIndex(torch.autograd.Function):
    """The bug this audit exists for: an index made on the host, used on the value's device."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.index_select(0, torch.arange(2))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.nn.functional.pad(g, [0, 2])


def test_audit_finds_host_index_inside_grad_and_autograd_function():
    x = torch.ones(4)
    with A.DeviceAudit() as audit:
        torch.func.grad(lambda t: _HostIndex.apply(t).sum())(x)
    [finding] = audit.findings
    assert finding.kind == "device-mix" and finding.op == "index_select"
    assert "test_audit.py" in finding.where and "in forward" in finding.host_from


def test_audit_finds_host_syncs_and_per_call_copies():
    x = torch.ones(4)
    with A.DeviceAudit() as audit:
        x.sum().item()
        x.tolist()
        bool(x.any())
        x.nonzero()
        _ = x * torch.tensor(2.0, device=x.device)
    assert [(f.kind, f.op) for f in audit.findings] == [
        ("host-sync", "aten._local_scalar_dense"),  # .item()
        ("host-sync", "Tensor.tolist()"),
        ("host-sync", "aten._local_scalar_dense"),  # bool()
        ("host-sync", "aten.nonzero"),
        ("h2d-copy", "torch.tensor(data, device=...)"),
    ]


def test_audit_accepts_device_factories_and_host_arithmetic():
    x = torch.arange(6.0)
    grid = torch.arange(4).reshape(2, 2)  # like DeviceMesh.mesh: a host tensor by design
    with A.DeviceAudit(host=[grid]) as audit:
        idx = torch.arange(1, 3, device=x.device)
        y = x.index_select(0, idx) + torch.zeros(2, device=x.device)
        host = (torch.arange(3) * 2).tolist()  # host-only arithmetic, read on the host
        row = grid[1].tolist()
        z = torch.func.grad(lambda t: (t * torch.ones_like(t)).sum())(x)
    assert audit.findings == [], audit.findings
    assert y.tolist() == [1.0, 2.0] and host == [0, 2, 4] and row == [2, 3] and z.sum() == 6


def test_audit_transfers_mode_allows_io_but_not_device_mix():
    x = torch.ones(4)
    with A.DeviceAudit(transfers=True) as audit:
        x.sum().item()
        x.copy_(torch.zeros(4))  # a read from a file lands on the device like this
        x.index_select(0, torch.arange(2))
    assert [(f.kind, f.op) for f in audit.findings] == [("device-mix", "index_select")]


# --------------------------------------------------------------------------- real train steps

_CASES = [pytest.param(name) for name in A.STEP_CASES]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", _CASES)
def test_train_step_is_device_clean(pools, name):
    out = pools.run(A.WORLD[name], A.audit_step, name)
    for r in out:
        assert r["findings"] == [], "\n".join(r["findings"])
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5, r
    if name == "transformers":  # the model's own syncs are found, and attributed to it
        found = out[0]["model_findings"]
        assert found and all("transformers/" in f.split(" at ")[1] for f in found)


@pytest.mark.multiprocess
def test_checkpoint_load_with_reshard_is_device_clean(pools, tmp_path):
    out = pools.run(4, A.audit_checkpoint_load, str(tmp_path / "ckpt"))
    for r in out:
        assert r["findings"] == [], "\n".join(r["findings"])
        assert r["err"] == 0.0, r
        assert r["specs"]["w"] == "P(('b', 'a'), None)", r


# --------------------------------------------------------------------------- device choice


def test_rank_device_gives_each_rank_its_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert M.rank_device("cuda", local_rank=3, local_world_size=4) == torch.device("cuda", 3)
    assert M.rank_device("cpu", local_rank=3, local_world_size=8) == torch.device("cpu")
    shared = M.rank_device("cuda", local_rank=5, local_world_size=8, oversubscribe=True)
    assert shared == torch.device("cuda", 1)


def test_rank_device_refuses_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(
        ValueError,
        match=r"4 ranks on this node need one GPU each, but 2 GPU\(s\) are visible "
        r"\(CUDA_VISIBLE_DEVICES=0,1\)\. Launch at most 2 ranks per node \(torchrun "
        r"--nproc-per-node 2\), run on the CPU with device_type='cpu'.*oversubscribe=True",
    ):
        M.rank_device("cuda", local_rank=0, local_world_size=4)


def test_rank_device_errors_name_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"device 'cuda' was asked for, but no GPU is visible"):
        M.rank_device("cuda", local_rank=0, local_world_size=1)
    with pytest.raises(ValueError, match=r"device_type must be 'cuda' or 'cpu', got 'tpu'"):
        M.rank_device("tpu")


def test_init_distributed_refuses_cuda_without_gpu_before_joining(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no GPU is visible"):
        ff.init_distributed(device_type="cuda")
    assert not torch.distributed.is_initialized()


def test_process_pool_refuses_oversubscription_before_starting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks on this node need one GPU each, but 1 GPU"):
        ProcessPool(2, device_type="cuda")


def _backend_and_device():
    device = ff.init_distributed()  # already joined by the pool: returns this rank's device
    return torch.distributed.get_backend(), str(device)


@pytest.mark.multiprocess
def test_pool_ranks_join_with_their_device(pools):
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    for rank, (backend, device) in enumerate(pools.run(2, _backend_and_device)):
        assert backend == expected
        assert device == (f"cuda:{rank}" if expected == "nccl" else "cpu")


# --------------------------------------------------------------------------- on a GPU

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fsdp", "zero1", "hsdp", "tp"])
def test_cuda_step_has_no_host_sync(name):
    """The audited steps on CUDA + NCCL, with torch's sync debug mode set to raise."""
    if A.WORLD[name] > _GPUS:
        pytest.skip(f"needs {A.WORLD[name]} CUDA GPUs (one per rank, NCCL); found {_GPUS}")
    with ProcessPool(A.WORLD[name], device_type="cuda") as pool:
        out = pool.run(A.audit_step, name, "cuda")
    for r in out:
        assert r["device"].startswith("cuda") and r["findings"] == [], r
        assert abs(r["loss"] - r["ref_loss"]) < 1e-4, r

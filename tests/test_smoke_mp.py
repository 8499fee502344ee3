import pytest
import torch

import functional_fsdp as ff

pytestmark = pytest.mark.multiprocess


def _roundtrip():
    import torch.distributed as dist

    torch.manual_seed(0)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    full = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    s = ff.shard(full, mesh, ff.P("dp"))
    g = ff.gather(s)
    assert all(torch.equal(g[k], full[k]) for k in full)
    grads = torch.func.grad(lambda p: sum((v**2).sum() for v in ff.gather(p).values()))(s)
    gg = ff.gather(grads)
    return {k: torch.allclose(gg[k], 2 * dist.get_world_size() * full[k]) for k in full}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_roundtrip(pools, n):
    out = pools.run(n, _roundtrip)
    assert all(all(r.values()) for r in out), out

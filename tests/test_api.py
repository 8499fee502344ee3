"""The public API: every exported name is documented with an example."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import functional_fsdp as ff


@pytest.mark.parametrize("name", ff.__all__)
def test_public_name_has_docstring_with_example(name):
    obj = getattr(ff, name)
    doc = inspect.getdoc(obj) or ""
    assert len(doc.splitlines()[0]) > 10, f"ff.{name} needs a one-line summary"
    assert "Example" in doc, f"ff.{name}'s docstring needs an example"


def test_all_lists_every_public_name():
    exported = {n for n in dir(ff) if not n.startswith("_") and n not in ("annotations",)}
    modules = {n for n in exported if inspect.ismodule(getattr(ff, n))}
    public_modules = {"checkpoint", "contrib", "cp", "ft"}  # ff.checkpoint.save, ff.contrib.muon
    assert set(ff.__all__) == (exported - modules) | public_modules


# --------------------------------------------------------------------------- renamed names


def test_policy_checkpoint_keyword_is_a_deprecated_name_of_activation_checkpointing():
    new = ff.Policy(activation_checkpointing=True, prefetch=2)
    with pytest.warns(DeprecationWarning, match=r"Policy\(activation_checkpointing=\.\.\.\)"):
        old = ff.Policy(checkpoint=True, prefetch=2)
    assert old == new and hash(old) == hash(new) and repr(old) == repr(new)
    assert old.checkpoint is True and new.checkpoint is True  # the old name still reads
    assert dataclasses.replace(new, prefetch=1).activation_checkpointing is True  # no warning
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="both checkpoint="):
        ff.Policy(checkpoint=True, activation_checkpointing=True)


def test_megatron_names_are_aliases_of_the_collectives():
    with ff.simulated_mesh({"tp": 2}) as mesh:
        x = torch.arange(3.0)
        for alias, collective in (
            (ff.copy_to, ff.all_reduce_grad),
            (ff.reduce_from, ff.all_reduce),
        ):
            ours, vjp = torch.func.vjp(lambda x: alias(x, mesh), x)
            theirs, vjp_ref = torch.func.vjp(lambda x: collective(x, mesh, "tp"), x)
            for a, b in ((ours, theirs), (vjp(x)[0], vjp_ref(x)[0])):
                assert all(torch.equal(p, q) for p, q in zip(ff.rank_values(a), ff.rank_values(b)))
        with pytest.raises(ValueError, match=r"all_reduce_grad over 'pt': the mesh Mesh\(tp=2\)"):
            ff.copy_to(x, mesh, "pt")


def test_fsdp_plan_is_a_deprecated_name_of_its_layout():
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sharded_model = ff.fsdp(torch.nn.Linear(2, 2), mesh)
        with pytest.warns(DeprecationWarning, match=r"FSDP\.plan is now FSDP\.layout"):
            assert sharded_model.plan is sharded_model.layout

"""``train_step(engine=...)``: plain autograd under the same pure step, for model code that
``torch.func`` cannot transform (Bloom's custom autograd.Function, ``requires_grad_()``
hooks, Hugging Face gradient checkpointing), and the same numbers as ``torch.func``.

Tolerances (float32, CPU). The library's GPT is bitwise equal under both engines (asserted).
On the tiny Llama, the backward rounds differently under ``torch.func`` (1.1e-8 on a
largest gradient of 0.12, untraced), so: gradients within 1e-6 of the largest gradient;
losses and parameters after a few AdamW steps within 1e-5 (AdamW divides by the root of the
second moment, which turns a rounding-level gradient difference into up to lr * 1e-4 where
gradients are near zero); against peft in one process, adapters within 1e-4 as in
tests/test_zoo.py. Where both sides run on autograd (Hugging Face checkpointing on and off),
the runs are bitwise equal.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.grad_engine import reason_up_front
from functional_fsdp.models import GPT, lm_loss

from . import _autograd_workers as W

pytest.importorskip("transformers")
pytest.importorskip("peft")

GRAD_TOL, STEP_TOL = 1e-6, 1e-5


def _measured(pools, fn) -> Iterator[tuple[str, dict]]:
    """``fn`` on 2 gloo ranks: prints what it measured (``pytest -s``; README.md quotes it)
    and yields ``(model or case, result)`` for every rank."""
    results = pools.run(2, fn)
    print(results)
    for rank in results:
        yield from rank.items()


@pytest.mark.multiprocess
def test_every_strategy_trains_the_same_under_autograd(pools):
    # ZeRO-3 (accumulation both ways, donation, frozen), DDP, ZeRO-1/2 and TP, with dropout
    # drawn from the state's key, clipping and apply_if_finite (HSDP: one process, below).
    # The library's GPT runs the same kernels in the same order under both: bitwise.
    for name, r in _measured(pools, W.engines_agree):
        assert r["losses_equal"] and r["norms_equal"] and r["params_equal"], (name, r)
        assert r["moved"] > 1e-3, (name, r)  # the parameters trained
        assert r["comms_equal"], (name, r)  # the same collectives, the same bytes


@pytest.mark.multiprocess
def test_gradients_equal_torch_func_on_gpt_and_llama(pools):
    for name, r in _measured(pools, W.grads_gpt_and_llama):
        assert r["bitwise"] or name != "gpt", (name, r)
        assert r["loss_diff"] < STEP_TOL, (name, r)
        assert r["grad_diff"] <= GRAD_TOL * r["grad_max"], (name, r)
        assert r["grad_max"] > 0.01, (name, r)  # not vacuous
        assert r["unchanged"], (name, r)  # the input shards were never marked


@pytest.mark.multiprocess
def test_models_torch_func_cannot_differentiate_train_and_match_one_process(pools):
    for name, r in _measured(pools, W.cannot_transform):
        assert "error" not in r, (name, r)
        assert r["loss_diff"] < STEP_TOL, (name, r)
        assert r["param_diff"] < 1e-4, (name, r)  # as the zoo's LoRA tests
        assert r["moved"] > 1e-2, (name, r)
        if name == "bloom_in_units":  # inside units, torch.func runs it: no fallback
            assert r["notices"] == [], (name, r)
            continue
        assert len(r["notices"]) == 1, (name, r)  # once per step function, not per step
        assert "engine='autograd'" in r["notices"][0], (name, r)


@pytest.mark.multiprocess
def test_hf_gradient_checkpointing_and_input_hooks_equal_the_run_without(pools):
    for kind, r in _measured(pools, W.gradient_checkpointing):
        assert r["bitwise"], (kind, r)
        assert r["func_diff"] < STEP_TOL and r["func_loss_diff"] < STEP_TOL, (kind, r)
        assert r["moved"] > 1e-2, (kind, r)
        assert r["module_kept"], (kind, r)
        assert len(r["notices"]) == 1 and "gradient checkpointing" in r["notices"][0], r


# --------------------------------------------------------------------------- one process


def test_engine_func_raises_where_auto_falls_back_once():
    from ._zoo import ZOO

    model = ZOO["bloom"].build()
    batch = torch.randint(0, 64, (2, 9))
    with ff.simulated_mesh({"dp": 2}) as mesh:
        # One unit: Bloom's custom autograd.Function runs under torch.func (inside a unit,
        # it would run with plain autograd: see test_models_torch_func_cannot_differentiate...).
        f = ff.fsdp(model, mesh, units=[])
        opt = ff.sgd(0.1)

        def loss_fn(p, b):
            return lm_loss(f.apply(p, b[:, :-1]).logits, b[:, 1:])

        state = ff.TrainState.create(f.shard(), opt)
        with pytest.raises(
            RuntimeError,
            match=r"^train_step\(engine='func'\): torch\.func cannot differentiate this model "
            r"\(an autograd\.Function without setup_context\)\. Use engine='autograd' \(the "
            r"same pure step and gradients, computed with plain autograd; the step then cannot "
            r"be transformed by torch\.func\), or engine='auto' to choose by itself\. ",
        ):
            ff.train_step(loss_fn, opt, model=f, engine="func")(state, batch)
        step = ff.train_step(loss_fn, opt, model=f)
        with pytest.warns(
            ff.AutogradFallbackWarning,
            match=r"^train_step: torch\.func cannot differentiate this model \(an "
            r"autograd\.Function without setup_context\), so the step computes its gradients "
            r"with plain autograd: the same numbers, but the step cannot be transformed by "
            r"torch\.func\. Pass train_step\(\.\.\., engine='autograd'\) to silence this "
            r"notice\.$",
        ):
            auto, _ = step(state, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second notice, and none with engine="autograd"
            auto, _ = step(auto, batch)
            explicit = ff.train_step(loss_fn, opt, model=f, engine="autograd")
            manual, _ = explicit(explicit(state, batch)[0], batch)
        for k in auto.params:
            assert torch.equal(auto.params[k].local, manual.params[k].local), k


def test_a_hook_calling_requires_grad_is_seen_up_front():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 1))
    assert reason_up_front(model) is None

    def make_inputs_require_grad(module, args, output):
        output.requires_grad_(True)

    model[0].register_forward_hook(make_inputs_require_grad)
    assert reason_up_front(model) == (
        "Embedding '0' has a forward hook make_inputs_require_grad that calls requires_grad_()"
    )


def test_autograd_engine_is_pure_and_keeps_other_grads():
    # A tensor outside the state that requires grad keeps its .grad; the state's tensors get
    # neither .grad nor requires_grad; on a simulated 2 x 2 mesh (HSDP) the numbers are equal.
    torch.manual_seed(0)
    cfg = W.CFG.__class__(n_layer=2, vocab_size=61, n_embd=32, n_head=4, block_size=16)
    model = GPT(cfg)
    outside = torch.ones(()).requires_grad_()
    batch = torch.randint(0, 61, (8, 9))
    results = {}
    with ff.simulated_mesh({"replicate": 2, "shard": 2}) as mesh:
        f = ff.fsdp(model, mesh)
        opt = ff.adamw(1e-2, weight_decay=0.01)
        state = ff.TrainState.create(f.shard(), opt)
        for engine in ("func", "autograd"):
            step = ff.train_step(
                lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]) * outside,
                opt,
                model=f,
                engine=engine,
            )
            new, metrics = step(state, batch)
            results[engine] = (ff.gather(new.params), float(metrics["loss"]))
        for v in state.params.values():
            assert v.local.grad is None and not v.local.requires_grad
    assert outside.grad is None
    (p_func, l_func), (p_auto, l_auto) = results["func"], results["autograd"]
    assert l_func == l_auto
    assert all(torch.equal(p_func[k], p_auto[k]) for k in p_func)  # bitwise, as on gloo


def test_bad_engine_names_the_choices():
    with pytest.raises(
        ValueError,
        match=r"^train_step: engine must be 'auto', 'func' or 'autograd', got 'jax'\. 'func' "
        r"differentiates with torch\.func",
    ):
        ff.train_step(lambda p, b: p["w"].sum(), ff.sgd(0.1), batch="local", engine="jax")


def test_the_fallback_draws_the_masks_of_its_failed_attempt():
    # The hook raises under torch.func after dropout drew its mask: the autograd retry must
    # draw the same one, as engine="autograd" does from the start (no mesh: model=None).
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        model[1].register_forward_hook(lambda m, args, out: out.requires_grad_())
        return model

    results = []
    for engine in ("auto", "autograd"):
        model = build()
        opt = ff.sgd(0.1)
        step = ff.train_step(
            lambda p, b: torch.func.functional_call(model, p, (b,)).pow(2).mean(),
            opt,
            batch="local",
            engine=engine,
        )
        params = {k: v.detach() for k, v in model.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ff.AutogradFallbackWarning)
            state, _ = step(ff.TrainState.create(params, opt, rng=5), torch.ones(8, 4))
        results.append(state.params)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])

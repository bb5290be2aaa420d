"""The engine's rooms: the ghost rules are the table ``_ghost.rules.RULES`` keyed by the
site's primitive, and the clip methods are the objects of ``_methods.METHODS``. A rule
taken out of the table, or one put in, changes the choice and never the result; each
method owns its refusal and its plan."""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import primitives as prims

import microbatching
from microbatching import _methods, _typing
from microbatching._ghost import rules
from microbatching._ghost.rules import conv, dense, embedding

from .strategies import assert_close
from .test_ghost import conv as conv_model
from .test_ghost import normal

CLIP = 1.0


def _reference(loss, params, *batch, keep_batch_dim=False):
    """Each example's gradient by ``vmap(grad)``, clipped to ``CLIP``, summed."""

    def one(*example):
        if keep_batch_dim:
            example = tuple(e[None] for e in example)
        g = jax.grad(loss)(params, *example)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)))
        factor = jnp.minimum(1.0, CLIP / norm)
        return jax.tree.map(lambda x: x * factor, g)

    return jax.tree.map(lambda x: jnp.sum(x, axis=0), jax.vmap(one)(*batch))


def _rules_and_sum(model, method: typing.Any = "ghost"):
    fn = microbatching.micro_grad(
        model.loss,
        l2_clip_norm=CLIP,
        clip_method=method,
        batch_argnums=tuple(range(1, 1 + len(model.batch))),
        microbatch_size=4,
        keep_batch_dim=getattr(model, "keep_batch_dim", False),
    )
    report = microbatching.clipping_report(fn, model.params, *model.batch)
    return {leaf.path: leaf.rule for leaf in report.leaves}, fn(model.params, *model.batch)[0]


def test_the_table_holds_each_rule_once_keyed_by_its_primitive():
    assert {
        prims.dot_general_p: dense.RULE,
        prims.conv_general_dilated_p: conv.RULE,
        prims.gather_p: embedding.RULE,
    } == rules.RULES
    assert [rules.named(n) for n in ("dense", "conv", "embedding", "direct", "unused")] == [
        dense.RULE,
        conv.RULE,
        embedding.RULE,
        None,
        None,
    ]


def test_a_rule_taken_out_of_the_table_leaves_its_leaves_to_direct_and_the_sum_exact(
    monkeypatch,
):
    model = conv_model()
    want = _reference(model.loss, model.params, *model.batch, keep_batch_dim=True)
    before, got = _rules_and_sum(model)
    assert "conv" in before.values()
    assert_close(got, want, terms=2, factor=4)

    monkeypatch.delitem(rules.RULES, prims.conv_general_dilated_p)
    after, got = _rules_and_sum(model)
    assert "conv" not in after.values()
    assert {p for p, r in before.items() if r == "conv"} <= {
        p for p, r in after.items() if r == "direct"
    }
    assert_close(got, want, terms=2, factor=4)


def test_a_rule_put_in_the_table_is_chosen_and_its_norm_is_the_one_read(monkeypatch):
    """A new rule is one ``GhostRule`` and one table line: here ``dense`` under another
    name, whose norm counts its calls."""
    rng = np.random.default_rng(0)
    params = {"w": normal(rng, 6, 3), "b": normal(rng, 3)}
    x, y = normal(rng, 8, 6), normal(rng, 8, 3)

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    called = []

    def norm(*args, **kwargs):
        called.append(True)
        return dense.RULE.norm(*args, **kwargs)

    mine = dataclasses.replace(dense.RULE, name="mine", norm=norm, rows=None)
    monkeypatch.setitem(rules.RULES, prims.dot_general_p, mine)
    model = type("M", (), {"loss": loss, "params": params, "batch": (x, y)})
    found, got = _rules_and_sum(model)
    assert found["['w']"] == "mine" and called
    assert_close(got, _reference(loss, params, x, y), terms=2, factor=4)


def test_the_methods_users_may_name_are_the_objects_of_the_table():
    assert typing.get_args(_typing.ClipMethod) == ("auto", *_methods.ASKED_BY_NAME)
    assert set(_methods.ASKED_BY_NAME) | {"plain"} == set(_methods.METHODS)
    for name, method in _methods.METHODS.items():
        assert isinstance(method, _methods.Method) and method.name == name


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("two_pass", "clip_method='two_pass' and nan_safe=True"),
        ("chunked", "clip_method='chunked' and nan_safe=True"),
        ("ghost", None),
        ("materialize", None),
    ],
)
def test_each_method_owns_its_refusal(method: typing.Any, message):
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731

    def wrap():
        return microbatching.micro_grad(
            loss, l2_clip_norm=CLIP, nan_safe=True, batch_argnums=1, clip_method=method
        )

    if message is None:
        wrap()
        return
    with pytest.raises(ValueError, match=message):
        wrap()

"""The public surface: names, docstrings, the optax-compatible signatures."""

import inspect

import pytest

import microbatching

SPEC_NAMES = {
    "microbatch",
    "micro_vmap",
    "micro_grad",
    "reshape_batch_axis",
    "AccumulationType",
    "Accumulator",
}


def test_all_is_the_public_surface():
    assert set(microbatching.__all__) == SPEC_NAMES | {
        "Aux",
        "BatchStatisticsWarning",
        "UnsplitBatchWarning",
        "Plan",
        "PlanRow",
        "plan",
        "ClippingReport",
        "LeafRule",
        "clipping_report",
        "l2_norm",
    }
    public = {n for n in dir(microbatching) if not n.startswith("_")}
    assert public == set(microbatching.__all__)


@pytest.mark.parametrize("name", sorted(microbatching.__all__))
def test_every_public_name_has_a_docstring_with_an_example(name):
    doc = inspect.getdoc(getattr(microbatching, name)) or ""
    assert ">>>" in doc


def _parameters(fun):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fun).parameters.values()]


def test_signatures_follow_the_spec():
    p = inspect.Parameter
    mb = microbatching
    assert _parameters(mb.microbatch) == [
        ("fun", p.POSITIONAL_OR_KEYWORD, p.empty),
        ("argnums", p.POSITIONAL_OR_KEYWORD, p.empty),
        ("microbatch_size", p.POSITIONAL_OR_KEYWORD, p.empty),
        ("accumulator", p.POSITIONAL_OR_KEYWORD, mb.AccumulationType.SUM),
        ("argnames", p.KEYWORD_ONLY, ()),
        ("in_axes", p.KEYWORD_ONLY, 0),
        ("num_real_microbatches", p.KEYWORD_ONLY, None),
        ("accumulation_dtype", p.KEYWORD_ONLY, None),  # ours, beyond the spec
        ("progress", p.KEYWORD_ONLY, False),
        ("allow_remainder", p.KEYWORD_ONLY, False),  # issue 8
        ("fused_gradient", p.KEYWORD_ONLY, False),  # issue 16
        ("whole_argnums", p.KEYWORD_ONLY, ()),  # issue 51
    ]
    vmap_params = _parameters(mb.micro_vmap)
    assert [n for n, *_ in vmap_params] == [
        "fun",
        "in_axes",
        "out_axes",
        "microbatch_size",
        "vmap_fn",
        "accumulator",
        "num_real_microbatches",
        "accumulation_dtype",  # ours, beyond the spec, keyword-only
        "batch_mesh_axes",
        "progress",
        "allow_remainder",
    ]
    assert vmap_params[6] == ("num_real_microbatches", p.KEYWORD_ONLY, None)
    assert [n for n, *_ in _parameters(mb.micro_grad)] == [
        "fun",
        "has_aux",
        "argnums",
        "batch_argnums",
        "keep_batch_dim",
        "microbatch_size",
        "accumulator",
        "transform_fn",
        "metrics_fn",
        "num_real_microbatches",
        "l2_clip_norm",  # ours, beyond the spec, keyword-only
        "rescale_to_unit_norm",  # issue 14
        "normalize_by",
        "nan_safe",
        "clip_method",
        "accumulation_dtype",
        "batch_mesh_axes",
        "gather_params",  # issue 15
        "reduce_gradients",
        "param_specs",  # issue 23
        "progress",
        "allow_remainder",
        "whole_argnums",
    ]
    extra = {"accumulation_dtype", "batch_mesh_axes", "l2_clip_norm"}
    for fun in (mb.microbatch, mb.micro_vmap, mb.micro_grad):
        for name, kind, default in _parameters(fun):
            if name in extra:
                assert kind == p.KEYWORD_ONLY and default is None
            if name in ("progress", "allow_remainder", "rescale_to_unit_norm", "nan_safe"):
                assert kind == p.KEYWORD_ONLY and default is False
    assert _parameters(mb.reshape_batch_axis) == [
        ("tree", p.POSITIONAL_OR_KEYWORD, p.empty),
        ("microbatch_size", p.POSITIONAL_OR_KEYWORD, p.empty),
        ("axis", p.POSITIONAL_OR_KEYWORD, 0),
    ]


def test_accumulation_type_values_follow_the_spec():
    values = {t.name: t.value for t in microbatching.AccumulationType}
    # The spec's four, then ours (issue 8).
    assert values == {"MEAN": 1, "SUM": 2, "RUNNING_MEAN": 3, "CONCAT": 4, "MAX": 5, "MIN": 6}


def test_accumulator_is_a_frozen_dataclass_of_four_functions():
    acc = microbatching.Accumulator(len, max, min, abs)
    assert (acc.init, acc.update, acc.finalize, acc.aggregate) == (len, max, min, abs)
    assert acc == microbatching.Accumulator(len, max, min, abs)
    assert hash(acc) == hash(microbatching.Accumulator(len, max, min, abs))
    with pytest.raises(AttributeError):
        acc.init = max  # type: ignore[misc]


def test_wrappers_keep_the_wrapped_function_name():
    def loss(params, batch):
        return params * batch

    assert microbatching.microbatch(loss, 1, 2).__name__ == "loss"
    assert microbatching.micro_vmap(loss, (None, 0)).__name__ == "loss"
    assert microbatching.micro_grad(loss).__name__ == "loss"

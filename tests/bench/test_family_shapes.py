"""The benchmark's models are the trainer's: the same build, attention included."""

import pytest

from bench.family_shapes import FAMILY_SHAPES
from bench.train import bench_config, build_bench_model
from trainer.model import model_on_meta


@pytest.mark.parametrize("name", sorted(FAMILY_SHAPES))
def test_each_family_shape_runs_the_attention_the_trainer_would_run_for_it(name):
    """Gemma 2 soft-caps its scores: the trainer runs eager attention for it (sdpa has no cap),
    and so must the benchmark, or its figure is of another model."""
    for attention in ("sdpa", "fa4"):
        bench = build_bench_model(name, attention).config._attn_implementation
        assert bench == model_on_meta(bench_config(name), attention).config._attn_implementation
    capped = getattr(bench_config(name), "attn_logit_softcapping", None)
    assert (build_bench_model(name, "sdpa").config._attn_implementation == "eager") == bool(capped)

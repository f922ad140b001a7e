"""The tap vocabulary's rules, read by every stage from store/vocab.py alone: which block stack a
tap's layer counts in (layer counts and depth), and which taps hold attention heads, not features."""

from __future__ import annotations

import pytest

from store.depth import depth_of, layer_counts
from store.records import ArraySpec
from store.vocab import HEAD_TAPS, SITES, STACKS, TAPS, stack_of


def test_stacks_are_vision_then_llm_in_data_path_order():
    assert STACKS == ("vision", "llm")
    assert {stack_of(t) for t in TAPS} == {*STACKS, None}
    assert stack_of("not-a-tap") is None


@pytest.mark.parametrize("tap", TAPS)
def test_a_taps_stack_decides_its_depth(tap):
    n_vision, n_llm = 4, 6
    depth, stage = depth_of(tap, 2, SITES[tap][0], n_vision, n_llm)
    if stack_of(tap) == "llm":  # an attention map of LLM block 2 sits at block 2's depth
        assert (depth, stage) == (n_vision + 3 + 2, "llm")
    elif stack_of(tap) == "vision":
        assert (depth, stage) == (2, "vision")
    else:
        assert depth is not None and depth not in {2, n_vision + 3 + 2}


def test_the_deepest_stored_layer_of_each_stack_counts_when_the_config_is_silent():
    arrays = [("vision", 3, "resid_post"), ("projector", 0, "out"), ("llm", 1, "resid_post"), ("attn", 7, "probs")]
    assert layer_counts({}, arrays) == (4, 8)


@pytest.mark.parametrize("tap", TAPS)
def test_only_head_taps_lay_a_dense_three_d_array_out_as_head_query_key(tap):
    dims = ArraySpec(tap=tap, layer=0, tokens="last", shape=(2, 3, 4)).default_dims()
    assert dims == (("head", "query", "key") if tap in HEAD_TAPS else ("dim0", "dim1", "dim2"))
    assert ("attn" in HEAD_TAPS) and ("llm" not in HEAD_TAPS)

"""Hash-seed dependence from fingerprints built under fixed seeds (pure)."""

from __future__ import annotations

from fsdpcheck.checks.hash_seed import compare_orders
from fsdpcheck.records import Fingerprint, TensorRecord

FULL = "model.rotary_emb.full_attention_inv_freq"


SLIDING = "model.rotary_emb.sliding_attention_inv_freq"


def _fp(buffers=(), params=()) -> Fingerprint:
    def rec(item):
        name, shape = item
        return TensorRecord(name=name, shape=shape, dtype="float32", device="meta")

    return Fingerprint("pre-wrap", tuple(map(rec, buffers)), tuple(map(rec, params)))


def test_compare_orders_reports_parameters_and_positional_pairing() -> None:
    a = _fp(params=[("m.w1", (4,)), ("m.w2", (4,)), ("n.w", (2,))])
    b = _fp(params=[("m.w2", (4,)), ("m.w1", (4,)), ("n.w", (2,))])
    [reorder] = compare_orders({0: a, 1: b, 2: a})
    assert (reorder.kind, reorder.module) == ("param", "m")
    assert [t.name for t in reorder.tensors] == ["m.w1", "m.w2"]
    assert [v.seeds for v in reorder.variants] == [(0, 2), (1,)]
    assert not reorder.sizes_differ
    assert compare_orders({0: a, 1: a}) == ()


def test_compare_orders_names_each_module_that_moves() -> None:
    # Two modules swap places: each one's own order is unchanged, its positions are not.
    a = _fp(buffers=[("x.f", (16,)), ("y.f", (8,))])
    b = _fp(buffers=[("y.f", (8,)), ("x.f", (16,))])
    reorders = compare_orders({0: a, 1: b})
    assert [r.module for r in reorders] == ["x", "y"]
    assert all(r.sizes_differ and len(r.variants) == 2 for r in reorders)

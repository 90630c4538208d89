"""``verify_load`` on models wrapped before ``fully_shard`` the way torchtitan wraps them
(activation checkpointing, ``torch.compile``, both, on every layer): it pairs the model's tensors
with the full state dict by the state dict's names, as ``load_full_state_dict`` does, not by
``named_parameters()``'s, which carry the wrappers' ``_checkpoint_wrapped_module.``. Two real
ranks (gloo, CPU), every case in one launch; each case's failing twin is the same load after
rank 1 changed one weight of its shard."""

from __future__ import annotations

from pathlib import Path

from conftest import run_worker_ranks

CASES = ("plain", "checkpointed", "compiled", "checkpointed-compiled", "checkpointed-compiled-dcp")


def test_verify_load_pairs_wrapped_models_by_state_dict_names(tmp_path: Path) -> None:
    result, records = run_worker_ranks(
        "verify_wrapped_worker.py", tmp_path, ["--model", "tiny", "--timeout", "60"], timeout=240
    )
    assert result.codes == [0, 0], result.output(0)[-3000:] + result.output(1)[-3000:]
    for record in records:
        assert record["error"] is None, record["error"]
        for case in CASES:
            outcome = record[case]
            # The wrappers are really there: their prefixes are in named_parameters().
            names = " ".join(outcome["names"])
            assert ("_checkpoint_wrapped_module." in names) == ("checkpointed" in case), case
            assert ("_orig_mod." in names) == ("compiled" in case), case
            # Clean twin: the load went through, and the proof says so on every rank.
            verify = outcome["verify"]
            assert verify["ran"] and verify["passed"], (case, verify)
            assert verify["checked"] > 0
            # Failing twin: rank 1's changed shard, named as the state dict names it.
            tampered = outcome["tampered"]
            assert tampered["ran"] and not tampered["passed"], (case, tampered)
    for case in CASES:
        mismatches = records[0][case]["tampered"]["mismatches"]
        assert mismatches == [
            {
                "name": records[0][case]["tampered_name"],
                "kind": "param",
                "ranks": [1],
                "reason": "values differ from the source state dict",
            }
        ], case
        assert "_checkpoint_wrapped_module" not in records[0][case]["tampered_name"]

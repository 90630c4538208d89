"""Analysis: pure functions from per-rank records to findings and loader predictions."""

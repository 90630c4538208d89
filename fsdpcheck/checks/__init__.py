"""Cross-rank checks: pure functions from gathered records to findings."""

"""Pure cross-rank checks over gathered records."""

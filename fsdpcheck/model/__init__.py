"""Resolve, build, wrap and fingerprint the model on one rank."""

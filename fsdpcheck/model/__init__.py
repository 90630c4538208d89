"""Resolving, building, wrapping and fingerprinting the model."""

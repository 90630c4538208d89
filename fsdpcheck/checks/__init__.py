"""Checks: pure analyses over gathered records or source text."""

"""Hooks that run fsdpcheck's pre-flight check inside training frameworks (optional extras)."""

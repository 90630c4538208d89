"""Distributed plumbing: launcher detection (and, after the reorganisation, setup and gather)."""

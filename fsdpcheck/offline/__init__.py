"""Collective-free fingerprints: each process writes its own record; ``diff`` compares them."""

"""Models fsdpcheck builds: presets, fixtures and the hazard model."""

"""fsdpcheck: find cross-rank buffer and parameter mismatches before FSDP2 training does."""

__version__ = "0.1.0"

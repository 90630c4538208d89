"""Work that runs in isolated child processes: probe, scan, reproduction."""

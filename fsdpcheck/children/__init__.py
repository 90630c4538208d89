"""Work that runs in isolated child processes (:mod:`.launch`): probe, scan, the real loaders."""

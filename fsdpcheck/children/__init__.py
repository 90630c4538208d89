"""Child jobs: isolated, time-bounded multi-rank runs started by the audit."""

"""The model: resolve, build, wrap, fingerprint and the live state collectors."""

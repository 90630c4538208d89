"""Building, wrapping and reading a rank's model."""

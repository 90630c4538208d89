"""``fsdpcheck run``: a training script, unmodified, under the checks and the collective watch."""

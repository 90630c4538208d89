"""The sorted, validated loader and the proof that every rank holds the same weights."""

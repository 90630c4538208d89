"""The loader: agree on layouts, move the state dict, prove the result."""

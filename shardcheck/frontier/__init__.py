"""Where to cut: the tensors CP scatters and gathers."""

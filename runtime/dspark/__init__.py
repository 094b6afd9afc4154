"""DSpark: confidence-scheduled speculative decoding (arXiv:2607.05147)."""

"""Self-drafting heads: what they are (NumPy arrays, their math, their files), for every kind."""

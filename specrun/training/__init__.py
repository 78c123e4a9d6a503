"""`specrun heads train`: the data, the loop and a trainer per head kind."""

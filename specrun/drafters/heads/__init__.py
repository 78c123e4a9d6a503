"""Drafters that read the target's own hidden states through heads (Medusa, Hydra, EAGLE)."""

"""The loop (plan, draft, verify, accept, keep), its events and its statistics."""

"""The loop (plan, draft, verify, rewind, emit, observe), its events, how drafts become target
passes, and its statistics."""

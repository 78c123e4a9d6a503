"""`specrun serve`: an OpenAI-compatible server in front of one target/drafter pair."""

"""Generation, chat, templates and tuning runs: what the front ends call."""

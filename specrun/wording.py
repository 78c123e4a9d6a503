"""Words for the counts specrun prints: '1 token', '2 tokens'."""


def count_of(n: int, noun: str) -> str:
    """'1 prompt', '2 prompts' (nouns whose plural takes an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"

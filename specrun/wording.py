"""Words for the counts specrun prints: '1 token', '2 tokens'."""


def count_of(n: int, noun: str) -> str:
    """'1 prompt', '2 prompts', '2 passes' (nouns whose plural takes an s, or es after s, x, sh, ch)."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "x", "sh", "ch")) else f"{n} {noun}s"

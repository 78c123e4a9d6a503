"""The speculation policy: which drafters, how many tokens, or a plain step; learned from measured costs."""

"""`specrun bench`: which speculation method is fastest on this machine, measured honestly.

suite: the prompts (built-in, or Spec-Bench JSONL). runner: loads the pair and runs the
methods interleaved. figures: per prompt, per category and overall figures.
machine: what the numbers were measured on. tables, export and report: the Rich
tables, the JSON file and the self-contained HTML report (charts drawn by svg).
"""

"""What the front ends call: generation and a run's setup, chat turns and templates, which heads a
run drafts with, comparisons, tuning (learned costs, kernel settings, the layer search)."""

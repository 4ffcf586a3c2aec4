"""Prompt and training data: row formats and readers of prompt sources, the prompt set (normalize, dedupe, split),
chat templates and loss masks (chat), token budgets, generation rows -> training samples, and the draft vocab map."""

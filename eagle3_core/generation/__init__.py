"""Regeneration: prompt rows answered by the target on inference servers into resumable shards (regenerate), one
shard on disk (answer_shard), the quality gate, progress and turn-by-turn answering."""

"""Target features: the extractor (HF), the sharded feature store and its storage formats, the background shard
writer, SpecForge's offline features imported, and the torchrun extraction workers (tensor-parallel, one per GPU)."""

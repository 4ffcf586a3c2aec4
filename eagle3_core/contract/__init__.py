"""The run's on-disk contract, below every stage: the run layout (every path once, STAGE_DIRS), manifests written
atomically with their checksums, a stage's output files checked for changes (run_stage), the run lock and
append-only shard plans."""

"""Scale-out: data-parallel draft training under torchrun (ddp_trainer, train_ddp), extraction with one worker
process per GPU each owning shards (extract_workers), and the torchrun launcher used by both (launch).
Nothing here imports Prefect; tasks/distributed.py wraps these for flows."""

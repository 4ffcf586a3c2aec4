"""Scale-out: the data-parallel parts of the one training loop (data_parallel; trainer.train is the loop), the train
stage under torchrun (train_ddp), extraction with one worker process per GPU each owning shards (extract_workers),
and the torchrun launcher used by both (launch). Nothing here imports Prefect; tasks/distributed.py wraps these for
flows."""

"""torch.distributed plumbing with nothing of the pipeline in it: torchrun as a child process that never leaves a
process behind (launch) and the data-parallel parts of the one training loop (data_parallel)."""

"""The EAGLE-3 draft and its training: the model and its geometry per target family, training-time test (loss,
attention), packed rows and the batch feed, the one training loop, checkpoints and export, warm start."""

"""The pipeline stages as plain functions: each reads its inputs under the run directory (contract.layout.RunLayout),
writes its outputs and finishes by writing a manifest atomically (contract.manifest). A stage whose manifest was
written for the same inputs key (keys) is not recomputed (pipeline.run). The stage table (table) lists them;
one module per stage body (`*_stage.py`), plus the train stage under torchrun (train_ddp), a night's work (nightly)
and the run report (report). Prefect tasks wrap these one to one; they work without Prefect too."""

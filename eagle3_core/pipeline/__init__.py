"""The pipeline stages as plain functions: each reads its inputs under the run directory (layout.RunLayout), writes
its outputs and finishes by writing a manifest atomically (DESIGN.md 'data contracts'). A stage whose manifest was
written for the same inputs key (keys) is not recomputed (run_stage). The stage table (table) lists them; one
module per stage body. Prefect tasks wrap these one to one; they work without Prefect too."""

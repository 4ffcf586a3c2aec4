"""Loaded at start-up by a Python process with tests/fault_site on PYTHONPATH (tests only): when
EAGLE3_FAULT_INJECT is set, the stage API's shard functions fail on demand (fault_injection.install)."""
import os

if os.environ.get("EAGLE3_FAULT_INJECT"):
    import fault_injection

    fault_injection.install()

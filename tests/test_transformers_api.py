"""The transformers API the parallel paths call (load_target with tp_size > 1, check's per-GPU count): present in the
installed release, named with the release that has it when missing, and pyproject's lower bound set to that
release (transformers 5.17, the GPU image's, has neither `DistributedConfig(ep_size=...)` nor
`_resolve_parallel_plans`)."""
import re
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from eagle3_core.target.loading import PARALLEL_API_SINCE, distributed_config, parallel_api_problem

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_transformers_has_the_api_the_code_calls():
    problem = parallel_api_problem()
    assert problem is None, problem
    assert distributed_config(2, 2).ep_size == 2


def test_pyproject_lower_bound_is_the_release_that_has_it():
    bound = re.search(r'"transformers>=([\d.]+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tuple(map(int, bound.split("."))) == tuple(map(int, PARALLEL_API_SINCE.split(".")))[:len(bound.split("."))]


def test_a_release_without_it_is_named_with_the_fix(monkeypatch):
    """An older release is emulated by removing the method: the error names what is missing and the version."""
    owner = next(c for c in PreTrainedModel.__mro__ if "_resolve_parallel_plans" in vars(c))
    monkeypatch.delattr(owner, "_resolve_parallel_plans")
    with pytest.raises(ImportError, match=r"lacks PreTrainedModel\._resolve_parallel_plans.*transformers>=5\.23"):
        distributed_config(2)

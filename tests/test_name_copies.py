"""Second copies of a list of names, checked against their owner: where the layer order (docs/architecture.md) keeps a
lower layer from importing the table that defines the names (a config Literal lists what a data, training or
serving table holds; a stage module imports no other), the copy must stay equal to it."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

from eagle3_core.checkers import EVALUATE_RUNS
from eagle3_core.config.eval_config import EvalConfig
from eagle3_core.config.feature_config import FeatureConfig
from eagle3_core.config.generation_config import GenerationConfig, ServerConfig
from eagle3_core.config.mix import FORMATS, SourceSpec
from eagle3_core.config.prompt_config import PromptConfig
from eagle3_core.config.train_config import TrainConfig
from eagle3_core.data.budget import POLICIES
from eagle3_core.data.row_formats import ROW_FORMATS
from eagle3_core.evaluation.plots import LABELS
from eagle3_core.features.store_formats import FORMATS as STORE_FORMATS
from eagle3_core.pipeline.evaluate_stage import REPLAY_FEATURE_FIELDS
from eagle3_core.pipeline.features_stage import FEATURE_RESULT_FIELDS
from eagle3_core.pipeline.report_numbers import RUN_NAMES
from eagle3_core.serving.client import API_PATHS, TOKEN_ID_APIS
from eagle3_core.training.ttt import POSITION_LOSSES
from eagle3_core.training.ttt_attention import IMPLEMENTATIONS
from tasks.logs import QUIET_TASKS

ROOT = Path(__file__).resolve().parent.parent


def _choices(model, field: str) -> tuple:
    """The values of a Literal field of a pydantic model, in their order."""
    return typing.get_args(model.model_fields[field].annotation)


def test_the_source_formats_are_the_row_format_tables():
    assert FORMATS == ("auto",) + tuple(ROW_FORMATS)
    assert _choices(SourceSpec, "format") == FORMATS


def test_the_feature_formats_are_the_stores_but_its_test_format():
    assert _choices(FeatureConfig, "format") == tuple(f for f in STORE_FORMATS if f != "fp32")


def test_the_generation_apis_are_the_clients_and_auto_picks_a_token_id_api_by_server_kind():
    assert _choices(GenerationConfig, "api") == ("auto",) + tuple(API_PATHS)
    assert set(TOKEN_ID_APIS) < set(API_PATHS)
    auto = GenerationConfig()
    assert auto.api == "auto"
    assert {kind: auto.api_for(kind) for kind in _choices(ServerConfig, "kind")} == \
        {kind: kind if kind in TOKEN_ID_APIS else "openai" for kind in _choices(ServerConfig, "kind")}


def test_the_train_choices_are_the_trainings_tables():
    assert _choices(TrainConfig, "attention") == ("auto",) + IMPLEMENTATIONS
    assert _choices(TrainConfig, "loss") == tuple(POSITION_LOSSES)


def test_the_over_budget_policies_are_the_budgets():
    assert _choices(PromptConfig, "over_budget") == POLICIES


def test_the_evaluators_are_the_checks():
    assert _choices(EvalConfig, "evaluator") == ("auto",) + tuple(EVALUATE_RUNS)


def test_a_replay_recording_keys_on_the_features_result_fields():
    assert REPLAY_FEATURE_FIELDS == FEATURE_RESULT_FIELDS


def test_the_reports_run_names_are_the_plots_labels():
    assert RUN_NAMES == {k: LABELS[k] for k in RUN_NAMES}
    assert set(LABELS) - set(RUN_NAMES) == {"before_training"}


def test_the_quiet_tasks_are_task_names():
    """tasks.logs.QUIET_TASKS names tasks by the names their @task decorators give them (tasks/*.py)."""
    names = {kw.value.value for p in (ROOT / "tasks").glob("*.py") for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "task"
             for kw in node.keywords if kw.arg == "name" and isinstance(kw.value, ast.Constant)}
    assert QUIET_TASKS <= names, QUIET_TASKS - names

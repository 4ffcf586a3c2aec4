"""The base of every configuration model: unknown fields are refused, naming the field and the nearest valid name.

A mistyped field (`"run_dri"`, `"num_trian"`, `"train": {"epoch": 3}`) would otherwise be dropped silently and its
default used. pydantic's own `extra="forbid"` says only "Extra inputs are not permitted"; the check here runs first
and adds the suggestion (difflib's closest match among the model's field names).
"""
from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict, model_validator


def unknown_field_message(model: str, field: str, valid: list[str]) -> str:
    """The error text for `field` given to `model` whose fields are `valid`: the nearest valid name when one is
    close (difflib ratio >= 0.6), else the list of valid names."""
    near = difflib.get_close_matches(field, valid, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}?" if near else f"valid fields: {', '.join(sorted(valid))}"
    return f"unknown field {field!r} in {model}: {hint} (unknown fields are refused, not ignored)"


class StrictModel(BaseModel):
    """pydantic BaseModel that refuses unknown fields (ValueError naming the field and the nearest valid name)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data):
        if isinstance(data, dict):
            valid = set(cls.model_fields)
            valid |= {f.alias for f in cls.model_fields.values() if f.alias}
            for key in data:
                if key not in valid:
                    raise ValueError(unknown_field_message(cls.__name__, str(key), sorted(cls.model_fields)))
        return data

"""Prompt data sources: the mix definition, raw-row readers, format normalization and named mixes."""
from .formats import RowReject, conversation_text, normalize, to_prompt
from .mix import DataMix, SourceSpec
from .presets import MIXES, mix_preset
from .readers import HUMAN_EVAL, human_eval_path, iter_rows, source_path

__all__ = ["HUMAN_EVAL", "MIXES", "DataMix", "RowReject", "SourceSpec", "conversation_text", "human_eval_path",
           "iter_rows", "mix_preset", "normalize", "source_path", "to_prompt"]

"""Stand-in for sglang 0.5.14 `srt/configs/model_config.py` (see sglang/__init__.py): the target's transformers
config and the two numbers the backend reads."""
from __future__ import annotations


class ModelConfig:
    def __init__(self, model_path: str, trust_remote_code: bool = True, revision: str | None = None,
                 dtype: str = "auto"):
        from transformers import AutoConfig
        self.model_path = model_path
        self.dtype = dtype
        self.hf_config = AutoConfig.from_pretrained(model_path, revision=revision,
                                                    trust_remote_code=trust_remote_code)
        self.hf_text_config = self.hf_config.get_text_config()
        self.hidden_size = self.hf_text_config.hidden_size
        self.num_hidden_layers = self.hf_text_config.num_hidden_layers
        self.vocab_size = self.hf_text_config.vocab_size

    @staticmethod
    def from_server_args(server_args, model_path: str | None = None, model_revision: str | None = None,
                         is_draft_model: bool = False, **kwargs) -> ModelConfig:
        return ModelConfig(model_path or server_args.model_path, server_args.trust_remote_code,
                           model_revision or server_args.revision, server_args.dtype)

"""The draft's capacity options and which pinned serving engines run each: the table an export is checked against.

Options (config: draft.intermediate_size, draft.num_hidden_layers, draft.variant; DraftShape fields):
- `wider_mlp`: an MLP wider than the family recipe (draft.intermediate_size); only tensor shapes change.
- `two_layers`: num_hidden_layers > 1; layers after the first take the hidden stream alone (H inputs).
- `eagle3.1` (arXiv 2605.09992): fc_norm (an RMSNorm per aux hidden state before fc) and norm_output (the normed
  hidden state fed to the next draft step).

Engines, as pinned or named here: SGLang 0.5.14 (config.feature_config.SGLANG_VERSION), vLLM (no pin in this
repository: the version from which each feature is served is named), llama.cpp as vendored by llama-cpp-python
0.3.36 (serving.launcher.LLAMA_CPP_VERSION).
"""
from __future__ import annotations

from eagle3_core.training.draft_model import DraftShape

ENGINES = ("sglang", "vllm", "llama.cpp")

# option -> engine -> (serves it, the source that says so)
SERVES: dict[str, dict[str, tuple[bool, str]]] = {
    "wider_mlp": {
        "sglang": (True, "sglang 0.5.14 srt/models/llama_eagle3.py: LlamaMLP(config.intermediate_size)"),
        "vllm": (True, "vllm model_executor/models/llama_eagle3.py: LlamaMLP(intermediate_size=config."
                       "intermediate_size)"),
        "llama.cpp": (True, "llama-cpp-python 0.3.36 vendor/llama.cpp conversion/llama.py: the EAGLE-3 draft is "
                            "converted as a Llama layer, its feed-forward length from intermediate_size"),
    },
    "two_layers": {
        "sglang": (True, "sglang 0.5.14 srt/models/llama_eagle3.py: layers = num_hidden_layers decoder layers, "
                         "layer i > 0 takes H inputs normed by hidden_norm (sglang PR 24663)"),
        "vllm": (True, "vllm PR 26164 (2025-10), model_executor/models/llama_eagle3.py: layer_idx > 0 takes H "
                       "inputs normed by input_layernorm"),
        "llama.cpp": (False, "llama-cpp-python 0.3.36 vendor/llama.cpp conversion/llama.py: a draft is detected "
                             "as EAGLE-3 only when num_hidden_layers == 1"),
    },
    "eagle3.1": {
        "sglang": (True, "sglang 0.5.14 srt/models/llama_eagle3.py: config fc_norm (fc_norm.{j} per aux state) "
                         "and norm_output (sglang PR 24663)"),
        "vllm": (True, "vllm >= 0.22 (vllm PR 42764; vLLM blog 2026-05-26 'EAGLE 3.1'): fc_norm, norm_output"),
        "llama.cpp": (False, "llama-cpp-python 0.3.36 vendor/llama.cpp conversion/llama.py knows norm_before_fc "
                             "and norm_before_residual only: fc_norm.{j} tensors have no GGUF name"),
    },
}


def options_used(s: DraftShape, recipe_intermediate: int | None = None) -> list[str]:
    """The capacity options a draft of shape `s` uses (keys of SERVES), in table order. recipe_intermediate: the
    family recipe's MLP width (None: the wider MLP is not reported)."""
    used = {"wider_mlp": recipe_intermediate is not None and s.intermediate_size > recipe_intermediate,
            "two_layers": s.num_hidden_layers > 1, "eagle3.1": s.fc_norm or s.norm_output}
    return [k for k in SERVES if used[k]]


def serving_engines(s: DraftShape, engines=ENGINES) -> list[str]:
    """Those of `engines` that serve every capacity option `s` uses."""
    return [e for e in engines if all(SERVES[o][e][0] for o in options_used(s))]


def unservable(s: DraftShape, engines=ENGINES) -> str | None:
    """None if one of `engines` serves every option of `s`; else a message naming each option used, the engines
    of `engines` that cannot serve it with their source, and what to do."""
    if serving_engines(s, engines):
        return None
    lines = [f"- {o}: {e} does not serve it ({SERVES[o][e][1]})" for o in options_used(s) for e in engines
             if not SERVES[o][e][0]]
    return (f"no deploy engine of {list(engines)} serves this draft's capacity options {options_used(s)}:\n"
            + "\n".join(lines) + "\nset draft.num_hidden_layers 1 / draft.variant 'eagle3', or deploy on "
            + " or ".join(e for e in ENGINES if e not in engines and all(SERVES[o][e][0] for o in options_used(s))))

"""What a training run starts from: a fresh draft with the target's embedding and the vocab map, its compiled parts,
the device, the AdamW optimizer and the learning-rate schedule (warmup + cosine).

Legend: N draft vocab, H_t target hidden. Recipe defaults follow SpecForge and EAGLE: AdamW betas (0.9, 0.95), no
weight decay (SpecForge `scripts/train_eagle3.py`).
"""
from __future__ import annotations

import math

import torch

from eagle3_core.config import TrainConfig
from eagle3_core.training.draft_model import DraftShape, Eagle3Draft
from eagle3_core.training.ttt_attention import COMPILE


def build_draft(shape: DraftShape, embed_tokens: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                seed: int) -> Eagle3Draft:
    """A freshly initialised draft with the vocab map installed and, when H == H_t, the target's frozen
    embedding (a draft with its own hidden size trains its own embedding from the seeded init)."""
    draft = Eagle3Draft(shape)
    draft.init_weights(seed)
    with torch.no_grad():
        if shape.hidden_size == shape.target_hidden_size:
            draft.embed_tokens.weight.copy_(embed_tokens)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft


def compile_for_training(draft: Eagle3Draft) -> Eagle3Draft:
    """torch.compile the parts of a TTT step that are the same graph at every step (dense layers before and after
    attention); attention (flex compiles its own kernel) and the step loop stay eager. State-dict names are
    unchanged (bound methods are replaced, modules are not wrapped)."""
    draft.attention_inputs = torch.compile(draft.attention_inputs, dynamic=None, backend=COMPILE["backend"])
    draft.attention_outputs = torch.compile(draft.attention_outputs, dynamic=None, backend=COMPILE["backend"])
    return draft


def lr_lambda(step: int, total: int, warmup: int) -> float:
    """Linear warmup to 1, then cosine to 0.1 of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def resolved_batching(cfg: TrainConfig) -> str:
    """'packed' or 'padded': cfg.batching, with 'auto' resolved as the trainer resolves it (batch_feed.packed):
    packed rows when training runs on CUDA (cfg.device 'auto' with a GPU here, or a 'cuda' device), else padded
    batches. Part of the train key and of each checkpoint's resume key (the two give other batches)."""
    if cfg.batching != "auto":
        return cfg.batching
    name = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return "packed" if name.split(":")[0] == "cuda" else "padded"


def resolve_device(cfg: TrainConfig) -> torch.device:
    """cfg.device as a torch.device: 'auto' is CUDA when available, else CPU; 'cuda' is the current CUDA device
    (under torchrun cuda:LOCAL_RANK, set by pipeline.train_ddp.init_distributed), so that one config, and one
    train stage key, serves every rank."""
    name = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def prepare_training(draft, target_lm_head: torch.Tensor, cfg: TrainConfig, device: torch.device):
    """Move the draft to `device`, pick its TTT attention (cfg.attention; 'auto': merged_flex on CUDA, eager on
    CPU), compile it if cfg.compile, seed torch with cfg.seed, and build the AdamW optimizer (betas 0.9/0.95, no
    weight decay, fused on CUDA). Returns (head_draft [N, H_t]: the target lm_head rows of the draft vocab, opt)."""
    draft.to(device)
    draft.set_attention(cfg.attention if cfg.attention != "auto" else
                        ("merged_flex" if device.type == "cuda" else "eager"))
    if cfg.compile:
        compile_for_training(draft)
    torch.manual_seed(cfg.seed)
    vocab_ids = draft.draft_to_target(torch.arange(draft.shape.draft_vocab_size, device=device))
    head_draft = target_lm_head.to(device)[vocab_ids]                      # [N, H_t]
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device.type == "cuda")
    return head_draft, opt

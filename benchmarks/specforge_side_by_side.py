"""Our EAGLE-3 trainer against SpecForge 0.2.0's on identical data, budget and schedule, measured by one evaluator.

Both drafts start from the same initial weights (our fresh draft, loaded into SpecForge's LlamaForCausalLMEagle3),
see the same samples (the scaling study's nested subset of `--samples` training samples of the run's feature store)
in the same token-budget batches and order, for the same epochs, with AdamW (betas 0.9/0.95, no weight decay), the
same warmup + cosine learning-rate schedule, gradient clipping and TTT length (step weights 0.8**k). Ours is the
scaling study's draft of that size (eagle3_core/studies/scaling_study.py: trained, or reused from its manifest);
SpecForge's is trained here with its OnlineEagle3Model (its masks, teacher and loss; sdpa attention; inputs shifted as its
pipeline shifts them, checked against our step-0 logits before training) and exported by
loading its weights into our draft class (same parameter names). Both are measured with our offline evaluator
(chain drafting, greedy, the run's held-out prompts and eval settings): tau with 95% bootstrap intervals, and the
difference with a paired bootstrap interval (the same prompts resampled for both drafts).

Deviations, said plainly: SpecForge computes its loss with a Triton kernel; on a machine without Triton (CPU) its
loss module is replaced by a stand-in computing the same soft cross-entropy in PyTorch (the formula of SpecForge's
own reference `_compute_loss`). SpecForge's BF16Optimizer is replaced by
torch's AdamW in fp32 so that both runs share the optimizer; the last epoch of SpecForge's run is measured (ours:
the best epoch by held-out simulated tau, as our trainer exports).

    python benchmarks/specforge_side_by_side.py --config configs/scaling_gsm8k.json --samples 1024
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import PipelineConfig, load_config  # noqa: E402


def _soft_ce_reference(logits, target_p, position_mask):
    """What SpecForge's Triton loss computes (its docstring'd PyTorch reference in specforge/core/loss.py): the soft
    cross-entropy -sum_v p_v log softmax(logits)_v at masked positions, averaged over batch x positions."""
    logp = torch.log_softmax(logits.float(), dim=2)
    return -(position_mask * target_p * logp).sum(2).mean()


def import_specforge():
    """SpecForge's EAGLE-3 modules. Without Triton (CPU) its loss module cannot be imported: a stand-in module
    with the same loss in PyTorch takes its place (nothing else of SpecForge's changes). Returns
    (OnlineEagle3Model, LlamaForCausalLMEagle3, used_reference_loss)."""
    reference = False
    try:
        import triton  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("specforge.core.loss")

        class LogSoftmaxLoss:
            apply = staticmethod(_soft_ce_reference)
        stand_in.LogSoftmaxLoss = LogSoftmaxLoss
        stand_in._compute_loss = _soft_ce_reference
        sys.modules.setdefault("specforge.core.loss", stand_in)
        reference = True
    import specforge.algorithms.eagle3.model as m
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    return m.OnlineEagle3Model, LlamaForCausalLMEagle3, reference


def fastest_backend(device: torch.device) -> str:
    """SpecForge 0.2.0's fastest attention backend that trains on `device`: 'flex_attention' on CUDA (its 'fa' needs
    the flash_attn package, 'usp' a sequence-parallel group), 'sdpa' elsewhere (flex attention has no backward on a
    CPU)."""
    return "flex_attention" if device.type == "cuda" else "sdpa"


def specforge_draft(ours, backend: str = "sdpa"):
    """SpecForge's LlamaForCausalLMEagle3 (attention `backend`: 'sdpa', or 'flex_attention' on a GPU) with our
    draft's shape and weights (same parameter names)."""
    from transformers.models.llama.configuration_llama import LlamaConfig
    _, LlamaForCausalLMEagle3, _ = import_specforge()
    sh = ours.shape
    lcfg = LlamaConfig(hidden_size=sh.hidden_size, num_attention_heads=sh.num_attention_heads,
                       num_key_value_heads=sh.num_key_value_heads, head_dim=sh.head_dim,
                       intermediate_size=sh.intermediate_size, vocab_size=sh.vocab_size, num_hidden_layers=1,
                       max_position_embeddings=sh.max_position_embeddings, rms_norm_eps=sh.rms_norm_eps,
                       hidden_act="silu", rope_theta=sh.rope_theta, tie_word_embeddings=False, pretraining_tp=1)
    lcfg.draft_vocab_size = sh.draft_vocab_size
    lcfg.target_hidden_size = sh.target_hidden_size
    model = LlamaForCausalLMEagle3(lcfg, attention_backend=backend)
    missing, unexpected = model.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k or "inv_freq" in k for k in missing), (missing, unexpected)
    return model


def specforge_inputs(b: dict, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """OnlineEagle3Model's keyword arguments for a batch of ours (ttt.collate), made as SpecForge's own trainer
    makes them: TargetHead.preprocess (specforge/modeling/target/target_head.py, called by
    training/strategies/base.py) shifts input_ids and the teacher (here the target's final hidden states, its
    compact-teacher path) left by one, so that position t holds (aux f_t, token x_{t+1}) and the teacher's logits
    z_{t+1}, which predict x_{t+2}; the loss mask is not shifted (SpecForge's convention). Without this shift
    SpecForge trains (f_t, x_t) -> z_t, a draft that the EAGLE-3 verify loop feeds (f_t, x_{t+1}). The features
    are handed over in `dtype` (fp32 here on CPU; bf16 for a bf16 SpecForge model on a GPU)."""
    from specforge.utils import padding
    kw = {"input_ids": padding(b["input_ids"], left=False), "attention_mask": b["valid"].long(),
          "loss_mask": b["loss_mask"][..., None].long(), "hidden_states": b["aux"].to(dtype),
          "target_hidden_for_compact": padding(b["final"].to(dtype), left=False)}
    return {"target": None, **{k: v.to(device) for k, v in kw.items()}}


@torch.no_grad()
def check_step0_alignment(model, ours, b: dict, kw: dict, atol: float = 1e-4) -> float:
    """Step-0 logits of SpecForge's model on its inputs `kw` equal our draft's on the pairs (f_t, x_{t+1}) that
    the verify loop feeds (speculate.prefill), for the batch's first sample (same weights, fp32, CPU). Returns the
    largest difference; raises AssertionError naming it when the inputs or weights are misaligned."""
    from specforge.modeling.draft.llama3_eagle import prepare_decoder_attention_mask

    from eagle3_core.training.ttt import shift_left
    T = int(b["valid"][0].sum())
    hs = model.project_hidden_states(kw["hidden_states"][:1, :T].cpu())
    mask = prepare_decoder_attention_mask(torch.ones(1, T, dtype=torch.bool), (1, T), hs, 0)
    theirs = model.compute_logits(model.backbone(model.embed_input_ids(kw["input_ids"][:1, :T].cpu()), hs, None,
                                                 mask, torch.arange(T)[None]))
    mine = ours.decode(shift_left(b["input_ids"][:1, :T], 1), ours.fuse(b["aux"][:1, :T].float()),
                       torch.arange(T)[None], {})[1]
    diff = float((theirs[:, :T - 1] - mine[:, :T - 1]).abs().max())         # the last position has no x_{t+1}
    assert diff < atol, f"SpecForge's step-0 logits differ from ours by {diff:.3g}: inputs or weights misaligned"
    return diff


def train_specforge(cfg: PipelineConfig, n: int, seed: int, device: torch.device, log=print):
    """SpecForge's TTT training on the study's subset of `n` samples; returns (our Eagle3Draft with its weights,
    seconds, step losses)."""
    from eagle3_core.pipeline.train_stage import fresh_draft, train_split
    from eagle3_core.studies.scaling_study import nested_subset
    from eagle3_core.training.batch_feed import epoch_batches
    from eagle3_core.training.setup import lr_lambda
    from eagle3_core.training.ttt import collate
    OnlineEagle3Model, _, _ = import_specforge()
    t = cfg.train
    if t.grad_accum != 1:
        raise ValueError("this comparison assumes train.grad_accum 1")
    train_all, _ = train_split(cfg)
    train_s = [train_all[i] for i in nested_subset(len(train_all), n, seed)]
    ours, lm_head = fresh_draft(cfg)
    model = specforge_draft(ours)
    first = collate([train_s[i] for i in epoch_batches(train_s, t, 0)[0]])
    log(f"specforge: step-0 logits equal ours on the first batch (max diff "
        f"{check_step0_alignment(model, ours, first, specforge_inputs(first)):.2g})")
    model.embed_tokens.weight.requires_grad_(False)                        # the target's, frozen (as ours)
    model.to(device)
    wrapper = OnlineEagle3Model(draft_model=model, length=t.ttt_length, attention_backend="sdpa")
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(t.seed)
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t = t.resolved(sum(len(s["input_ids"]) for s in train_s))
    batches0 = epoch_batches(train_s, t, 0)
    total = math.ceil(len(batches0) / t.grad_accum) * t.epochs
    warmup = max(1, int(t.warmup_frac * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total, warmup))
    head = lm_head.to(device)
    losses, t0 = [], time.monotonic()
    for epoch in range(t.epochs):
        for ids in epoch_batches(train_s, t, epoch):
            b = collate([train_s[i] for i in ids])
            plosses, *_ = wrapper(**specforge_inputs(b, device), target_head_weight=head)
            loss = sum(t.step_weight ** i * pl for i, pl in enumerate(plosses))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        log(f"specforge: epoch {epoch} mean loss {sum(losses[-len(batches0):]) / len(batches0):.3f} "
            f"({time.monotonic() - t0:.0f} s)")
    seconds = time.monotonic() - t0
    missing, unexpected = ours.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all("rotary" in k or "inv_freq" in k for k in unexpected), (missing, unexpected)
    return ours.cpu(), seconds, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="PipelineConfig JSON whose features and vocab exist")
    ap.add_argument("--samples", type=int, default=1024, help="training samples (the study's nested subset)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default: RUN_DIR/scaling/side_by_side.json)")
    a = ap.parse_args()
    from eagle3_core.studies.scaling_study import measure_offline, train_and_measure
    cfg = load_config(a.config)
    ours = train_and_measure(cfg, a.samples, a.seed)                      # trained, or reused from its manifest
    ours_seconds = ours["seconds"]
    draft, sf_seconds, losses = train_specforge(cfg, a.samples, a.seed, torch.device(a.device))
    sf = measure_offline(cfg, draft)                # the evaluator call of train_and_measure, on SpecForge's draft
    _, _, reference = import_specforge()
    from eagle3_core.evaluation.acceptance import paired_bootstrap_diff_ci
    diff = (ours["tau"] - sf["tau"], paired_bootstrap_diff_ci(ours["per_prompt"], sf["per_prompt"]))
    res = {"samples": a.samples, "tokens": ours["tokens"], "epochs": cfg.train.epochs, "lr": cfg.train.lr,
           "ttt_length": cfg.train.ttt_length, "batch_tokens": cfg.train.batch_tokens,
           "eval_prompts": ours["eval_prompts"], "num_draft_steps": cfg.eval.num_draft_steps,
           "ours": {"tau": ours["tau"], "tau_ci95": ours["tau_ci95"], "accept_per_position": ours["accept_per_position"],
                    "seconds_train_and_eval": ours_seconds},
           "specforge": {"tau": sf["tau"], "tau_ci95": sf["tau_ci95"], "accept_per_position": sf["accept_per_position"],
                         "train_seconds": sf_seconds, "final_loss": losses[-1],
                         "loss": "PyTorch stand-in for its Triton loss" if reference else "Triton"},
           "ours_minus_specforge": {"tau": diff[0], "ci95_paired": diff[1]},
           "device": a.device}
    out = a.out or cfg.run_dir / "scaling" / "side_by_side.json"
    out.write_text(json.dumps(res, indent=2))
    o, s = res["ours"], res["specforge"]
    print(f"| trainer | tau | 95% CI | acceptance per position |\n|---|---|---|---|\n"
          f"| ours | {o['tau']:.3f} | {o['tau_ci95'][0]:.2f}-{o['tau_ci95'][1]:.2f} | "
          f"{', '.join(f'{x:.2f}' for x in o['accept_per_position'])} |\n"
          f"| SpecForge 0.2.0 | {s['tau']:.3f} | {s['tau_ci95'][0]:.2f}-{s['tau_ci95'][1]:.2f} | "
          f"{', '.join(f'{x:.2f}' for x in s['accept_per_position'])} |\n"
          f"ours - SpecForge: {diff[0]:+.3f} tau (95% CI {diff[1][0]:+.3f} to {diff[1][1]:+.3f}, paired bootstrap over "
          f"the same prompts)\n"
          f"({a.samples} samples, {res['tokens']} supervised tokens, {res['epochs']} epochs, TTT {res['ttt_length']}, "
          f"{res['eval_prompts']} held-out prompts; written to {out})")


if __name__ == "__main__":
    main()

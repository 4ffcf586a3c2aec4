"""Storage formats of the target features, as tensors of a shard (per token rows, concatenated along T).

Legend: T tokens, H_t target hidden. Every format also stores input_ids int32 [T], loss_mask int8 [T], offsets.
  bf16 (default)  aux bf16 [T, 3H_t], final bf16 [T, H_t], target_top1 int32 [T]        ~8 H_t + 9 bytes/token
  fp32            the same in fp32 (exact CPU features, for tests)                       ~16 H_t + 9
  fp8             aux fp8 e4m3 [T, 3H_t] + aux_scale bf16 [T, 3], final fp8 e4m3 [T, H_t]
                  + final_scale bf16 [T, 1], target_top1 int32 [T]                       ~4 H_t + 17
  fp8_topk        fp8's tensors + the target's exact top-K logits teacher_logits fp32 [T, K], their ids
                  teacher_ids int32 [T, K] (K = TEACHER_TOPK) and tail_shift fp32 [T, 1]  ~4 H_t + 8 K + 21
  online          nothing but the tokens: training runs the target on the fly             ~5

Why fp8 e4m3 with one scale per token and per layer: hidden states carry a few huge outlier channels, and their
size differs by orders of magnitude between tokens (the first token) and between layers (depth). A per-token,
per-layer absmax scale maps each row's largest value to e4m3's 448; e4m3's exponent then keeps values up to ~3e4x
smaller than that row's outlier in its normal range at ~3 significant bits (relative error <= 2^-4), where int8's
uniform grid would leave the many small channels with one or two levels. Scales are bf16, so quantizing with the
rounded scale loses nothing more when dequantizing. `target_top1` is the exact argmax of the unquantized final state.

Why fp8_topk: the loss's teacher is softmax(final @ lm_head^T) over the draft vocab, and fp8 rounds the final state
before that product: on the embedded target's own greedy answers the fp8 teacher's argmax differs from the exact
target's at 1.8% of answer positions and its total variation (TV) is 2.0%, against 0.26% and 0.13% for bf16
(tests/test_features.py). The top-32 logits alone are no teacher either: the rest of the vocab holds 2.0% of the
mass there (1,024 logits still leave 0.1%). fp8_topk keeps the fp8 final state for the tail and stores, computed in
fp32 from the unrounded final state, the top-K logits (put in place of the fp8 ones) and one shift per token that
gives the other logits their exact total mass: tail_shift = logsumexp of the exact logits outside the top K minus
the same of the fp8 ones (ttt.teacher_of adds it). Its argmax is the target's; its TV is the error of the fp8
logits *within* the tail (0.09% there at K = 32). It costs 8 K + 4 bytes a token over fp8 (0.9% for H_t 7168) and
two fp32 lm_head products per token at extraction.
"""
from __future__ import annotations

import torch

FORMATS = ("bf16", "fp8", "fp8_topk", "fp32", "online")
TEACHER_TOPK = 32                                                      # logits kept per token by fp8_topk
HEAD_CHUNK = 4096                                                      # tokens per lm_head product in encode
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                                                        # largest finite e4m3fn value


def bytes_per_token(name: str, hidden_size: int) -> int:
    """Bytes one token takes on disk in format `name` for a target with hidden size H_t (the table above: input_ids
    int32, loss_mask int8, top1 int32 and the format's features; offsets and headers left out)."""
    H = hidden_size
    per = {"bf16": 8 * H + 9, "fp32": 16 * H + 9, "fp8": 4 * H + 17, "fp8_topk": 4 * H + 8 * TEACHER_TOPK + 21,
           "online": 5}
    if name not in per:
        raise ValueError(f"unknown feature format {name!r}; choose one of {list(FORMATS)}")
    return per[name]


def features_bytes(name: str, samples: int, tokens_per_sample: float, hidden_size: int) -> float:
    """Bytes the features stage stores for `samples` samples of `tokens_per_sample` tokens in format `name`:
    samples x tokens x bytes_per_token (offsets and headers left out). The one rule `plan` and `check` size disk by.
    Raises ValueError for an unknown format."""
    return samples * tokens_per_sample * bytes_per_token(name, hidden_size)


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise ValueError(f"unknown feature format {name!r}; choose one of {list(FORMATS)}")
    return name


def _fp8_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., groups*D] -> (q fp8 [..., groups*D], scale bf16 [..., groups]) with x ~= q * scale per group."""
    g = x.unflatten(-1, (groups, -1)).float()                          # [..., G, D]
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=1e-12).to(torch.bfloat16)   # [..., G]
    q = (g / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), scale


def _unfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    groups = scale.shape[-1]
    return (q.float().unflatten(-1, (groups, -1)) * scale.float()[..., None]).flatten(-2)


def fp8_rounded(final: torch.Tensor) -> torch.Tensor:
    """final [..., H_t] as the fp8 formats store it (one scale per row), decoded to fp32."""
    return _unfp8(*_fp8_rows(final, 1))


def needs_head(name: str) -> bool:
    """Whether `encode` needs the target's lm_head for format `name` (its top-k logits)."""
    return name == "fp8_topk"


def exact_top(final: torch.Tensor, rounded: torch.Tensor, head: torch.Tensor,
              k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values fp32 [..., k], ids int32 [..., k], tail_shift fp32 [..., 1]) of fp8_topk: the k largest logits
    final @ head^T and logsumexp(exact tail) - logsumexp(tail of rounded @ head^T), the tail being the logits
    outside those k (0 where k covers the vocab). final and rounded [..., H_t] (the unrounded and the stored final
    state), head [V, H_t] (lm_head); fp32 products, HEAD_CHUNK tokens at a time, on final's device. k: default
    TEACHER_TOPK."""
    k = k or TEACHER_TOPK
    rows, rnd = final.reshape(-1, final.shape[-1]), rounded.reshape(-1, rounded.shape[-1])
    w = head.to(rows.device, torch.float32)
    n = rows.shape[0]
    vals, shift = torch.empty(n, k, device=rows.device), torch.zeros(n, 1, device=rows.device)
    ids = torch.empty(n, k, dtype=torch.int32, device=rows.device)
    for a in range(0, n, HEAD_CHUNK):
        z = rows[a:a + HEAD_CHUNK].float() @ w.T                                     # [c, V]
        v, i = z.topk(min(k, w.shape[0]), dim=-1)
        vals[a:a + HEAD_CHUNK], ids[a:a + HEAD_CHUNK] = v, i.to(torch.int32)
        if k < w.shape[0]:
            tail = z.scatter(-1, i, float("-inf")).logsumexp(-1)
            tail_rounded = (rnd[a:a + HEAD_CHUNK].float() @ w.T).scatter(-1, i, float("-inf")).logsumexp(-1)
            shift[a:a + HEAD_CHUNK, 0] = tail - tail_rounded
    lead = final.shape[:-1]
    return vals.view(*lead, k), ids.view(*lead, k), shift.view(*lead, 1)


def encode(name: str, aux: torch.Tensor, final: torch.Tensor, top1: torch.Tensor,
           head: torch.Tensor | None = None, teacher: tuple | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors of one batch or sample: aux [..., 3H_t], final [..., H_t], top1 [...] (any float dtype,
    any device; runs where the tensors are, so fp8 halves the device-to-host copy too). head [V, H_t]: the
    target's lm_head, needed by fp8_topk (needs_head) unless `teacher` is exact_top's output already computed
    (a vocab-split head: features.vocab_split); raises ValueError with neither."""
    if name == "online":
        return {}
    if name == "fp8_topk":
        if head is None and teacher is None:
            raise ValueError("feature format 'fp8_topk' stores the target's top-k logits: encode needs its lm_head")
        out = encode("fp8", aux, final, top1)
        vals, ids, shift = teacher or exact_top(final, _unfp8(out["final"], out["final_scale"]), head)
        return {**out, "teacher_logits": vals, "teacher_ids": ids, "tail_shift": shift}
    if name in ("bf16", "fp32"):
        dt = torch.bfloat16 if name == "bf16" else torch.float32
        return {"aux": aux.to(dt), "final": final.to(dt), "target_top1": top1.to(torch.int32)}
    if name == "fp8":
        qa, sa = _fp8_rows(aux, 3)
        qf, sf = _fp8_rows(final, 1)
        return {"aux": qa, "aux_scale": sa, "final": qf, "final_scale": sf, "target_top1": top1.to(torch.int32)}
    raise ValueError(f"unknown feature format {name!r}; choose one of {list(FORMATS)}")


def decode(name: str, t: dict[str, torch.Tensor], widen: bool = True) -> dict[str, torch.Tensor]:
    """fp32 aux [T, 3H_t], final [T, H_t] and int64 target_top1 [T] from the stored tensors of `encode`; fp8_topk
    adds teacher_logits fp32 [T, K], teacher_ids int64 [T, K] and tail_shift fp32 [T, 1]. widen False: bf16
    features stay bf16 (half the bytes to copy; widening later is exact), fp8 ones still come out fp32 (scaled)."""
    if name == "fp8_topk":
        return {**decode("fp8", t), "teacher_logits": t["teacher_logits"].float(),
                "teacher_ids": t["teacher_ids"].long(), "tail_shift": t["tail_shift"].float()}
    if name == "fp8":
        aux = _unfp8(t["aux"], t["aux_scale"])
    elif name in ("bf16", "fp32"):
        aux = t["aux"].float() if widen else t["aux"]
    else:
        raise ValueError(f"format {name!r} stores no features")
    return {"aux": aux, "final": decode_final(name, t, widen), "target_top1": t["target_top1"].long()}


FINAL_KEYS = ("final", "final_scale")          # the stored tensors decode_final reads (final_scale: fp8 formats)


def decode_final(name: str, t: dict[str, torch.Tensor], widen: bool = True) -> torch.Tensor:
    """The target's final states [T, H_t] alone (fp32; bf16 with widen False for a bf16 store) from the stored
    tensors of `encode`: `decode` without reading the aux states, for readers of the final states only."""
    if name in ("fp8", "fp8_topk"):
        return _unfp8(t["final"], t["final_scale"])
    if name in ("bf16", "fp32"):
        return t["final"].float() if widen else t["final"]
    raise ValueError(f"format {name!r} stores no features")

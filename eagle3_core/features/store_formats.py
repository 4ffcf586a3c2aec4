"""Storage formats of the target features, as tensors of a shard (per token rows, concatenated along T).

Legend: T tokens, H_t target hidden. Every format also stores input_ids int32 [T], loss_mask int8 [T], offsets.
  bf16 (default)  aux bf16 [T, 3H_t], final bf16 [T, H_t], target_top1 int32 [T]        ~8 H_t + 9 bytes/token
  fp32            the same in fp32 (exact CPU features, for tests)                       ~16 H_t + 9
  fp8             aux fp8 e4m3 [T, 3H_t] + aux_scale bf16 [T, 3], final fp8 e4m3 [T, H_t]
                  + final_scale bf16 [T, 1], target_top1 int32 [T]                       ~4 H_t + 17
  online          nothing but the tokens: training runs the target on the fly             ~5

Why fp8 e4m3 with one scale per token and per layer: hidden states carry a few huge outlier channels, and their
size differs by orders of magnitude between tokens (the first token) and between layers (depth). A per-token,
per-layer absmax scale maps each row's largest value to e4m3's 448; e4m3's exponent then keeps values up to ~3e4x
smaller than that row's outlier in its normal range at ~3 significant bits (relative error <= 2^-4), where int8's
uniform grid would leave the many small channels with one or two levels. Scales are bf16, so quantizing with the
rounded scale loses nothing more when dequantizing. `target_top1` is the exact argmax of the unquantized final state.
"""
from __future__ import annotations

import torch

FORMATS = ("bf16", "fp8", "fp32", "online")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                                                        # largest finite e4m3fn value


def bytes_per_token(name: str, hidden_size: int) -> int:
    """Bytes one token takes on disk in format `name` for a target with hidden size H_t (the table above: input_ids
    int32, loss_mask int8, top1 int32 and the format's features; offsets and headers left out)."""
    H = hidden_size
    per = {"bf16": 8 * H + 9, "fp32": 16 * H + 9, "fp8": 4 * H + 17, "online": 5}
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


def encode(name: str, aux: torch.Tensor, final: torch.Tensor, top1: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored tensors of one batch or sample: aux [..., 3H_t], final [..., H_t], top1 [...] (any float dtype,
    any device; runs where the tensors are, so fp8 halves the device-to-host copy too)."""
    if name == "online":
        return {}
    if name in ("bf16", "fp32"):
        dt = torch.bfloat16 if name == "bf16" else torch.float32
        return {"aux": aux.to(dt), "final": final.to(dt), "target_top1": top1.to(torch.int32)}
    if name == "fp8":
        qa, sa = _fp8_rows(aux, 3)
        qf, sf = _fp8_rows(final, 1)
        return {"aux": qa, "aux_scale": sa, "final": qf, "final_scale": sf, "target_top1": top1.to(torch.int32)}
    raise ValueError(f"unknown feature format {name!r}; choose one of {list(FORMATS)}")


def decode(name: str, t: dict[str, torch.Tensor], widen: bool = True) -> dict[str, torch.Tensor]:
    """fp32 aux [T, 3H_t], final [T, H_t] and int64 target_top1 [T] from the stored tensors of `encode`.
    widen False: bf16 features stay bf16 (half the bytes to copy; widening later is exact), fp8 ones still come
    out fp32 (scaled)."""
    if name == "fp8":
        aux, final = _unfp8(t["aux"], t["aux_scale"]), _unfp8(t["final"], t["final_scale"])
    elif name in ("bf16", "fp32"):
        aux, final = (t["aux"].float(), t["final"].float()) if widen else (t["aux"], t["final"])
    else:
        raise ValueError(f"format {name!r} stores no features")
    return {"aux": aux, "final": final, "target_top1": t["target_top1"].long()}

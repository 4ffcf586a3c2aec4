"""Load a DeepSeek-V3 / Kimi-K2.5 target for the `ep_int4` features backend: rank r of W holds its routed experts
packed INT4 straight from the safetensors (target.int4_experts), 1/W of the attention heads, of the dense MLPs and
of the shared experts, and the embeddings, routers, norms and lm_head whole.

Legend: W ranks, r this rank, L text decoder layers, E routed experts (E/W per rank, contiguous: rank r holds
[r E/W, (r+1) E/W) as SGLang's and transformers' expert-parallel plans place them), nh attention heads.

The sharding plan is this project's own, limited to these families, not transformers' `base_model_tp_plan`/
`base_model_ep_plan`: those plans move between releases (5.17 leaves MLA whole on every rank, 5.25 splits
q_b_proj/kv_b_proj/o_proj), and with compressed-tensors experts transformers dequantizes them to bf16 at load
(3.5x the bytes), its tensor-parallel load fails and its expert-parallel forward crashes inside
compressed-tensors (tried on a 2-layer DeepseekV3, 2 processes, CPU; issue 48). The model itself is transformers'
(`from_config` on the meta device), so every module's forward is upstream's; only these are swapped:
- MLA (`self_attn`): q_b_proj (q_proj without q_lora) and kv_b_proj keep the rows of heads [r nh/W, (r+1) nh/W),
  o_proj their columns inside a RowParallel (all-reduce). The low-rank q_a/kv_a projections and their norms are
  whole (small, and each rank needs the full latents). The forward's head count comes from the reshapes (-1).
- dense MLP (layers < first_k_dense_replace): gate/up rows and down columns 1/W each, down inside a RowParallel.
- MoE: int4_experts.ShardedMoE (router whole, experts INT4, shared expert 1/W, one all-reduce).
- lm_head and the input embedding loaded whole on every rank (2.3 GB each at Kimi's 163,840 x 7,168 bf16); the
  features backend then keeps only 1/W of lm_head's rows per rank (features.vocab_split: argmax and teacher top-k
  gathered exactly over the slices).
`shard_attention=False` keeps attention whole on every rank (each rank computes it all; no all-reduce there).
Only the text model is read; a vision tower (Kimi-K2.5) is allocated but never loaded or run.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from eagle3_core.config import TargetConfig
from eagle3_core.target.family import text_config
from eagle3_core.target.int4_experts import Int4Experts, RowParallel, ShardedMoE
from eagle3_core.target.loading import auto_model_class, decoder, load_target_config, local_model_dir
from eagle3_core.target.memory import ep_int4_scheme_problems, quantization

# a checkpoint key's text-model part: `model.layers.3.mlp.gate.weight` (DeepSeek-V3) and
# `language_model.model.layers.3...` (Kimi-K2.5) both give `layers.3.mlp.gate.weight`
TEXT_KEY = re.compile(r"(?:^|\.)(layers\.\d+\..+|embed_tokens\.weight|norm\.weight|lm_head\.weight)$")
EXPERT_KEY = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                        r"(weight_packed|weight_scale|weight_shape|weight)$")
NOT_TEXT = ("vision", "mm_projector", "multi_modal")


def _sliced(linear: nn.Linear, dim: int, rank: int, world: int, what: str) -> tuple[int, int, int]:
    """Resize `linear` (on meta) to its 1/world slice along weight dim `dim` (0 rows, 1 columns); (dim, a, b)."""
    n = linear.weight.shape[dim]
    if n % world:
        raise ValueError(f"{what}: {n} {'outputs' if dim == 0 else 'inputs'} do not split over {world} ranks")
    a, b = rank * n // world, (rank + 1) * n // world
    shape = list(linear.weight.shape)
    shape[dim] = b - a
    linear.weight = nn.Parameter(torch.empty(shape, dtype=linear.weight.dtype, device="meta"), requires_grad=False)
    if dim == 0:
        linear.out_features = b - a
        if linear.bias is not None:
            linear.bias = nn.Parameter(torch.empty(b - a, dtype=linear.bias.dtype, device="meta"))
    else:
        linear.in_features = b - a
    return dim, a, b


def _shard(model, rank: int, world: int, group, shard_attention: bool) -> tuple[dict, dict]:
    """Swap the modules of `model` (meta) for this rank's: returns ({param name: (dim, a, b)} of the sliced
    parameters, {layer: Int4Experts}). Names are relative to the decoder (`layers.3.self_attn.o_proj.weight`)."""
    t, slices, experts = text_config(model.config), {}, {}
    E = t.n_routed_experts
    if E % world:
        raise ValueError(f"n_routed_experts = {E} does not split over {world} ranks (features.tp_size)")
    heads = t.num_attention_heads
    if shard_attention and heads % world:
        raise ValueError(f"num_attention_heads = {heads} does not split over {world} ranks; set "
                         f"features.shard_attention false or another features.tp_size")
    for i, layer in enumerate(decoder(model).layers):
        pre = f"layers.{i}"
        attn = layer.self_attn
        if shard_attention and world > 1:
            q = "q_b_proj" if getattr(attn, "q_b_proj", None) is not None else "q_proj"
            for name, dim in ((q, 0), ("kv_b_proj", 0), ("o_proj", 1)):
                slices[f"{pre}.self_attn.{name}.weight"] = _sliced(getattr(attn, name), dim, rank, world, pre)
            if attn.o_proj.bias is not None:
                slices[f"{pre}.self_attn.o_proj.bias"] = "rank0"
            attn.o_proj = RowParallel(attn.o_proj, group)
            attn.num_heads = heads // world
        mlp = layer.mlp
        dense = mlp.shared_experts if hasattr(mlp, "experts") else mlp
        where = f"{pre}.mlp.shared_experts" if dense is not mlp else f"{pre}.mlp"
        for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            slices[f"{where}.{name}.weight"] = _sliced(getattr(dense, name), dim, rank, world, where)
        if dense is mlp:
            mlp.down_proj = RowParallel(mlp.down_proj, group)
            continue
        # the router in fp32, as transformers keeps it (`_keep_in_fp32_modules_strict`): its logits see fp32 weights
        mlp.gate.weight = nn.Parameter(torch.empty(mlp.gate.weight.shape, device="meta"), requires_grad=False)
        ex = Int4Experts(rank * E // world, E // world, t.hidden_size, t.moe_intermediate_size, mlp.experts.act_fn,
                         model.dtype, device="meta")
        experts[i] = ex
        layer.mlp = ShardedMoE(mlp, ex, group)
    return slices, experts


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors (and no model.safetensors.index.json)")
    return files


def load_int4_target(cfg: TargetConfig, device: str | torch.device = "cpu", rank: int = 0, world: int = 1,
                     group=None, shard_attention: bool = True, dtype: torch.dtype | None = None):
    """The target of `cfg` as rank `rank` of `world` holds it (see the module doc), frozen, eval mode, on `device`:
    a transformers model whose decoder layers are swapped as above; forward it with the same input on every rank
    (the all-reduces over `group`, the default process group when None and world > 1). dtype: bf16 on CUDA, fp32
    on CPU by default (the experts are dequantized from their bf16 scales and cast).

    Raises ValueError naming config.json's quantization_config field for experts of another scheme than the one
    packing it implements (target.memory.ep_int4_scheme_problems), the checkpoint file and key for routed experts
    that are not pack-quantized INT4 (bf16 `.weight` experts: use backend 'hf_tp'), a weight_shape that is not the
    config's, and for weights the checkpoint lacks; ValueError for sizes that do not split over `world`."""
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if group is None and world > 1:
        group = torch.distributed.group.WORLD
    path = Path(local_model_dir(cfg))
    model = _meta_model(cfg, path, dtype)
    t = text_config(model.config)
    slices, experts = _shard(model, rank, world, group, shard_attention)
    dec = decoder(model)
    model.to_empty(device=device)
    # the rotary embedding's inv_freq is a non-persistent buffer computed at init: built again here, not loaded
    dec.rotary_emb = type(dec.rotary_emb)(config=t).to(device)
    targets = _checkpoint_targets(model, dec)
    wanted_experts = {(i, e, m, s) for i, ex in experts.items()
                      for e in range(ex.first, ex.first + ex.num_local)
                      for m in ("gate_proj", "up_proj", "down_proj")
                      for s in ("weight_packed", "weight_scale")}
    loaded = _read_checkpoint(path, targets, slices, experts, t, rank)
    missing = sorted(set(targets) - loaded) + sorted(f"layers.{i}.mlp.experts.{e}.{m}.{s}"
                                                     for i, e, m, s in wanted_experts - loaded)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} weights this rank needs, e.g. {missing[:5]}")
    model.eval().requires_grad_(False)
    return model


def _meta_model(cfg: TargetConfig, path: Path, dtype: torch.dtype):
    """The transformers model of `cfg` on the meta device, its quantization_config dropped (the experts are this
    module's, not compressed-tensors modules); ValueError naming path/config.json if the experts' scheme is not the
    one Int4Experts implements (checked before any weight is read)."""
    tcfg = load_target_config(cfg)
    q = quantization(tcfg)
    for c in {id(tcfg): tcfg, id(text_config(tcfg)): text_config(tcfg)}.values():
        if hasattr(c, "quantization_config"):
            delattr(c, "quantization_config")          # the experts are ours: no compressed-tensors modules
    with torch.device("meta"):
        model = auto_model_class(tcfg, str(path)).from_config(tcfg, dtype=dtype,
                                                               trust_remote_code=cfg.trust_remote_code)
    if (problems := ep_int4_scheme_problems(model, q)):               # before any weight is read
        raise ValueError(f"{path / 'config.json'}: {problems[0][1]}")
    return model


def _checkpoint_targets(model, dec) -> dict:
    """{checkpoint name relative to the decoder (`layers.3.self_attn.o_proj.weight`, `lm_head.weight`): parameter
    or buffer to fill} of everything but the routed experts (RowParallel's `.linear.` dropped from the name; the
    rotary buffers, built at init, left out)."""
    targets = {n: p for n, p in [*dec.named_parameters(), *dec.named_buffers()] if ".mlp.experts." not in n}
    lm = model.get_output_embeddings()
    if lm is not None and lm.weight is not dec.embed_tokens.weight:
        targets["lm_head.weight"] = lm.weight
    targets = {re.sub(r"\.(o_proj|down_proj)\.linear\.", r".\1.", n): p for n, p in targets.items()}
    targets.pop("rotary_emb.inv_freq", None)
    targets.pop("rotary_emb.original_inv_freq", None)
    return targets


def _read_checkpoint(path: Path, targets: dict, slices: dict, experts: dict, t, rank: int) -> set:
    """Copy this rank's part of every text-model tensor of the checkpoint at `path` into `targets` (sliced by
    `slices`) and `experts` ({layer: Int4Experts}); skips other towers and multi-token-prediction layers. Returns the
    names and (layer, expert, matrix, tensor) tuples loaded."""
    loaded = set()
    with torch.no_grad():
        for file in _checkpoint_files(path):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    m = TEXT_KEY.search(key)
                    if m is None or any(w in key[:m.start()] for w in NOT_TEXT):
                        continue
                    name = m.group(1)
                    if name.startswith("layers.") and int(name.split(".")[1]) >= t.num_hidden_layers:
                        continue                      # multi-token-prediction layers (DeepSeek-V3's layer 61)
                    if (ex_m := EXPERT_KEY.match(name)) is not None:
                        _load_expert(f, key, file, ex_m, experts, t, loaded)
                        continue
                    if name not in targets:
                        continue
                    _copy(targets[name], f, key, slices.get(name), rank)
                    loaded.add(name)
    return loaded


def _copy(param: torch.Tensor, f, key: str, spec, rank: int) -> None:
    """Copy checkpoint tensor `key` (its slice `spec` = (dim, a, b), 'rank0' for a row-parallel bias) into param."""
    if spec == "rank0":
        param.copy_(f.get_tensor(key)) if rank == 0 else param.zero_()
    elif spec is None:
        param.copy_(f.get_tensor(key))
    else:
        dim, a, b = spec
        sl = f.get_slice(key)
        param.copy_(sl[a:b] if dim == 0 else sl[:, a:b])


def _load_expert(f, key: str, file: Path, m: re.Match, experts: dict, t, loaded: set) -> None:
    layer, e, mat, what = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
    ex = experts.get(layer)
    if ex is None or not ex.first <= e < ex.first + ex.num_local:
        return
    if what == "weight":
        raise ValueError(f"{file}: {key} is a bf16 expert weight; features.backend 'ep_int4' reads routed experts "
                         f"stored pack-quantized INT4 (Kimi-K2.5's layout); use 'hf_tp' for this checkpoint")
    H, I, j = t.hidden_size, t.moe_intermediate_size, e - ex.first
    out_in = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}[mat]
    if what == "weight_shape":
        if tuple(f.get_tensor(key).tolist()) != out_in:
            raise ValueError(f"{file}: {key} = {f.get_tensor(key).tolist()}, expected {list(out_in)} from the config")
        return
    src = f.get_tensor(key)
    dst = {("gate_proj", "weight_packed"): ex.gate_up_packed[j, :I], ("up_proj", "weight_packed"):
           ex.gate_up_packed[j, I:], ("down_proj", "weight_packed"): ex.down_packed[j],
           ("gate_proj", "weight_scale"): ex.gate_up_scale[j, :I], ("up_proj", "weight_scale"): ex.gate_up_scale[j, I:],
           ("down_proj", "weight_scale"): ex.down_scale[j]}[mat, what]
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{file}: {key} has shape {tuple(src.shape)}, expected {tuple(dst.shape)} (pack-quantized "
                         f"INT4, group size 32, of a [{out_in[0]}, {out_in[1]}] expert matrix)")
    if what == "weight_scale" and src.dtype != dst.dtype:
        raise ValueError(f"{file}: {key} is {src.dtype}; the INT4 experts read {dst.dtype} scales")
    dst.copy_(src)
    loaded.add((layer, e, mat, what))

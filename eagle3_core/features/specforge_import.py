"""Feature import: aux hidden states another tool extracted, brought into our checksummed shard store instead of
running the target again (features.import_from; `python -m eagle3_core.feature_import`).

Layout read: SpecForge's offline features, one file per sample (`*.ckpt`, or `*.ckpt.gz`), each a dict of
  input_ids [T] int, loss_mask [T] int, hidden_state [1, T, H_t] (the final-normed state lm_head sees),
  aux_hidden_state [1, T, 3 H_t] (the three aux layers, concatenated)
as SpecForge's `scripts/prepare_hidden_states.py` writes them (sgl-project/SpecForge commit f1424fb6: `DataPoint`,
`torch.save(asdict(data_point))`, files at `rows_{g}-{g + 2000}/data_{idx}.ckpt`) and
`specforge.data.preprocessing.OfflineEagle3Dataset` reads them (SpecForge 0.2.0, the version the Makefile installs:
`list_local_files`, `_open_file`, `process_data`). SpecForge loads them with
`torch.load(weights_only=False)`; we load with `weights_only=True` (tensors only, no code runs).

Every file is checked before anything is written: the fields and their shapes, the hidden size and aux width
against the target, and its input_ids and loss_mask against our tokenization of the same conversation (the
tokenize stage's sample with the same tokens). A file that fails is named with the field and what to do; nothing
is written then. The shards are written by features.store.extract_features, so an imported store is the same kind of
store as an extracted one (manifest, content keys, resumable per shard, `verify`).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import safe_open

from eagle3_core.features.extract import HFExtractor
from eagle3_core.target.family import text_config


class FeatureImportError(ValueError):
    """A file that cannot be imported: the message names the file, the field and the fix."""


def feature_files(src: Path) -> list[Path]:
    """The SpecForge feature files under `src` (recursively, *.ckpt and *.ckpt.gz, sorted by path as SpecForge's
    list_local_files sorts them). Raises FeatureImportError if there are none."""
    src = Path(src)
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name.endswith((".ckpt", ".ckpt.gz")))
    if not files:
        raise FeatureImportError(f"features.import_from {src}: no *.ckpt or *.ckpt.gz files; give the directory "
                                 f"SpecForge's prepare_hidden_states.py wrote (its --output-path)")
    return files


def _load(path: Path) -> dict:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = torch.load(io.BytesIO(f.read()), weights_only=True, map_location="cpu")
        else:
            data = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception as e:  # noqa: BLE001 (any unreadable file gets the same message)
        raise FeatureImportError(f"{path}: cannot be read as a tensor file with torch.load(weights_only=True) "
                                 f"({type(e).__name__}: {e}); re-export it or leave it out") from None
    if not isinstance(data, dict):
        raise FeatureImportError(f"{path}: holds a {type(data).__name__}, not SpecForge's dict of input_ids, "
                                 f"loss_mask, hidden_state, aux_hidden_state")
    return data


def read_sample(path: Path, hidden_size: int) -> dict[str, torch.Tensor]:
    """One SpecForge feature file as {input_ids int64 [T], loss_mask int64 [T], final [T, H_t], aux [T, 3H_t]}
    (the file's float dtype). Raises FeatureImportError naming the file and the field that is missing or has the
    wrong shape, or an aux width other than 3 x hidden_size (features of other layers or another target)."""
    data = _load(path)
    missing = [k for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state") if k not in data]
    if missing:
        raise FeatureImportError(f"{path}: field(s) {missing} missing (has {sorted(data)}); SpecForge's layout has "
                                 f"input_ids, loss_mask, hidden_state, aux_hidden_state")
    ids, mask = data["input_ids"].reshape(-1) if data["input_ids"].dim() == 2 else data["input_ids"], \
        data["loss_mask"].reshape(-1) if data["loss_mask"].dim() == 2 else data["loss_mask"]
    T = ids.numel()
    if ids.dim() != 1 or ids.is_floating_point():
        raise FeatureImportError(f"{path}: input_ids is {tuple(data['input_ids'].shape)} {data['input_ids'].dtype}"
                                 f", expected integer [T]")
    if tuple(mask.shape) != (T,):
        raise FeatureImportError(f"{path}: loss_mask is {tuple(mask.shape)}, expected [{T}] like input_ids")
    out = {"input_ids": ids.long(), "loss_mask": mask.long()}
    for field, name, width in (("hidden_state", "final", hidden_size), ("aux_hidden_state", "aux", 3 * hidden_size)):
        t = data[field]
        t = t[0] if t.dim() == 3 and t.shape[0] == 1 else t
        if t.dim() != 2 or t.shape[0] != T:
            raise FeatureImportError(f"{path}: {field} is {tuple(data[field].shape)}, expected [1, {T}, W] for "
                                     f"{T} tokens")
        if t.shape[1] != width:
            what = ("three aux layers of the target, 3 x H_t" if name == "aux" else "the target's hidden size H_t")
            raise FeatureImportError(f"{path}: {field} is {t.shape[1]} wide but {what} = {width}: the file was "
                                     f"made with other layers or another target; extract it again for this target "
                                     f"or set target.model to the one it came from")
        if not torch.isfinite(t).all():
            bad = (~torch.isfinite(t)).any(-1).nonzero().flatten()
            raise FeatureImportError(f"{path}: {field} holds non-finite values (NaN or inf) at {bad.numel()} of {T} "
                                     f"positions (first: {bad[:5].tolist()}): the other tool's forward overflowed "
                                     f"or the file is damaged; extract this sample again or leave it out")
        out[name] = t
    return out


HEAD_SUFFIXES = {"embed": ("embed_tokens.weight", "wte.weight", "word_embeddings.weight"),
                 "lm_head": ("lm_head.weight", "output.weight")}


def _hub_file(model: str, name: str, revision: str | None) -> Path | None:
    """One file of a hub repository (downloaded once into the hub cache), None if the repository has none."""
    try:
        return Path(hf_hub_download(model, name, revision=revision))
    except EntryNotFoundError:
        return None


def head_tensors(model_dir: str | Path, revision: str | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(embedding [V, H_t], lm_head [V, H_t], the tensor names read) from the target's safetensors in
    `model_dir` (a directory, or a hub name: then only the index and the one or two shard files holding these
    tensors are downloaded) through the index's weight_map or the single model.safetensors, reading exactly those
    one or two tensors (a tied lm_head is the embedding); a vision tower's embeddings are passed over. Raises
    FeatureImportError naming the directory when no file or no embedding is found."""
    if not Path(model_dir).is_dir():                                   # a hub name
        index = _hub_file(str(model_dir), "model.safetensors.index.json", revision)
        single = None if index else _hub_file(str(model_dir), "model.safetensors", revision)
        where = json.loads(index.read_text())["weight_map"] if index else {}
        local = (lambda f: _hub_file(str(model_dir), f, revision)) if index else (lambda f: single)
        return _read_head(model_dir, where or _keys(single), local)
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        where = json.loads(index.read_text())["weight_map"]
    elif (model_dir / "model.safetensors").exists():
        where = _keys(model_dir / "model.safetensors")
    else:
        raise FeatureImportError(f"{model_dir}: no model.safetensors(.index.json): the import reads the target's "
                                 f"embedding and lm_head from its safetensors; give target.model as a directory or "
                                 f"hub name with safetensors weights")

    return _read_head(model_dir, where, lambda f: model_dir / f)


def _keys(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    with safe_open(path, "pt") as f:
        return {k: path.name for k in f.keys()}


def _read_head(where_from, where: dict[str, str], local) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """head_tensors' reading: `where` {tensor name: file name}, local(file name) -> its path."""
    def find(kind: str) -> str | None:
        names = [k for k in where if k.endswith(HEAD_SUFFIXES[kind]) and "vision" not in k and "visual" not in k]
        return min(names, key=len) if names else None

    names = {kind: find(kind) for kind in HEAD_SUFFIXES}
    if names["embed"] is None:
        raise FeatureImportError(f"{where_from}: no embedding tensor ({', '.join(HEAD_SUFFIXES['embed'])}) in the "
                                 f"target's safetensors; the import needs the target's embedding and lm_head")
    read = {}
    for name in {n for n in names.values() if n}:
        with safe_open(local(where[name]), "pt") as f:
            read[name] = f.get_tensor(name)
    embed = read[names["embed"]]
    return embed, read[names["lm_head"]] if names["lm_head"] else embed, sorted(read)


def _ids_key(ids) -> str:
    return hashlib.sha256(torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids,
                                          dtype=torch.int64).numpy().tobytes()).hexdigest()


def _first_difference(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at position {n} of {len(a)} vs {len(b)}"


def match_files(files: list[Path], rows: list[dict], hidden_size: int, where: str) -> dict[str, Path]:
    """{sample id: file} pairing each tokenized row ({id, input_ids, loss_mask}) with the file of the same tokens,
    after read_sample's checks. Raises FeatureImportError naming the file and field when a file's input_ids match
    no row (another tokenization or conversation; the message compares it with the row at its place in order), a
    file's loss_mask differs from ours, or rows are left without a file."""
    by_key = {_ids_key(r["input_ids"]): r for r in rows}
    paired: dict[str, Path] = {}
    for n, path in enumerate(files):
        s = read_sample(path, hidden_size)
        row = by_key.get(_ids_key(s["input_ids"]))
        if row is None:
            near = rows[min(n, len(rows) - 1)]
            raise FeatureImportError(
                f"{path}: input_ids ({s['input_ids'].numel()} tokens) match no sample of our tokenization of the "
                f"same conversations ({where}); against sample {near['id']!r} at the same place: "
                f"{_first_difference(s['input_ids'].tolist(), list(near['input_ids']))}. The dump was made with "
                f"another chat template or tokenizer, or from other conversations: import features of these "
                f"conversations, tokenized as the target's template does")
        mask = [int(m) for m in row["loss_mask"]]
        if s["loss_mask"].tolist() != mask:
            got = s["loss_mask"].tolist()
            raise FeatureImportError(
                f"{path}: loss_mask ({sum(got)} tokens) differs from ours for sample {row['id']!r} ({sum(mask)} "
                f"tokens; {_first_difference(got, mask)}): the other tool trains on other tokens; fix its mask "
                f"or tokenize with its convention")
        paired[row["id"]] = path
    if (left := [r["id"] for r in rows if r["id"] not in paired]):
        raise FeatureImportError(f"{len(left)} of {len(rows)} tokenized samples have no file in the import "
                                 f"(first: {left[:5]}); import their features too or leave their conversations out")
    return paired


class ImportedExtractor:
    """An Extractor (features.extract) that reads each sample's features from its file instead of running the
    target. The target's config, embedding and lm_head still come from the target: target_top1 is argmax of
    lm_head over the file's final state, and the store's head.json and target id are the target's, so imported
    and extracted shards of one target share content keys."""

    def __init__(self, config, embed: torch.Tensor, lm_head: torch.Tensor, aux_layer_ids: list[int],
                 files_by_ids: dict[str, Path], lm_head_chunk: int = 4096):
        self.model = SimpleNamespace(config=config)
        self.aux_layer_ids, self.hidden_size = list(aux_layer_ids), text_config(config).hidden_size
        self.device = torch.device("cpu")
        self.embed, self.lm = embed, lm_head
        self.files, self.lm_head_chunk = files_by_ids, lm_head_chunk

    @torch.no_grad()
    def forward(self, seqs: list[list[int]]) -> dict:
        """aux [B, T, 3H_t], final [B, T, H_t] (the files' dtype), target_top1 int32 [B, T], lengths [B]."""
        samples = [read_sample(self.files[_ids_key(s)], self.hidden_size) for s in seqs]
        B, T = len(seqs), max(len(s) for s in seqs)
        dt = samples[0]["final"].dtype
        aux, final = torch.zeros(B, T, 3 * self.hidden_size, dtype=dt), torch.zeros(B, T, self.hidden_size, dtype=dt)
        top1 = torch.zeros(B, T, dtype=torch.int32)
        for b, s in enumerate(samples):
            n = s["input_ids"].numel()
            aux[b, :n], final[b, :n] = s["aux"], s["final"]
            for a in range(0, n, self.lm_head_chunk):
                rows = s["final"][a:a + self.lm_head_chunk].to(self.lm.dtype)
                top1[b, a:a + rows.shape[0]] = (rows @ self.lm.T).argmax(-1).to(torch.int32)
        return {"aux": aux, "final": final, "target_top1": top1,
                "lengths": torch.tensor([len(s) for s in seqs])}

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self.lm


def imported_extractor(src: Path, rows: list[dict], config, embed: torch.Tensor, lm_head: torch.Tensor,
                       aux_layer_ids: list[int], where: str) -> ImportedExtractor:
    """The ImportedExtractor for the files under `src` and the tokenized `rows`, every file checked first
    (match_files). config: the target's config; embed, lm_head: its head weights (head_tensors: nothing else of
    the target is read, nothing runs)."""
    H = text_config(config).hidden_size
    files = match_files(feature_files(src), rows, H, where)
    by_key = {_ids_key(r["input_ids"]): files[r["id"]] for r in rows}
    return ImportedExtractor(config, embed, lm_head, aux_layer_ids, by_key)


def aux_spot_check(extractor: ImportedExtractor, target_model, row: dict, tolerance: float = 0.1) -> float:
    """The relative difference mean|ours - theirs| / mean|ours| between the target's own aux states over `row`
    (HFExtractor, this process) and the imported file's; raises FeatureImportError naming the file and
    features.aux_layer_ids above `tolerance` (0.1: bf16 forwards of one target differ by about 1-2%, other layers
    by tens of percent). Returns the difference."""
    ours = HFExtractor(target_model, extractor.aux_layer_ids).forward([list(row["input_ids"])])["aux"][0].float()
    path = extractor.files[_ids_key(row["input_ids"])]
    theirs = read_sample(path, extractor.hidden_size)["aux"].float()
    diff = float((ours - theirs).abs().mean() / ours.abs().mean().clamp_min(1e-12))
    if diff > tolerance:
        raise FeatureImportError(f"{path}: its aux states differ from the target's at features.aux_layer_ids "
                                 f"{extractor.aux_layer_ids} by {diff:.0%} (mean relative; at most {tolerance:.0%} "
                                 f"for the same layers): the file holds other layers or another target; set "
                                 f"features.aux_layer_ids to the layer outputs the other tool captured (SpecForge "
                                 f"with SGLang: its draft config's eagle_aux_hidden_state_layer_ids as SGLang reads "
                                 f"them, target.family.draft_aux_ids: the same ids on Llama-family targets; on "
                                 f"DeepSeek/Kimi targets ids not starting at 1 are layer inputs, so [2, 30, 58] "
                                 f"means outputs [1, 29, 57])")
    return diff

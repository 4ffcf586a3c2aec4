"""Stand-in for sglang 0.5.14 `srt/server_args.py` (see sglang/__init__.py): the fields the backend sets."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ServerArgs:
    model_path: str
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    device: str | None = None
    tp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    page_size: int | None = None
    disable_cuda_graph: bool = False
    chunked_prefill_size: int | None = None
    enable_return_hidden_states: bool = False
    random_seed: int | None = None

    def __post_init__(self):
        # upstream resolves device, page size and the memory fraction from the GPU; here: fixed values
        import torch
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.page_size = self.page_size or 1
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.8

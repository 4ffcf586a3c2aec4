"""The generation stage's inference servers: started for the block and stopped when it ends (kinds 'llama.cpp' and
'sglang'), or the addresses of running ones (kind 'external'); none for in-process generation ('transformers')."""
from __future__ import annotations

from contextlib import contextmanager

from eagle3_core.config import EMBEDDED, PipelineConfig
from eagle3_core.contract.layout import RunLayout
from eagle3_core.serving.launcher import llama_server, next_attempt_log, sglang_server
from eagle3_core.target.loading import gguf_path


@contextmanager
def generation_servers(cfg: PipelineConfig):
    """Base URLs to generate with. Kinds 'llama.cpp' and 'sglang' start the server here, on `server.host` (default
    127.0.0.1), logging to generations/server.attempt-N.log (one log per start, earlier attempts kept), watched
    while the block runs (a server that exits fails the stage at once: launcher.exit_error), and stop it when the
    block ends, on failure, Ctrl-C, SIGTERM (a cancelled flow run) and, through PDEATHSIG, when this process is
    killed. Kind 'external' yields `server.url` / `server.urls`; kind 'transformers' yields no URL (the stage
    generates in process). Raises ValueError for a config that cannot work, ServerError if a server does not
    start."""
    s, log_path = cfg.server, next_attempt_log(RunLayout(cfg.run_dir).generations, "server")
    if s.kind == "llama.cpp":
        gguf = gguf_path(cfg.target)
        if gguf is None:
            raise ValueError("server.kind 'llama.cpp' needs a GGUF target; use server.kind 'sglang' (or 'external' "
                             "with server.url) for a Hugging Face target")
        with llama_server(gguf, log_path, s.host, s.port, s.parallel, s.ctx_per_slot, s.startup_timeout_s,
                          s.extra_args) as url:
            yield [url]
    elif s.kind == "sglang":
        with sglang_server(cfg.target.model, log_path, s.host, s.port, cfg.target.revision,
                           cfg.target.trust_remote_code, s.startup_timeout_s, s.extra_args, cfg.sglang_python) as url:
            yield [url]
    elif s.kind == "transformers":
        yield []
    else:
        if not s.base_urls():
            raise ValueError("server.kind 'external' needs server.url or server.urls (e.g. http://127.0.0.1:30000)")
        yield s.base_urls()


def server_problems(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """The generation server against the target, where the prompts need one (rows in mode 'keep' send no
    request): server.kind 'llama.cpp' (the default) serves GGUF targets only, 'sglang'
    Hugging Face checkpoints; 'external' needs server.url or server.urls."""
    mix = cfg.prompts.mix
    if mix is not None and all(src.mode == "keep" for src in mix.sources):
        return []
    s, gguf = cfg.server, cfg.target.model == EMBEDDED or cfg.target.gguf_file is not None
    if s.kind == "llama.cpp" and not gguf:
        return [("server.kind", f"'llama.cpp' (the default) serves a GGUF target, and target.model "
                 f"{cfg.target.model!r} is a Hugging Face checkpoint: set server.kind to 'sglang' (the stage starts "
                 f"SGLang on it), 'transformers' (the target in this process; small targets) or 'external' with "
                 f"server.url (a server you run)")]
    if s.kind == "sglang" and gguf:
        return [("server.kind", f"'sglang' starts SGLang on a Hugging Face checkpoint, and the target is a GGUF "
                 f"file ({cfg.target.model}{'/' + cfg.target.gguf_file if cfg.target.gguf_file else ''}): set "
                 f"server.kind to 'llama.cpp'")]
    if s.kind == "external" and not s.base_urls():
        return [("server.url", "server.kind 'external' needs server.url or server.urls (the base URL of a running "
                 "server, e.g. http://127.0.0.1:30000)")]
    return []

"""`python -m eagle3_core.check CONFIG [--draft DIR]`: everything about a run that can be known from its config and
the target's config files (no weights), checked before anything expensive runs; the first step of every flow run.

Legend: L target decoder layers, H_t target hidden, V target vocab, N draft vocab.

It prints the resolved target family, the aux layer ids in each engine's reading (target_family.engine_readings), the
draft geometry and rope, vocab sizes, context lengths, disk per feature format and the backend of the features and
evaluate stages (which path, and why), and refuses, naming the field and the fix, what would fail later: unsorted,
repeated or out-of-range aux ids (L-1 included), a rope the draft cannot run, draft positions below the target's
context, a target too large for a stage that loads it whole in this process (features 'hf', evaluate 'decode'), a
features backend and size whose bytes per GPU (target/memory_fit.py: the checkpoint's bytes as stored, its
quantization_config read, and transformers' own plans on a meta-device model) do not fit one GPU, or that split
attention heads or routed experts unevenly, expert parallelism on a target without experts, a server kind that
cannot serve the target (generation.servers.server_problems), a train.init_from that is missing or does not fit
(training.warm_start.init_from_check), less free disk on run_dir's file system than the features stage writes
(checkers.disk_check; in check_or_raise and the CLI), a token budget prompt-mode rows cannot fit (generation.max_new_tokens
against features.max_length, the regenerating server's context against both: data.budget.budget_problems),
generation.chat_template_kwargs the target's chat template does not read or reads as another type
(data.template_kwargs; offline with `--chat-template FILE`); with `--draft DIR` (a warm start or a deployment)
also the draft's architecture (EAGLE-2 refused), fc, d2t/t2d and ids (preflight.check_draft); aux ids SGLang
cannot serve (target.family.sglang_ids), 'ep_int4' on experts quantized otherwise (memory.ep_int4_scheme_problems),
a feature store another backend began (features_stage.mixed_backend_problems).
CONFIG: a JSON file holding a PipelineConfig, or a preset name. `--gpus 8x141GB`: the node's GPUs, not this host's.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from eagle3_core.checkers import CHECKERS, DETECT, run_to_check
from eagle3_core.config import PipelineConfig, config_or_preset
from eagle3_core.data.template_kwargs import chat_template_file
from eagle3_core.target.loading import target_config_file


class CheckError(ValueError):
    """The run would fail later; `problems` lists (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("check refused the run:\n" + "\n".join(f"- {f}: {m}" for f, m in problems))

    def __repr__(self) -> str:            # Prefect logs a failure as its repr: keep the lines readable
        return f"CheckError: {self}"

    # the refusal names the config's fault and its fix: a traceback would point at this code, not at the fault
    traceback_helps = False


def check_run(cfg: PipelineConfig, draft_dir: Path | None = None, target_config=None,
              memory: tuple[int, str] | None = None, gpus=DETECT, disk=None, chat_template=DETECT,
              sglang_env=DETECT) -> tuple[dict, list[tuple[str, str]]]:
    """(facts, problems) of a run. target_config: the target's transformers config (default: read with
    target.loading.load_target_config, no weights); memory: (bytes, description) for the in-process fit check (default:
    machine_memory_bytes()); gpus: (count, bytes per GPU) for the features backend's per-GPU check
    (features.backends.memory_facts; default: this host's, None: no GPU); disk: None (not checked), DETECT (run_dir's
    file system) or (free bytes, description) for checkers.disk_check; chat_template: the target's chat template (text)
    that generation.chat_template_kwargs are checked against (data.template_kwargs; default: the target's
    tokenizer's where the target's config is read from it, not checked where `target_config` is given; None: not
    checked); sglang_env: probe_sglang's answer for sglang_python (default: probed here, with backend 'sglang'
    only: its row's python_check). Also checks the generation server against the target (server_problems) and
    train.init_from (init_from_check). Facts are JSON-able; problems are (field, message) pairs, empty when the run fits: those
    of checkers.CHECKERS, in their order."""
    run = run_to_check(cfg, draft_dir, target_config, memory, gpus, disk, chat_template, sglang_env)
    facts, problems = {}, []
    for checker in CHECKERS:                                   # each (facts, problems) of one part of the run
        more_facts, more = checker(run)
        facts.update(more_facts)
        problems += more
    return facts, problems


def render(facts: dict) -> str:
    """The facts as indented text lines."""
    lines = []

    def walk(d: dict, depth: int) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                lines.append("  " * depth + f"{k}:")
                walk(v, depth + 1)
            else:
                lines.append("  " * depth + f"{k}: {v}")
    walk(facts, 0)
    return "\n".join(lines)


def check_or_raise(cfg: PipelineConfig, draft_dir: Path | None = None, log=print, facts_on_refusal: bool = True,
                   **kw) -> dict:
    """check_run (with the disk of run_dir's file system unless `disk` says otherwise), logging the facts; raises
    CheckError listing every problem with its fix (after logging the facts only if `facts_on_refusal`: a flow
    run's log then opens with the cause). Returns the facts."""
    facts, problems = check_run(cfg, draft_dir, **{"disk": DETECT, **kw})
    if problems and not facts_on_refusal:
        raise CheckError(problems)
    log("check:\n" + render(facts))
    if problems:
        raise CheckError(problems)
    return facts


def parse_gpus(text: str) -> tuple[int, int] | None:
    """`--gpus`: 'NxSIZE' (8x141GB, 8x80GiB; a bare SIZE is GB) -> (N GPUs, bytes per GPU), 'none' -> None. Raises
    ValueError naming the flag and the form."""
    m = re.fullmatch(r"\s*(\d+)\s*[x*]\s*(\d+(?:\.\d+)?)\s*(GB|G|GiB|)\s*", text, re.IGNORECASE)
    if text.strip().lower() != "none" and (not m or int(m[1]) < 1):
        raise ValueError(f"--gpus {text!r}: give the node's GPUs as NxSIZE, e.g. 8x141GB (8 H200s) or 8x80GiB, "
                         f"or 'none'")
    return (int(m[1]), int(float(m[2]) * (2**30 if m[3].lower() == "gib" else 10**9))) if m else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check a run's config against its target (no weights read).")
    p.add_argument("config", help="JSON file with a PipelineConfig, or a preset name (demo, debug_tiny)")
    p.add_argument("--draft", default=None, help="a draft directory to check too (warm start or deployment)")
    p.add_argument("--target-config", default=None, metavar="CONFIG_JSON",
                   help="the target's config.json, read instead of target.model's: check a run offline with only "
                        "that file downloaded (the free disk of run_dir is then not checked)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the target's chat template (a .jinja file, or a tokenizer_config.json holding "
                        "'chat_template'): generation.chat_template_kwargs are checked against it offline")
    p.add_argument("--gpus", default=None, metavar="NxSIZE",
                   help="the GPUs of the node the run will use (e.g. 8x141GB), instead of this host's: the "
                        "features backend's and the in-process stages' fit are checked against them")
    a = p.parse_args(argv)
    try:
        cfg = config_or_preset(a.config)
        # --target-config: a check made away from the run's host (offline), whose disk says nothing about it
        kw = {"target_config": target_config_file(a.target_config), "disk": None} if a.target_config else {}
        if a.chat_template:
            kw["chat_template"] = chat_template_file(a.chat_template)
        if a.gpus is not None:
            kw["gpus"] = parse_gpus(a.gpus)
            if kw["gpus"]:                        # the in-process stages hold the target on one of them
                kw["memory"] = (kw["gpus"][1], f"one of {kw['gpus'][0]} GPU(s) of {kw['gpus'][1] / 1e9:.0f} GB "
                                               f"(--gpus)")
        check_or_raise(cfg, a.draft, **kw)
    except ValueError as e:                       # CheckError, or a config that does not validate
        print(str(e), file=sys.stderr)
        return 1
    except OSError as e:                          # the target's config is neither local nor reachable
        print(f"check: cannot read the config of target {cfg.target.model!r}: {str(e).splitlines()[0]}\n"
              f"Offline, download only its config.json (`hf download {cfg.target.model} config.json`) and pass "
              f"--target-config PATH", file=sys.stderr)
        return 2
    print("check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

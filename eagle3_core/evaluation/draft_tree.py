"""EAGLE draft trees: construction (SGLang's top-k expansion), the tree attention mask and the greedy tree accept.

Legend: k top-k per expansion, S draft steps (tree depth), T verify tokens = root + T-1 draft tokens, P committed
positions (KV-cache length before the verify step), N draft vocab.

Construction follows SGLang 0.5.14 `srt/speculative/eagle_worker_v2.py::draft_forward`, `spec_utils.py::
select_top_k_tokens` and `eagle_utils.py::organize_draft_results`:
- level 0: the top-k tokens of the draft's distribution after the root, score = their probability;
- level i >= 1: each of the k nodes chosen at level i-1 is expanded by its top-k tokens (score = parent score *
  probability): k*k candidates, of which the k best by score are chosen for expansion at level i+1;
- all k + (S-1)*k*k candidates compete: the T-1 best scores become the tree, kept in candidate order.
Probabilities are the softmax over the draft vocab (SGLang `renorm_draft_probs` without rejection sampling).
topk 1 gives the chain (T must then be S+1, as SGLang forces).

One difference from SGLang: here every expanded node's draft step attends to the prefix and its own ancestors;
SGLang's draft attention for topk > 1 reuses per-branch KV slots across re-selections. This only changes which
tokens are proposed, never the target's verdict (the target always verifies with the exact tree mask).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_core.config.eval_config import check_tree_params


@dataclass
class DraftTree:
    """A verify tree. Node 0 is the root (the last committed token, whose target prediction is checked first).

    tokens [T] int target ids; parents [T] (parents[0] = -1, parents[j] < j); depth [T] (root 0);
    scores [T] cumulative draft probability (root 1.0).
    """
    tokens: list[int]
    parents: list[int]
    depth: list[int]
    scores: list[float]

    def children(self, node: int) -> list[int]:
        return [j for j, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (the root itself excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def contains_path(self, tokens: list[int]) -> bool:
        """True if the draft tokens `tokens` form a root-to-node path of this tree."""
        node = 0
        for tok in tokens:
            nxt = [c for c in self.children(node) if self.tokens[c] == tok]
            if not nxt:
                return False
            node = nxt[0]
        return True


@torch.no_grad()
def build_tree(draft, root_token: int, h: torch.Tensor, logits: torch.Tensor, dcache: dict, n_ctx: int,
               num_steps: int, topk: int, num_draft_tokens: int) -> DraftTree:
    """Draft a tree after the committed state (SGLang semantics, module docstring).

    draft: Eagle3Draft-like (`decode`, `draft_to_target`); h [1, 1, H] and logits [N] the draft's output at the
    root (pre-norm hidden, logits); dcache: the draft's committed KV cache ('k', 'v' [1, nkv, n_ctx, hd]), not
    modified. A node at depth d is decoded at RoPE position n_ctx + d - 1 (the TTT convention of ttt.py).
    Returns a DraftTree with num_draft_tokens nodes. Raises ValueError on parameters SGLang rejects.
    """
    check_tree_params(num_steps, topk, num_draft_tokens)
    # candidate lists, in SGLang's flattened order: level 0 (k), then each later level (k*k)
    cand_tok: list[int] = []
    cand_score: list[float] = []
    cand_parent: list[int] = []                                  # index into the candidates, -1 = root
    cand_depth: list[int] = []

    def expand(parent: int, parent_score: float, lg: torch.Tensor, depth: int) -> None:
        p, idx = lg.float().softmax(-1).topk(topk)               # [k] draft-vocab ids
        for pj, ij in zip(p.tolist(), draft.draft_to_target(idx).tolist()):
            cand_tok.append(int(ij))
            cand_score.append(parent_score * pj)
            cand_parent.append(parent)
            cand_depth.append(depth)

    expand(-1, 1.0, logits, 1)
    frontier = list(range(topk))                                 # level 0: every candidate is expanded
    state = {-1: (h, None)}                                      # node -> (out hidden, path keys/values)
    for level in range(1, num_steps):
        first_new = len(cand_tok)
        for node in frontier:
            h_in, path = state[cand_parent[node]]
            # a fresh dict: decode extends it, the committed cache stays as it is; every entry ('k', 'v' and a
            # multi-layer draft's 'k1', 'v1', ...) is [1, nkv, positions, hd]: prefix + this node's ancestors
            cache = dict(dcache) if path is None else {t: torch.cat([c, path[t]], 2) for t, c in dcache.items()}
            out, lg = draft.decode(torch.tensor([[cand_tok[node]]], device=h_in.device), h_in,
                                   torch.tensor([[n_ctx + level - 1]], device=h_in.device), cache)
            state[node] = (out, {t: c[:, :, n_ctx:] for t, c in cache.items()})
            expand(node, cand_score[node], lg[0, -1], level + 1)
        # the k best of this level's k*k candidates are expanded next (ties: lower index, as a stable sort)
        new = range(first_new, len(cand_tok))
        frontier = sorted(sorted(new, key=lambda c: -cand_score[c])[:topk])
    # the T-1 best candidates overall; a child never outranks its parent (score <= parent's, index > parent's)
    chosen = sorted(sorted(range(len(cand_tok)), key=lambda c: -cand_score[c])[:num_draft_tokens - 1])
    where = {-1: 0, **{c: j + 1 for j, c in enumerate(chosen)}}
    assert all(cand_parent[c] in where for c in chosen), "a chosen draft token's parent was not chosen"
    return DraftTree(tokens=[root_token] + [cand_tok[c] for c in chosen],
                     parents=[-1] + [where[cand_parent[c]] for c in chosen],
                     depth=[0] + [cand_depth[c] for c in chosen],
                     scores=[1.0] + [cand_score[c] for c in chosen])


def tree_attention_mask(tree: DraftTree, prefix_len: int) -> torch.Tensor:
    """bool [1, 1, T, P + T]: every node sees the P committed positions and its ancestors and itself (True =
    attend; the convention of a custom 4D mask in transformers `masking_utils`)."""
    T = len(tree.tokens)
    mask = torch.zeros(1, 1, T, prefix_len + T, dtype=torch.bool)
    mask[..., :prefix_len] = True
    for j in range(T):
        node = j
        while node >= 0:
            mask[0, 0, j, prefix_len + node] = True
            node = tree.parents[node]
    return mask


def greedy_accept(tree: DraftTree, preds: list[int]) -> tuple[list[int], int]:
    """Greedy tree verify (SGLang `verify_tree_greedy`): from the root, move to the child whose token equals the
    target's argmax at the current node, while one exists. preds [T]: target argmax at each node.
    Returns (accepted nodes, root excluded, in order; bonus token = the target's argmax at the last one)."""
    node, path = 0, []
    while True:
        nxt = [c for c in tree.children(node) if tree.tokens[c] == preds[node]]
        if not nxt:
            return path, preds[node]
        node = nxt[0]                                             # siblings hold distinct tokens
        path.append(node)

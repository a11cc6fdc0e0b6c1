"""Draft trees: the shape a verify step checks when drafts branch (topk > 1, NGRAM BFS).

A request's verify rows are [x0, d1 .. dm]: its last accepted token (row 0, the root) and m drafts.
`parents[j]` is the row of row j's parent (-1 for the root); parents always come before their
children (BFS order), so row j's ancestors are rows < j. A chain is parents = [-1, 0, 1, .., m-1].

Row j sits at position prefix + depth(j) (RoPE and the KV it writes), and attends to the whole
cached prefix and to its ancestors and itself only (the tree mask). Siblings carry distinct tokens,
so at most one child of a node can equal the target's choice there.

After verification the accepted path's rows [0, a1 .. ak] are moved so that their KV lies at
consecutive positions prefix .. prefix + k (moves_for_path): row ai's K/V is copied to row i's slot.
Since ai >= i (a path of depth i has i ancestors, all at lower rows), copying in path order never
overwrites a source still to be read, and the rows past k are then freed as in a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """Drafts of one request shaped as a tree: tokens[i] is row i + 1, its parent row parents[i]
    (0 = the request's last token)."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(len(tokens))))

    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))

    def row_parents(self) -> list[int]:
        """Parent row of every verify row, the root included (-1)."""
        return [-1, *self.parents]


def as_tree(drafts: list[int] | DraftTree) -> DraftTree:
    return drafts if isinstance(drafts, DraftTree) else DraftTree.chain(drafts)


def depths(parents: list[int]) -> list[int]:
    """Depth of every row (root 0) from row parents."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] is True when row j is row i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i, : p + 1] = mask[p, : p + 1]
        mask[i, i] = True
    return mask


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for j, p in enumerate(parents):
        if p >= 0:
            kids[p].append(j)
    return kids


def greedy_path(tokens: list[int], parents: list[int], targets: list[int]) -> list[int]:
    """Rows of the longest path from the root whose every token equals the target's choice at its
    parent (targets[j]: the target's argmax after row j). Returns the accepted rows, root excluded."""
    kids = children_of(parents)
    path: list[int] = []
    cur = 0
    while True:
        nxt = next((c for c in kids[cur] if tokens[c] == targets[cur]), None)
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


def moves_for_path(path: list[int]) -> list[tuple[int, int]]:
    """(source row, destination row) copies that put the accepted rows at rows 1 .. k."""
    return [(row, i) for i, row in enumerate(path, start=1) if row != i]


def tree_positions(prefix_lens: list[int], row_parents: list[list[int]]) -> torch.Tensor:
    """[num_tokens] position of every verify row: prefix + depth."""
    out: list[int] = []
    for prefix, parents in zip(prefix_lens, row_parents):
        out.extend(prefix + d for d in depths(parents))
    return torch.tensor(out, dtype=torch.int64)


def flat_tree_mask(row_parents: list[list[int]]) -> torch.Tensor:
    """The tree masks of a batch, each [e_b, e_b] flattened row-major and concatenated:
    [sum e_b^2] uint8, what the compiled extend kernel and the torch-native backend read."""
    parts = [ancestor_mask(p).reshape(-1) for p in row_parents]
    return torch.cat(parts).to(torch.uint8) if parts else torch.zeros(0, dtype=torch.uint8)

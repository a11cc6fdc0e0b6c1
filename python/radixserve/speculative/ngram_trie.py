"""A trie of the n-grams of one token sequence, for NGRAM drafting (prompt-lookup decoding).

Every n-gram of up to `branch_length` tokens of the sequence is a path from the root; each node
counts how often its n-gram occurred and remembers when it last did. Drafting looks up the longest
suffix of the context (max_window down to min_window tokens) that occurred before *and was followed
by something*, then follows the most frequent continuation (ties: the most recent one).

draft_tree builds SGLang's BFS tree instead: every matching suffix (longest first) contributes the
breadth-first expansion of its continuations, most recent first, `breadth` children per node, where
breadth starts wider for shorter (less certain) matches and narrows by one step per level.

Appending a token costs O(branch_length): the trie keeps the nodes of the suffixes that end at the
newest token ("open" nodes) and extends each by the new token.
"""

from __future__ import annotations

from collections import deque

from radixserve.speculative.tree import DraftTree


class _Node:
    __slots__ = ("children", "count", "last")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.last = -1  # position (in the sequence) of the latest occurrence's last token


class NgramTrie:
    def __init__(self, branch_length: int, capacity: int) -> None:
        self.branch_length = branch_length
        self.capacity = capacity  # most nodes; past it nothing new is stored (lookups still work)
        self.root = _Node()
        self.num_nodes = 0
        self.length = 0  # tokens appended so far
        self._open: list[_Node] = []  # nodes of the suffixes (1 .. branch_length-1 tokens) ending now

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self._append(tok)

    def _append(self, tok: int) -> None:
        pos = self.length
        self.length += 1
        nxt: list[_Node] = []
        for node in [self.root, *self._open]:
            child = node.children.get(tok)
            if child is None:
                if self.num_nodes >= self.capacity:
                    continue
                child = node.children[tok] = _Node()
                self.num_nodes += 1
            child.count += 1
            child.last = pos
            nxt.append(child)
        # A suffix of branch_length tokens cannot grow further: stored n-grams stop at that depth.
        self._open = nxt[: self.branch_length - 1]

    def _walk(self, key: list[int]) -> _Node | None:
        node = self.root
        for tok in key:
            node = node.children.get(tok)
            if node is None:
                return None
        return node

    def _match(self, context: list[int], min_window: int, max_window: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (max_window .. min_window tokens) that has a
        continuation, and that suffix's length; (None, 0) when none has."""
        for w in range(min(max_window, len(context)), min_window - 1, -1):
            node = self._walk(context[-w:])
            if node is not None and node.children:
                return node, w
        return None, 0

    def draft_chain(
        self, context: list[int], num_tokens: int, min_window: int, max_window: int
    ) -> tuple[list[int], int]:
        """Up to `num_tokens` tokens likely to follow `context` (the sequence this trie indexes, or a
        continuation of it), and the length of the context suffix the first was matched on (0: no
        draft): the longer, the likelier the drafts are right (ngram_drafter.MatchAcceptance). A
        chain that reaches the trie's depth is continued by matching again on the context extended
        with what was drafted."""
        out: list[int] = []
        window = 0
        while len(out) < num_tokens:
            node, w = self._match(context + out if out else context, min_window, max_window)
            if node is None:
                break
            window = window or w
            start = len(out)
            while node.children and len(out) < num_tokens:
                tok, node = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
                out.append(tok)
            if len(out) == start:
                break
        return out, window if out else 0

    def draft_tree(
        self,
        context: list[int],
        num_tokens: int,
        min_window: int,
        max_window: int,
        min_breadth: int,
        max_breadth: int,
    ) -> DraftTree:
        """Up to `num_tokens` drafts as a tree (SGLang's BFS match): for each suffix of `context`
        that occurred before (max_window .. min_window tokens), continuations are added breadth
        first into one tree (a token already under the same parent is shared). A node expands its
        `breadth` most recent continuations; a w-token match starts at breadth
        (max_window - w) * scale + min_breadth with scale = (max_breadth - min_breadth) /
        (max_window - min_window + 1), and each level down has `scale` less (at least 1)."""
        scale = (max_breadth - min_breadth) / (max_window - min_window + 1)
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent row, token) -> row
        for w in range(min(max_window, len(context)), min_window - 1, -1):
            if len(tokens) >= num_tokens:
                break
            node = self._walk(context[-w:])
            if node is None or not node.children:
                continue
            queue = deque([(0, (max_window - w) * scale + min_breadth, node)])
            while queue and len(tokens) < num_tokens:
                parent, breadth, trie_node = queue.popleft()
                recent = sorted(trie_node.children.items(), key=lambda kv: -kv[1].last)
                for tok, child in recent[: max(1, int(breadth))]:
                    row = index.get((parent, tok))
                    if row is None:
                        if len(tokens) >= num_tokens:
                            break
                        tokens.append(tok)
                        parents.append(parent)
                        row = index[(parent, tok)] = len(tokens)
                    queue.append((row, breadth - scale, child))
        return DraftTree(tokens, parents)

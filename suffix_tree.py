"""Ukkonen's generalized suffix tree over byte strings, a cursor to walk it, and the tokens that extend a quote.

    tree = SuffixTree([b"first context", b"second"])
    cur = tree.root().step(b"con")        # None once the bytes leave every context
    cur.occurrences()                     # [(0, 6)]: (context index, byte offset)
    allowed_tokens(cur, TokenTrie(tok.token_bytes))   # ids t with b"con" + bytes(t) in a context

The contexts are joined into one text, each followed by its own sentinel symbol (256, 257, ...), so
that the tree is built in one pass and no match can run from one context into the next.
"""
from __future__ import annotations

from bisect import bisect_right

import torch

LEAF = -1  # end of every leaf edge: the shared global end, so extending all leaves costs nothing


class SuffixTree:
    def __init__(self, contexts: list[bytes]):
        self.contexts = [bytes(c) for c in contexts]
        text: list[int] = []
        self.context_starts = []
        for i, c in enumerate(self.contexts):
            self.context_starts.append(len(text))
            text.extend(c)
            text.append(256 + i)  # a sentinel no byte equals and no other context shares
        self.text = text
        # one entry per node; node 0 is the root
        self.start: list[int] = [0]
        self.end: list[int] = [0]
        self.link: list[int] = [0]  # suffix links of internal nodes
        self.children: list[dict | None] = [{}]  # first symbol of the edge -> child; None for leaves
        self.suffix: list[int] = [-1]  # for a leaf, where its suffix starts in text
        self.steps = 0  # elementary steps of the construction, to check that it is linear
        self.global_end = 0
        self._root_allowed: dict = {}
        self._build()

    def _new_node(self, start: int, end: int, leaf_suffix: int = -1) -> int:
        self.start.append(start)
        self.end.append(end)
        self.link.append(0)
        self.children.append(None if end == LEAF else {})
        self.suffix.append(leaf_suffix)
        return len(self.start) - 1

    def edge_length(self, node: int) -> int:
        return (self.global_end if self.end[node] == LEAF else self.end[node]) - self.start[node]

    def _build(self) -> None:
        text, children, start = self.text, self.children, self.start
        active_node, active_edge, active_length = 0, 0, 0  # where the longest unfinished suffix ends
        remainder = 0  # suffixes still to be inserted explicitly
        for i, symbol in enumerate(text):
            self.global_end = i + 1  # every leaf grows by one symbol (rule 1), all at once
            remainder += 1
            last_internal = 0  # the node created last in this phase, waiting for its suffix link
            while remainder > 0:
                self.steps += 1
                if active_length == 0:
                    active_edge = i
                child = children[active_node].get(text[active_edge])
                if child is None:
                    # rule 2: no edge starts with the symbol: hang a new leaf from the active node
                    children[active_node][text[active_edge]] = self._new_node(i, LEAF, i - remainder + 1)
                    if last_internal:
                        self.link[last_internal] = active_node
                        last_internal = 0
                else:
                    length = self.edge_length(child)
                    if active_length >= length:
                        # skip/count: the active point lies below this edge, walk down it whole
                        active_node, active_edge, active_length = child, active_edge + length, active_length - length
                        continue
                    if text[start[child] + active_length] == symbol:
                        # rule 3: the suffix is already in the tree; stop this phase (the showstopper)
                        if last_internal and active_node:
                            self.link[last_internal] = active_node
                        active_length += 1
                        break
                    # rule 2 inside an edge: split it and hang the new leaf from the split node
                    split = self._new_node(start[child], start[child] + active_length)
                    children[active_node][text[active_edge]] = split
                    children[split][symbol] = self._new_node(i, LEAF, i - remainder + 1)
                    start[child] += active_length
                    children[split][text[start[child]]] = child
                    if last_internal:
                        self.link[last_internal] = split
                    last_internal = split
                remainder -= 1
                if active_node == 0 and active_length > 0:
                    # from the root, the next shorter suffix starts one symbol later
                    active_length -= 1
                    active_edge = i - remainder + 1
                else:
                    # elsewhere, the suffix link leads to the same place for the next shorter suffix
                    active_node = self.link[active_node]

    def root(self) -> "Cursor":
        return Cursor(self, 0, 0, 0, 0)

    def contains(self, data: bytes) -> bool:
        return self.root().step(data) is not None

    def locate(self, text_pos: int) -> tuple[int, int]:
        """(context index, offset) of a position in the joined text."""
        i = bisect_right(self.context_starts, text_pos) - 1
        return i, text_pos - self.context_starts[i]


class Cursor:
    """A point in the tree: `offset` symbols down the edge into `child` below `node` (offset 0: at node)."""

    __slots__ = ("tree", "node", "child", "offset", "depth")

    def __init__(self, tree: SuffixTree, node: int, child: int, offset: int, depth: int):
        self.tree, self.node, self.child, self.offset, self.depth = tree, node, child, offset, depth

    def step(self, data: bytes) -> "Cursor | None":
        """The cursor after `data`, or None if the matched text plus `data` occurs in no context."""
        t = self.tree
        text, children, start = t.text, t.children, t.start
        node, child, offset = self.node, self.child, self.offset
        for b in data:
            if offset == 0:
                child = children[node].get(b) if children[node] is not None else None
                if child is None:
                    return None
            elif text[start[child] + offset] != b:
                return None
            offset += 1
            if offset == t.edge_length(child):
                node, offset = child, 0
        return Cursor(t, node, child, offset, self.depth + len(data))

    def first_occurrence(self) -> tuple[int, int]:
        """One (context index, byte offset) of the matched text, found by walking down to any leaf."""
        t = self.tree
        n = self.child if self.offset else self.node
        while t.children[n] is not None:
            n = next(iter(t.children[n].values()))
        return t.locate(t.suffix[n])

    def occurrences(self) -> list[tuple[int, int]]:
        """Every (context index, byte offset) where the matched text occurs, sorted."""
        t = self.tree
        top = self.child if self.offset else self.node
        found, stack = [], [top]
        while stack:
            n = stack.pop()
            if t.children[n] is None:
                if t.suffix[n] >= 0:
                    found.append(t.locate(t.suffix[n]))
            else:
                stack.extend(t.children[n].values())
        return sorted(found)


class TokenTrie:
    """A byte trie of a vocabulary: node 0 is the empty prefix; ids[node] are the tokens spelled by it."""

    def __init__(self, token_bytes: list[bytes], token_ids=None):
        self.children: list[dict[int, int]] = [{}]
        self.ids: list[list[int]] = [[]]
        for i in range(len(token_bytes)) if token_ids is None else token_ids:
            node = 0
            for b in token_bytes[i]:
                nxt = self.children[node].get(b)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][b] = nxt
                    self.children.append({})
                    self.ids.append([])
                node = nxt
            if node:
                self.ids[node].append(i)


def allowed_tokens(cursor: Cursor, trie: TokenTrie) -> torch.Tensor:
    """Ids of every token t of the trie such that matched text + bytes(t) occurs in the tree, as a LongTensor.

    Walks the trie and the tree together, so the cost follows the token prefixes that match, not the
    vocabulary. The answer at the root (the first token of a quote) is computed once per tree and trie.
    """
    t = cursor.tree
    if cursor.depth == 0:
        if id(trie) not in t._root_allowed:
            t._root_allowed[id(trie)] = (trie, _walk(cursor, trie))
        return t._root_allowed[id(trie)][1]
    return _walk(cursor, trie)


def _walk(cursor: Cursor, trie: TokenTrie) -> torch.Tensor:
    t = cursor.tree
    text, children, start, end, global_end = t.text, t.children, t.start, t.end, t.global_end
    trie_children, trie_ids = trie.children, trie.ids
    out: list[int] = []
    stack = [(0, cursor.node, cursor.child, cursor.offset)]  # (trie node, tree node, edge child, offset)
    while stack:
        tn, node, child, offset = stack.pop()
        if offset:  # inside an edge only one symbol can follow
            b = text[start[child] + offset]
            nxt = trie_children[tn].get(b)
            steps = () if nxt is None else ((b, nxt),)
        else:  # at a node: follow whichever of the two fan-outs is smaller
            tc, kids = trie_children[tn], children[node]
            if kids is None:
                continue
            if len(tc) <= len(kids):
                steps = [(b, n) for b, n in tc.items() if b in kids]
            else:
                steps = [(b, tc[b]) for b in kids if b in tc]
        for b, tn2 in steps:
            if offset:
                c, o = child, offset + 1
            else:
                c, o = children[node][b], 1
            length = (global_end if end[c] == LEAF else end[c]) - start[c]
            n2 = node
            if o == length:
                n2, o = c, 0
            out.extend(trie_ids[tn2])
            if trie_children[tn2]:
                stack.append((tn2, n2, c, o))
    return torch.tensor(out, dtype=torch.long)

"""Suffix decoding (Oliaro et al., Arctic Inference): draft the most frequent continuation in suffix tries."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cupyspec.spec_decode.proposers.base import NO_DRAFTS, DraftRequest, Drafts, Proposer, unseen_tokens


class _Node:
    """One token of a trie path. `count` is how many suffixes pass through or end here.

    An explicit node keeps `children`. A lazy node (`children is None`) stands for a chain that only
    one suffix follows: after this token it continues with `seq[pos:]`, within the depth bound.
    """

    __slots__ = ("token", "depth", "count", "children", "best", "seq", "pos")

    def __init__(self, token: int, depth: int, seq: list[int] | None = None, pos: int = 0) -> None:
        self.token = token
        self.depth = depth
        self.count = 1
        self.children: dict[int, _Node] | None = {} if seq is None else None
        self.best: _Node | None = None  # cached most frequent child; None: not known
        self.seq = seq
        self.pos = pos


Position = tuple[_Node, int]  # a matched path: its deepest materialized node, tokens matched into that node's chain


class SuffixTree:
    """All substrings of up to `max_depth` tokens of some token lists, with occurrence counts.

    Lists are added token by token (`extend`) and removed whole (`remove`); a node whose count drops
    to zero is detached and its subtree zeroed, so positions kept elsewhere can tell they are stale.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1, 0)
        self.root.count = 0
        self.version = 0  # changes with every update

    def extend(self, seq: list[int], active: list[_Node], tokens: Sequence[int]) -> list[_Node]:
        """Append `tokens` to `seq` and to the tree; returns the new `active`.

        `active[i]` is the explicit node where `seq`'s suffix of length i + 1 ends; longer suffixes
        occur only once and grow for free in their own lazy chains.
        """
        root, max_depth = self.root, self.max_depth
        for x in tokens:
            seq.append(x)
            root.count += 1
            grown: list[_Node] = []
            for node in (root, *active):
                child = node.children.get(x)
                if child is None:  # this suffix and all longer ones are new: each starts a lazy chain
                    child = node.children[x] = _Node(x, node.depth + 1, seq, len(seq))
                else:
                    if child.children is None:
                        self._split(child)
                    child.count += 1
                    if child.depth < max_depth:
                        grown.append(child)
                best = node.best  # keep it the top-ranked child, when known
                if best is not None and (child.count > best.count or child.count == best.count and x < best.token):
                    node.best = child
            active = grown
        self.version += 1
        return active

    def remove(self, seq: list[int]) -> None:
        """Take out every suffix of `seq` (added earlier with `extend`)."""
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for x in seq[start : start + self.max_depth]:
                child = node.children[x]
                child.count -= 1
                if node.best is child:
                    node.best = None
                if child.count == 0:
                    del node.children[x]
                    _retire(child)
                    break
                node = child
        self.version += 1

    def advance(self, node: _Node, k: int, token: int) -> Position | None:
        """The position one token further down, or None if that path does not occur."""
        if node.children is None:
            ok = k < self._chain_len(node) and node.seq[node.pos + k] == token
            return (node, k + 1) if ok else None
        child = node.children.get(token)
        return None if child is None else (child, 0)

    def walk(self, tokens: Sequence[int]) -> Position | None:
        """The position of `tokens` read from the root, or None if they do not occur."""
        pos: Position | None = (self.root, 0)
        for x in tokens:
            pos = self.advance(*pos, x)
            if pos is None:
                return None
        return pos

    def draft(self, node: _Node, k: int, cap: int, min_prob: float, own: int) -> tuple[list[int], float]:
        """Greedy path below a position along the most frequent children.

        Each token's probability is the product of child count / parent count along the path; the
        path stops at `cap` tokens or before a token below `min_prob`. `own` occurrences that end at
        the start (the context itself, in its own tree) are left out of the first share. Returns the
        tokens and their summed probabilities (the score).
        """
        tokens: list[int] = []
        prob, score, total = 1.0, 0.0, node.count - own
        while len(tokens) < cap:
            if node.children is None:
                n = max(0, min(self._chain_len(node) - k, cap - len(tokens)))  # a chain's shares are all 1
                tokens += node.seq[node.pos + k : node.pos + k + n]
                return tokens, score + n * prob
            best = node.best or _most_frequent(node)
            if best is None:
                break
            prob *= best.count / total
            if prob < min_prob:
                break
            tokens.append(best.token)
            score += prob
            node, k, total = best, 0, best.count
        return tokens, score

    def _chain_len(self, node: _Node) -> int:
        return min(len(node.seq) - node.pos, self.max_depth - node.depth)

    def _split(self, node: _Node) -> None:
        """Make a lazy node explicit: its chain's next token becomes its only child."""
        seq, pos = node.seq, node.pos
        node.children, node.seq = {}, None
        if node.depth < self.max_depth and pos < len(seq):
            child = _Node(seq[pos], node.depth + 1, seq, pos + 1)
            node.children[child.token] = node.best = child


def _most_frequent(node: _Node) -> _Node | None:
    """The child with the highest count, the smallest token among equals (cached in `best`)."""
    if node.children:
        node.best = max(node.children.values(), key=lambda c: (c.count, -c.token))
    return node.best


def _retire(node: _Node) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        n.count = 0
        if n.children:
            stack.extend(n.children.values())


class _SeqState:
    """A running sequence: its own tree, and where its tail matches in the global tree."""

    __slots__ = ("seq", "tree", "active", "matches", "matched", "version")

    def __init__(self, max_depth: int) -> None:
        self.seq: list[int] = []
        self.tree = SuffixTree(max_depth)
        self.active: list[_Node] = []
        self.matches: list[Position] = []  # global positions of the tail of seq[:matched], lengths 1, 2, ...
        self.matched = 0
        self.version = -1  # global tree version the matches belong to


INSERT_CHUNK = 8  # tokens of a finished output added to the global trie between time checks


@dataclass(eq=False)
class _Insertion:
    """A finished output on its way into the global trie."""

    request_id: str
    output: list[int]
    stored: list[int] | None = None  # the part inserted so far (None: not started)
    active: list[_Node] = field(default_factory=list)


class SuffixProposer(Proposer):
    """Suffix decoding over a per-sequence tree of prompt + output and a global tree of past outputs.

    Each running sequence (keyed by seq_id; its token_ids must only grow between calls, else it is
    rebuilt) has a trie of all its substrings up to `max_tree_depth` tokens, updated with the tokens
    that arrived since the last call. Finished sequences' outputs go into one global trie, grouped by
    request; past `max_cached_requests` requests (-1: unbounded, 0: no global trie) the oldest
    request's outputs are removed. For every length L of the context's tail that occurs in a trie,
    the draft follows the most frequent children for up to min(max_drafts, L * max_spec_factor,
    max_tree_depth - L) tokens while the path probability (product of child count / parent count) stays at or above
    `min_token_prob`; the draft with the highest summed probability wins (the longer match, then the
    sequence's own trie, on ties), as in Arctic Inference. Unlike there, the context's own last
    occurrence is not counted in the first share, so a pattern seen once before continues with
    probability 1.

    Finished outputs enter the global trie in `catch_up`, a chunk at a time, when the engine has
    time to spare (under a load that keeps the host busy, the oldest ones waiting past
    `max_cached_requests` are dropped).

    The tries are Python objects, so their memory grows with the tokens they hold (running contexts
    and cached outputs; repetitive text costs more), which bounds a sensible `max_cached_requests`.
    """

    method = "suffix"
    tracks_sequences = True

    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = -1, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        if not isinstance(max_tree_depth, int) or max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be a positive integer, got {max_tree_depth!r}")
        if not isinstance(max_cached_requests, int) or max_cached_requests < -1:
            raise ValueError(f"max_cached_requests must be an integer >= -1, got {max_cached_requests!r}")
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be positive, got {max_spec_factor!r}")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob must lie in [0, 1], got {min_token_prob!r}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self._global = SuffixTree(max_tree_depth)
        self._cached: OrderedDict[str, list[list[int]]] = OrderedDict()  # request_id -> its outputs in the tree
        self._waiting: deque[_Insertion] = deque()  # finished outputs not (wholly) in the tree yet
        self._states: dict[int, _SeqState] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        out: list[Drafts] = []
        for r in requests:
            st = self._state(r)
            tokens = self._speculate(st, r.max_drafts) if r.max_drafts else []
            out.append(Drafts(np.array(tokens, dtype=np.int32)) if tokens else NO_DRAFTS)
        return out

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        self._states.pop(seq_id, None)
        output = np.asarray(token_ids)[num_prompt_tokens:].tolist()
        if self.max_cached_requests == 0 or not output:
            return
        self._waiting.append(_Insertion(request_id, output))
        if 0 < self.max_cached_requests < len(self._waiting):
            self._waiting.popleft()  # it would be evicted before long (if begun, its part stays cached)

    def catch_up(self, seconds: float | None = None) -> bool:
        """Move finished outputs into the global trie, INSERT_CHUNK tokens at a time."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        while self._waiting:
            item = self._waiting[0]
            if item.stored is None:
                item.stored = []
                self._cached.setdefault(item.request_id, []).append(item.stored)
                while 0 < self.max_cached_requests < len(self._cached):
                    for old in self._cached.popitem(last=False)[1]:
                        self._global.remove(old)
            if item.request_id not in self._cached:  # evicted along with its request's older outputs
                self._waiting.popleft()
                continue
            chunk = item.output[len(item.stored) : len(item.stored) + INSERT_CHUNK]
            item.active = self._global.extend(item.stored, item.active, chunk)
            if len(item.stored) == len(item.output):
                self._waiting.popleft()
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return bool(self._waiting)

    def _state(self, r: DraftRequest) -> _SeqState:
        st = self._states.get(r.seq_id) or _SeqState(self.max_tree_depth)
        new = unseen_tokens(st.seq, r.token_ids)
        if new is None:
            st, new = _SeqState(self.max_tree_depth), r.token_ids.tolist()
        self._states[r.seq_id] = st
        if new:
            st.active = st.tree.extend(st.seq, st.active, new)
        return st

    def _speculate(self, st: _SeqState, max_drafts: int) -> list[int]:
        best: list[int] = []
        best_score = 0.0
        local = [(node, 0) for node in st.active]
        for tree, positions, own in ((st.tree, local, 1), (self._global, self._global_matches(st), 0)):
            for length in range(len(positions), 0, -1):
                cap = min(max_drafts, int(length * self.max_spec_factor + 1e-6))
                if cap == 0 or best_score >= cap:  # no shorter match can score higher
                    break
                tokens, score = tree.draft(*positions[length - 1], cap, self.min_token_prob, own)
                if score > best_score + 1e-9:  # ties (up to rounding) keep the earlier candidate
                    best, best_score = tokens, score
        return best

    def _global_matches(self, st: _SeqState) -> list[Position]:
        """Global positions of the sequence's tail, lengths 1, 2, ... (only those below the depth bound)."""
        if self.max_cached_requests == 0:
            return []
        tree, seq = self._global, st.seq
        if len(seq) - st.matched >= self.max_tree_depth:  # far behind: match the tail afresh
            st.matches, st.matched, st.version = [], len(seq), -1
        if st.version != tree.version:
            st.matches = self._revalidate(st.matches, seq, st.matched)
            st.version = tree.version
        matches = st.matches
        for x in seq[st.matched :]:
            grown: list[Position] = []
            for pos in ((tree.root, 0), *matches):
                nxt = tree.advance(*pos, x)
                if nxt is None or nxt[0].depth + nxt[1] >= self.max_tree_depth:
                    break  # a longer tail cannot match where a shorter one does not
                grown.append(nxt)
            matches = grown
        st.matches, st.matched = matches, len(seq)
        return matches

    def _revalidate(self, matches: list[Position], seq: list[int], n: int) -> list[Position]:
        """Bring positions of the tail of seq[:n] up to date after the global tree changed."""
        tree, out = self._global, []
        for length, (node, k) in enumerate(matches, 1):
            pos: Position | None = (node, k)
            if node.count == 0:  # removed: this tail and longer ones no longer occur
                break
            if k and node.children is not None:  # the lazy chain was split: descend through new nodes
                start = n - length + node.depth
                pos = (node, 0)
                for x in seq[start : start + k]:
                    pos = tree.advance(*pos, x) if pos else None
            if pos is None:
                break
            out.append(pos)
        while len(out) + 1 < min(self.max_tree_depth, n + 1):  # added outputs may match longer tails
            pos = tree.walk(seq[n - len(out) - 1 : n])
            if pos is None:
                break
            out.append(pos)
        return out

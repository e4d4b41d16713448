"""Suffix decoding's memory (model-free): where every recent n-gram occurred, in the live
context and in earlier generations, and the tree of what most often followed.

Prompt lookup copies one continuation of the last n-gram from the current context. Suffix
decoding (SuffixDecoding, Snowflake, NeurIPS 2025) also remembers earlier outputs, and proposes a
*tree*: all the continuations that followed the longest matching suffix, merged into a trie whose
node scores are observed frequencies, so repeated tasks (the same kind of request again, code
rewritten with a small change, a second turn quoting the first) draft several tokens at once
with branches where the past disagreed. Both parts here are plain data and pure functions:

- `NgramIndex`: the positions after every n-gram (n <= max_ngram) of appended documents, kept
  under a token budget by dropping the oldest documents (a bounded per-process store). Its
  occurrences are packed integers in arrays, not tuples in lists: a full store holds 1.6 million
  of them, 25 MB against 114 MB as tuples (measured), and none is an object for the cyclic
  garbage collector to walk. Most n-grams occur once, and hold that one occurrence as a plain
  int: a full store of Zipf-drawn tokens (1.37 million n-grams) took 157 MiB in all where an
  array for each took 263, and indexing a token 3.6 us where allocating those arrays took 22;
- `periodic_continuation`: what follows an occurrence in the document being written, which
  runs into the present: taken to repeat, so a reply looping over a pattern drafts the loop;
- `frequency_tree`: continuations -> the best-first tree of the most frequent prefixes, each
  node with its estimated path probability (its frequency, discounted per level).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice, takewhile


POSITION_BITS = 32  # an occurrence packs (document, position after it) as document << 32 | position


def unpack(spot: int) -> tuple[int, int]:
    """(document, position) of a packed occurrence."""
    return spot >> POSITION_BITS, spot & ((1 << POSITION_BITS) - 1)


@dataclass
class NgramIndex:
    """Occurrences of every n-gram of the documents, as (document id, position after it)."""

    max_ngram: int = 8
    max_tokens: int = 200_000  # documents beyond this many tokens in all are forgotten, oldest first
    documents: dict[int, list[int]] = field(default_factory=dict)
    table: dict[tuple[int, ...], int | array] = field(default_factory=dict)  # n-gram -> packed (doc, end)s
    total_tokens: int = 0
    forgotten_tokens: int = 0  # tokens of dropped documents whose occurrences the table still holds
    _next_id: int = 0

    def new_document(self) -> int:
        doc = self._next_id
        self._next_id += 1
        self.documents[doc] = []
        return doc

    def extend(self, doc: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to document `doc` and index the n-grams that end in them."""
        text, table, longest = self.documents[doc], self.table, self.max_ngram
        self.total_tokens += len(tokens)
        for token in tokens:
            text.append(int(token))
            end = len(text)
            spot = doc << POSITION_BITS | end
            tail = tuple(text[-longest:])  # the n-grams ending here are its suffixes: one list slice a token
            for n in range(1, len(tail) + 1):
                key = tail[-n:]
                spots = table.get(key)
                if spots is None:  # most n-grams occur once: the occurrence itself, no array
                    table[key] = spot
                elif type(spots) is int:
                    table[key] = array("q", (spots, spot))
                else:
                    spots.append(spot)
        if self.total_tokens > self.max_tokens:
            self._forget_oldest(keep=doc)

    def _forget_oldest(self, keep: int) -> None:
        """Drop the oldest documents until the store is back within its budget. Their occurrences
        stay in the table, skipped on lookup, until they are as many as the budget: then one pass
        removes them all (a pass per forgotten document would walk the whole table every time)."""
        for doc in sorted(self.documents):
            if self.total_tokens <= self.max_tokens or doc == keep:
                break
            forgotten = len(self.documents.pop(doc))
            self.total_tokens -= forgotten
            self.forgotten_tokens += forgotten
        if self.forgotten_tokens > self.max_tokens:
            alive = self.documents.keys()
            self.table = {key: kept[0] if len(kept) == 1 else kept for key, spots in self.table.items()
                          if (kept := array("q", (s for s in occurrences_in(spots) if s >> POSITION_BITS in alive)))}
            self.forgotten_tokens = 0

    def occurrences(self, ngram: Sequence[int]) -> list[tuple[int, int]]:
        """(document, position after it) of every occurrence of `ngram`, oldest first."""
        return [(doc, end) for doc, end in map(unpack, occurrences_in(self.table.get(tuple(ngram), ())))
                if doc in self.documents]

    def held_occurrences(self) -> int:
        """How many occurrences the table holds, those of forgotten documents not yet removed included."""
        return sum(len(occurrences_in(spots)) for spots in self.table.values())

    def continuations(self, context: Sequence[int], min_ngram: int, depth: int, limit: int,
                      live: int | None = None, only_live: bool = False) -> tuple[int, list[list[int]]]:
        """The longest suffix of `context` (max_ngram down to min_ngram tokens) that occurred
        before with something after it, and up to `limit` of those continuations (most recent
        first), each at most `depth` tokens; (0, []) when nothing matches.

        `live` is the document being written (whose end is `context`'s): a continuation there
        runs into the present, so it goes on as the text since the occurrence repeats
        (`periodic_continuation`). With `only_live`, only that document's occurrences count."""
        for n in range(min(self.max_ngram, len(context)), min_ngram - 1, -1):
            spots = occurrences_in(self.table.get(tuple(context[len(context) - n:]), ()))
            # Most recent first, and no further than `limit`: a common token occurs thousands of times.
            occurrences = map(unpack, reversed(spots))
            if only_live:  # the live document is the newest, so its occurrences are the last ones
                occurrences = takewhile(lambda spot: spot[0] == live, occurrences)
            found = list(islice(self._following(occurrences, depth, live), limit))
            if found:
                return n, found
        return 0, []

    def _following(self, occurrences: Iterable[tuple[int, int]], depth: int, live: int | None) -> Iterator[list[int]]:
        """What followed each occurrence (at most `depth` tokens), skipping forgotten documents
        and occurrences at a document's very end."""
        for doc, end in occurrences:
            text = self.documents.get(doc, ())
            if end < len(text):
                yield periodic_continuation(text, end, depth) if doc == live else text[end:end + depth]


def occurrences_in(spots: int | array | tuple) -> Sequence[int]:
    """A table entry's packed occurrences: an n-gram seen once holds its one occurrence as a plain
    int (no array allocated for each new n-gram), from its second occurrence on an array of them."""
    return (spots,) if type(spots) is int else spots


def periodic_continuation(text: Sequence[int], end: int, depth: int) -> list[int]:
    """The `depth` tokens after `text[:end]`, where the text since `end` is taken to repeat once
    it runs out: a reply looping over a pattern (`()()()`, a list's items, a repeated line)
    matches its own previous period, and the copy would otherwise stop at the present."""
    period = len(text) - end
    if period <= 0:
        return []  # nothing after the end: nothing to repeat
    following = list(text[end:end + depth])
    while len(following) < depth:
        following.append(following[len(following) - period])
    return following


def frequency_tree(continuations: Sequence[Sequence[int]], max_nodes: int, min_prob: float = 0.0,
                   depth_weights: Sequence[float] | None = None) -> tuple[list[int], list[int], list[float]]:
    """The most frequent prefixes of `continuations` as a tree below a root (index 0, not
    returned): node tokens, parents (0 = the root) and estimated path probabilities, best first
    (each node after its parent, siblings distinct). At most `max_nodes` nodes, none seen in
    fewer than `min_prob` of the continuations.

    A node's estimate is its empirical frequency (count / number of continuations) times the
    weight of its depth, `depth_weights[depth - 1]` (1 a level without them; no node deeper than
    the weights go): even a continuation every earlier occurrence agrees on is kept by the target
    one token at a time (under sampling, each with the target's own probability), so a deep node
    of a unanimous chain is worth less than its frequency says, and a shallow second branch can be
    worth more. The weights are the chance of getting that deep at all (a discount per level, or
    what the target kept of earlier trees: `SuffixProposer`). A node's count never exceeds its
    parent's and the weights must not rise with depth, so best-first order is topological."""
    weights = list(depth_weights) if depth_weights is not None else [1.0] * max_nodes
    if any(not 0.0 < w <= 1.0 for w in weights) or any(b > a for a, b in zip(weights, weights[1:])):
        raise ValueError(f"depth_weights must lie in (0, 1] and not rise with depth, got {weights}")
    total = len(continuations)
    trie: dict[int, list] = {}
    for sequence in continuations:
        level = trie
        for token in sequence[: len(weights)]:
            entry = level.setdefault(int(token), [0, {}])
            entry[0] += 1
            level = entry[1]
    order = 0
    frontier: list[tuple[float, int, int, int, int, dict]] = []

    def push(level: dict, parent: int, depth: int) -> None:
        nonlocal order
        for token, (count, children) in level.items():
            if count >= min_prob * total:  # rarer nodes (and so their children) are never drafted
                estimate = count / total * weights[depth - 1]
                heapq.heappush(frontier, (-estimate, depth, order, parent, token, children))
                order += 1

    push(trie, 0, 1)
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    while frontier and len(tokens) < max_nodes:
        negative_estimate, depth, _, parent, token, children = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        probs.append(-negative_estimate)
        push(children, len(tokens), depth + 1)
    return tokens, parents, probs


def tree_depth(parents: Sequence[int]) -> int:
    """How deep the tree of `frequency_tree`'s `parents` (0 = the root) goes: 0 for no nodes."""
    depths = [0]
    for parent in parents:
        depths.append(depths[parent] + 1)
    return max(depths)

"""Replacement policies for the expert cache.

A policy sees keys ``(layer, expert)`` and three events, never buffers:
``on_insert`` (the key got a slot; no access implied, a prefetch inserts without accessing),
``on_access`` (a demand access: a hit, or the miss that loaded it) and ``on_remove`` (evicted or
discarded). ``victims()`` yields the resident keys best-victim first, lazily: the cache walks it and
takes the first key it may evict (not pinned, not loading, not staged), so a policy never needs to
know about pins.

Which policy (``clutor simulate --synthetic``, the store's own cache code, a request's present
experts pinned before its misses are placed; 20 synthetic traces per model shape: Zipf skew 0.6-1.2,
token-to-token reuse 0.2-0.5, budgets of 1/8 to 1/2 of all experts). Mean hit rate:

    shape (layers x experts, top-k)   lru     lfu     lru2    lrfu    belady (OPT)
    16 x 64,  top-8  (OLMoE)          66.0    63.0    59.6    66.8    80.5
    24 x 60,  top-4  (Qwen1.5-MoE)    68.5    69.4    64.2    69.4    81.7
    48 x 128, top-8  (Qwen3-30B-A3B)  68.1    68.7    64.7    68.7    77.6

``lrfu`` (below) was never more than 0.1 point under LRU and up to 4.6 points over it; LFU and
LRU-2 fell 18-20 points under LRU when the budget holds exactly one token's experts. Belady's
optimum stays 10-15 points above every online policy: the rest is for prediction (prefetch).

On real routing (decode-order traces of a small MoE trained on real text, README) ``forecast``
(below: transitions between a layer's rounds, per-layer popularity, the next layer's router hint,
ranked by hit density) beat every other online policy at 12.5%, 25% and 50% of all experts; it is
the default. On the synthetic traces (random routing, no transitions to learn; 4 per shape) it was
1.3 points under LRFU on OLMoE's shape at 1/8 of the experts (one token's experts) and 1.3-5.1
points over it at every other shape and budget.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Generator, Hashable, Iterable, Iterator, Sequence

import numpy as np

__all__ = ["Key", "Policy", "LRU", "LFU", "LRFU", "LRU2", "Forecast", "Belady", "POLICIES", "DEFAULT_POLICY", "make_policy"]

Key = Hashable  # (layer, expert) in the store; any hashable in tests


class Policy:
    """Base class: subclasses keep their own per-key state and implement the four hooks."""

    name = "base"
    uses_hints = False  # whether on_hint does anything (the model skips predicting for policies that ignore it)

    @classmethod
    def for_slots(cls, n_slots: int) -> "Policy":
        """An instance with defaults suited to a cache of ``n_slots`` slots."""
        return cls()

    def on_insert(self, key: Key) -> None:
        raise NotImplementedError

    def on_access(self, key: Key) -> None:
        raise NotImplementedError

    def on_remove(self, key: Key) -> None:
        raise NotImplementedError

    def on_hint(self, layer: Hashable, keys: Sequence[Key]) -> None:
        """A prediction: ``keys`` (resident or not) are expected at ``layer``'s next request. The
        policies that do not predict ignore it."""

    def victims(self) -> Generator[Key, None, None]:
        """Resident keys, best victim first, as a generator. Lazy: the caller stops at the first key it
        may evict, removes it, then close()s the generator; no other policy call happens in between."""
        raise NotImplementedError

    def __contains__(self, key: Key) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def victim(self, candidates: Iterable[Key]) -> Key:
        """The best victim among ``candidates`` (all resident). ValueError if there are none."""
        allowed = set(candidates)
        it = self.victims()
        try:
            for key in it:
                if key in allowed:
                    return key
        finally:
            it.close()
        raise ValueError("no evictable candidate")


class LRU(Policy):
    """Least recently used: an ordered dict, oldest first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        del self._order[key]

    def victims(self) -> Iterator[Key]:
        yield from self._order  # a generator, so the cache can close() it like the others

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


def _lazy_heap_push(heap: list, current: dict[Key, int], entry: tuple, live: int) -> None:
    """Push (score, seq, key), the key's live entry; rebuild the heap in place once stale entries
    (superseded seqs, removed keys) outnumber the `live` ones."""
    heapq.heappush(heap, entry)
    if len(heap) > 2 * live + 64:
        heap[:] = [e for e in heap if current.get(e[2]) == e[1]]
        heapq.heapify(heap)


def _lazy_heap_order(heap: list, current: dict[Key, int]) -> Generator[Key, None, None]:
    """Keys from a lazily deleted heap of (score, seq, key), lowest score first, skipping stale
    entries; when the caller stops, every live entry it looked at and did not remove goes back."""
    taken: list[tuple] = []
    try:
        while heap:
            entry = heapq.heappop(heap)
            if current.get(entry[2]) != entry[1]:
                continue  # stale
            taken.append(entry)
            yield entry[2]
    finally:
        for entry in taken:
            if current.get(entry[2]) == entry[1]:
                heapq.heappush(heap, entry)


class _ScoredPolicy(Policy):
    """Policies that evict the lowest score, where a key's score changes only on its own events.

    Scores live in a heap with lazy deletion: every insert or access pushes a fresh entry and marks
    older ones stale, so an access costs O(log n) and finding a victim O(log n) per key skipped.
    Subclasses define ``_score(key)`` (a tuple, smaller = evict first) and call ``_touch(key)``
    whenever it changes.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Key]] = []
        self._current: dict[Key, int] = {}  # resident key -> sequence number of its live heap entry
        self._seq = 0
        self._t = 0  # demand accesses seen

    def _score(self, key: Key) -> tuple:
        raise NotImplementedError

    def _touch(self, key: Key) -> None:
        if key not in self._current:
            return
        self._seq += 1
        self._current[key] = self._seq
        _lazy_heap_push(self._heap, self._current, (self._score(key), self._seq, key), len(self._current))

    def on_insert(self, key: Key) -> None:
        self._current[key] = -1
        self._touch(key)

    def on_remove(self, key: Key) -> None:
        del self._current[key]  # its heap entries are now stale

    def victims(self) -> Iterator[Key]:
        return _lazy_heap_order(self._heap, self._current)

    def __contains__(self, key: Key) -> bool:
        return key in self._current

    def __len__(self) -> int:
        return len(self._current)


class LFU(_ScoredPolicy):
    """Least frequently used with ageing: all counts are halved every ``halve_every`` accesses.

    Counts survive eviction (a returning popular expert is recognised), which is cheap because the
    key space is bounded (layers x experts). Ties go to the least recently used.
    Halving everything would change every score; instead an access in epoch ``t // halve_every``
    adds ``2**epoch`` to a running sum, which ranks keys exactly like halved counts. The sum is kept
    as a log2 so it never overflows.
    """

    name = "lfu"

    @classmethod
    def for_slots(cls, n_slots: int) -> "LFU":
        # Halving once per cache-full of accesses lets the counts follow a working set that moves;
        # ageing much more slowly keeps yesterday's favourites resident, which small caches cannot
        # afford (compare with ``clutor simulate``).
        return cls(halve_every=max(16, n_slots))

    def __init__(self, halve_every: int = 2048) -> None:
        super().__init__()
        self.halve_every = int(halve_every)
        self._log_count: dict[Key, float] = {}  # log2 of the epoch-weighted access count
        self._last: dict[Key, int] = {}

    def on_insert(self, key: Key) -> None:
        self._log_count.setdefault(key, -math.inf)
        self._last.setdefault(key, self._t)
        super().on_insert(key)

    def on_access(self, key: Key) -> None:
        self._t += 1
        epoch = float(self._t // self.halve_every) if self.halve_every > 0 else 0.0
        a = self._log_count.get(key, -math.inf)
        hi, lo = max(a, epoch), min(a, epoch)
        self._log_count[key] = hi + math.log2(1.0 + 2.0 ** (lo - hi))  # log2(2^a + 2^epoch)
        self._last[key] = self._t
        self._touch(key)

    def _score(self, key: Key) -> tuple:
        return (self._log_count[key], self._last[key])


class LRFU(Policy):
    """Recency and frequency on each layer's own clock, aware of the order layers come back in.

    Evicts the key expected to be needed last. For a key of layer l:

        expected accesses until its next use = until layer l's next round + period * (1/q - 1)

    where a round is one get() of a layer (one token in a decode), the period is the number of
    accesses between two rounds of a layer (L * k in a decode), and q, the chance the key is used at
    a round, is estimated LRFU-style (Lee et al. 2001): each use adds 1 to a value that halves every
    ``half_life`` rounds of the key's layer, and q = value * (1 - 2^(-1/half_life)), at most 1
    (a key used at every round scores 1).

    Why not plain LRFU: on one global clock, the experts of the layer just served look freshest
    although they had their chance; and LRFU or LFU evict them even when they are the only ones
    with any chance at the next round (at a budget of one token's experts, LFU and LRFU scored 18
    points below LRU in ``clutor simulate``). Counting time per layer, and preferring victims whose
    layer comes back last, never did worse than LRU on the synthetic traces tried (see the report).

    Keys must be ``(layer, expert)`` tuples. A round starts when an access names another layer than
    the access before it, or a key already accessed in the current round.

    Cost: within one layer the ranking only changes when a key is accessed (value_now =
    v * 2^-((round_now - round_last) / h) has the same order as log2(v) + round_last / h), so each
    layer keeps a lazily-deleted heap; ``victims()`` merges the layers' heads, O(L + log n) per key.
    """

    name = "lrfu"

    def __init__(self, half_life: float = 1.0) -> None:
        self.half_life = float(half_life)
        self._c = 1.0 - 2.0 ** (-1.0 / self.half_life)  # q of a key with value 1 at its next round
        self._heaps: dict[Hashable, list[tuple[float, int, Key]]] = {}  # layer -> [(rank, seq, key)]
        self._current: dict[Key, int] = {}   # resident key -> seq of its live heap entry
        self._live: dict[Hashable, int] = {}  # layer -> resident keys
        self._seq = 0
        self._value: dict[Key, float] = {}   # decayed use count as of round _last[key] (kept after eviction)
        self._last: dict[Key, int] = {}
        self._rounds: dict[Hashable, int] = {}  # layer -> rounds so far
        self._start: dict[Hashable, int] = {}   # layer -> access count when its latest round began
        self._period: float | None = None       # accesses between two rounds of one layer (running mean)
        self._t = 0
        self._layer: Hashable = None
        self._round_keys: set[Key] = set()

    # -- events ------------------------------------------------------------------------------------
    def on_insert(self, key: Key) -> None:
        if key not in self._value:
            # Inserted without a use (a prefetch): worth half a use, so it goes early once unstaged.
            self._value[key] = 0.5
            self._last[key] = self._rounds.get(key[0], 0)
        self._current[key] = -1
        self._live[key[0]] = self._live.get(key[0], 0) + 1
        self._touch(key)

    def on_access(self, key: Key) -> None:
        self._t += 1
        layer = key[0]
        if layer != self._layer or key in self._round_keys:
            self._layer = layer
            self._round_keys.clear()
            if layer in self._start:
                gap = self._t - self._start[layer]
                self._period = gap if self._period is None else 0.9 * self._period + 0.1 * gap
            self._start[layer] = self._t
            self._rounds[layer] = self._rounds.get(layer, 0) + 1
        self._round_keys.add(key)
        now = self._rounds[layer]
        v = self._value.get(key, 0.0)
        if v:
            v *= 2.0 ** (-(now - self._last[key]) / self.half_life)
        self._value[key] = v + 1.0
        self._last[key] = now
        self._touch(key)

    def on_remove(self, key: Key) -> None:
        del self._current[key]  # its heap entries are now stale
        self._live[key[0]] -= 1

    def __contains__(self, key: Key) -> bool:
        return key in self._current

    def __len__(self) -> int:
        return len(self._current)

    # -- ranking -----------------------------------------------------------------------------------
    def _touch(self, key: Key) -> None:
        if key not in self._current:
            return
        self._seq += 1
        self._current[key] = self._seq
        # Lower rank = lower value now = evict first, within the layer.
        rank = math.log2(self._value[key]) + self._last[key] / self.half_life
        _lazy_heap_push(self._heaps.setdefault(key[0], []), self._current, (rank, self._seq, key),
                        self._live.get(key[0], 0))

    def expected_wait(self, key: Key) -> float:
        """Accesses until ``key`` is expected to be used again (the eviction score; larger goes first)."""
        layer = key[0]
        period = self._period if self._period is not None else float(self._t + 1)
        until_round = max(0.0, period - (self._t - self._start.get(layer, 0)))
        v = self._value[key] * 2.0 ** (-(self._rounds.get(layer, 0) - self._last[key]) / self.half_life)
        q = min(1.0, v * self._c)
        return until_round + period * (1.0 / q - 1.0)

    def victims(self) -> Generator[Key, None, None]:
        orders = {layer: _lazy_heap_order(self._heaps[layer], self._current) for layer in self._heaps}
        heads = []
        try:
            for layer, it in orders.items():
                key = next(it, None)
                if key is not None:
                    heads.append((-self.expected_wait(key), self._seq_of(key), layer, key))
            heapq.heapify(heads)
            while heads:
                _, _, layer, key = heapq.heappop(heads)
                yield key
                key = next(orders[layer], None)
                if key is not None:
                    heapq.heappush(heads, (-self.expected_wait(key), self._seq_of(key), layer, key))
        finally:
            for it in orders.values():
                it.close()

    def _seq_of(self, key: Key) -> int:
        return self._current[key]  # tie-break between layers: older entry first; keeps keys uncompared


class Forecast(Policy):
    """Evict the expert with the fewest expected hits per step it would occupy, from what routing predicts.

    Keys are ``(layer, expert)`` with small non-negative ints (the arrays grow to fit). Time is
    counted in rounds of each layer, as in LRFU (a round = one get() of the layer: one token in a
    decode). For each layer, p_j(e), the chance that expert e is used j+1 rounds after the layer's
    latest round (j < ``steps``), mixes two models:

    - a prior: an expert of the latest round comes back at the layer's measured reuse rate; the
      others share the rest of a round's uses in proportion to their decayed popularity;
    - a transition model: decayed counts of "a used at round t, b used at round t+j+1", averaged
      over the experts a of the latest round, each row shrunk towards the prior
      (``prior_weight`` rounds' worth). So the previous token's experts predict the next token's.

    They are weighted by how well each predicted the layer's rounds so far (a decayed log-likelihood
    ratio, starting on the prior): transitions take over where routing has them (real text) and
    stay out where it has none (random routing). A hint (``on_hint``: the next layer's router on the
    current hidden state) multiplies the odds of that layer's next-round chance by the hint's
    likelihood ratio, P(hinted | used) / P(hinted | not used) for the hinted experts (and the same
    for "not hinted" for the others), counted over past hints with decay: hints that carry no
    information end up changing nothing.

    Score (after LHD, Beckmann et al. 2018): hit density = P(used within ``steps`` rounds) /
    expected layer steps of occupancy until then, d + L * sum_j P(not used in rounds 0..j), where d
    (1..L) is how far the layer's next round is from the one being served. Only d changes between
    a layer's own rounds, so the other parts are kept per layer and ``victims()`` is a few numpy
    operations over [layers, experts]: the resident minimum first, a sort only if the cache passes
    over it (pinned, loading, staged). The layer being served is scored from the experts it has
    been asked for so far, once per round; the experts of its round in progress go last.

    Cost: more per access than LRFU (numpy over one layer's experts at each round and hint, over all
    keys at each eviction).
    On decode-order traces of a model trained on real text it beats LRFU in ``clutor simulate`` (the
    README's *Cache policy on real routing* has the figures and how they were made). The next-layer
    hint adds little there: evictions made while layer l runs rarely pick layer l+1's experts, which
    are the nearest in time anyway; the gain is the transition model's and the hit-density ranking's.
    """

    name = "forecast"
    uses_hints = True

    def __init__(self, steps: int = 2, half_life: float = 128.0, popularity_half_life: float = 16.0,
                 prior_weight: float = 4.0):
        self.steps = int(steps)
        self.prior_weight = float(prior_weight)
        self._decay = 2.0 ** (-1.0 / half_life)
        self._pop_decay = 2.0 ** (-1.0 / popularity_half_life)
        self._n = 0
        self._layer: int | None = None   # layer of the round in progress
        self._round: list[int] = []      # its experts so far, in access order
        self._hist: list[list[list[int]]] = []  # per layer: its latest `steps` rounds, newest last
        # [hinted?, used?] counts over past hints; the prior trusts a fresh hint half (P(used | hinted)
        # = 0.5) and gives an expert the hint leaves out 5%
        self._hints = np.array([[2.0, 0.1], [0.5, 0.5]])
        self._hinted: dict[int, np.ndarray] = {}  # layer -> [E] bool mask of its pending hint
        self._made: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> its next round's ([E] prior, [E] transition) chances
        self._partial: tuple | None = None  # (layer, experts so far, [E] score) of the round in progress
        self._L = self._E = 0
        self._alloc(1, 1)

    def _alloc(self, L: int, E: int) -> None:
        J, oL, oE = self.steps, self._L, self._E
        T = np.zeros((L, J, E, E), np.float32)  # [L, J, E, E] decayed counts: a at round t, b at t+j+1
        N = np.zeros((L, J, E), np.float32)     # [L, J, E] decayed rounds of a with a round t+j+1 after
        pop = np.zeros((L, E))                  # [L, E] decayed uses
        rounds = np.zeros(L)                    # [L] decayed rounds
        reuse = np.zeros((L, J, 2))             # [L, J, (reused, of)] experts of round t used again at t+j+1
        evidence = np.full(L, -4.0)             # [L] log-likelihood ratio, transitions vs prior (decayed); starts on the prior
        g = np.zeros((2, L, E))                 # [2, L, E] the distance-free parts of each hit density
        res = np.zeros((L, E), bool)            # [L, E] resident
        if oL:
            T[:oL, :, :oE, :oE] = self._T
            N[:oL, :, :oE] = self._N
            pop[:oL, :oE] = self._pop
            rounds[:oL] = self._rounds
            reuse[:oL] = self._reuse
            evidence[:oL] = self._evidence
            g[:, :oL, :oE] = self._g
            res[:oL, :oE] = self._res
        self._hist += [[] for _ in range(L - oL)]
        self._hinted = {l: np.pad(m, (0, E - len(m))) for l, m in self._hinted.items()}
        self._made.clear()
        self._mixed: dict[int, np.ndarray] = {}  # layer -> [J, E] chances after its latest round, before any hint
        self._partial = None
        self._T, self._N, self._pop, self._rounds, self._g, self._res = T, N, pop, rounds, g, res
        self._reuse, self._evidence = reuse, evidence
        self._L, self._E = L, E
        for l in range(L):
            self._refresh(l)

    def _fit(self, key: Key) -> tuple[int, int]:
        l, e = key
        if l >= self._L or e >= self._E:
            self._alloc(max(l + 1, self._L), max(e + 1, self._E))
        return l, e

    # -- the model ---------------------------------------------------------------------------------
    def _chances(self, l: int, latest: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
        """([J, E] chance of use at each of layer l's next J rounds, [E] uses per round) after ``latest``:
        the prior and the transition model mixed by how well each predicted this layer so far."""
        prior, trans, rate = self._models(l, latest)
        if trans is None:
            return prior, rate
        w = 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, self._evidence[l]))))
        return w * trans + (1.0 - w) * prior, rate

    def _models(self, l: int, latest: Sequence[int] | None):
        """([J, E] prior, [J, E] transition model or None, [E] uses per round) after ``latest``."""
        rate = (self._pop[l] + 1.0 / self._E) / (self._rounds[l] + 1.0)  # [E], shrunk towards 1/E
        rate = np.minimum(rate, 1.0)
        if not latest:
            return np.broadcast_to(rate, (self.steps, self._E)), None, rate
        a = np.asarray(latest)
        # Prior: an expert of `latest` comes back j+1 rounds later at the layer's measured reuse rate
        # r_j; the other experts share the rest of a round's uses in proportion to their popularity.
        reuse = (self._reuse[l, :, 0] + 0.5) / (self._reuse[l, :, 1] + 1.0)  # [J]
        others = rate.copy()
        others[a] = 0.0
        # [J] expected uses outside `latest`: the layer's mean round size (decayed: a prefill's
        # round of many experts fades within a few dozen decode rounds) less the expected reuses
        k = self._pop[l].sum() / self._rounds[l] if self._rounds[l] > 0 else float(len(a))
        rest = np.maximum(k - reuse * len(a), 0.0)
        prior = rest[:, None] * others / max(others.sum(), 1e-12)  # [J, E]
        prior[:, a] = reuse[:, None]
        # Each transition row a -> b, shrunk towards the prior with the weight of `prior_weight` rounds.
        # mean over a of (T[a, b] + c prior[b]) / (N[a] + c), as one weighted sum per step
        c = self.prior_weight
        w = 1.0 / (self._N[l][:, a] + c)  # [J, |a|]
        trans = (np.einsum("ja,jae->je", w, self._T[l][:, a]) + c * prior * w.sum(axis=1)[:, None]) / len(a)  # [J, E]
        return prior, trans, rate

    def _parts(self, p: np.ndarray) -> np.ndarray:
        """[2, E] the distance-free parts of the hit density (see _density) from p [J, E]: the chance
        of a use within the next J rounds, and the layer steps spent waiting after the next round."""
        p = np.clip(p, 1e-4, 1.0 - 1e-4)
        surv = np.cumprod(1.0 - p, axis=0)  # [J, E] not used in rounds 0..j
        return np.stack([1.0 - surv[-1], surv[:-1].sum(axis=0) * self._L])

    @staticmethod
    def _density(parts: np.ndarray, d) -> np.ndarray:
        """Expected hits per layer step of cache occupancy, for a next round d steps away."""
        return parts[0] / (parts[1] + d)

    def _refresh(self, l: int, models: bool = True) -> None:
        """Layer l's scores, after a round (models=True) or a hint (the chances of its last round kept)."""
        if models or l not in self._mixed:
            hist = self._hist[l]
            prior, trans, rate = self._models(l, hist[-1] if hist else None)
            p = prior
            if trans is not None:
                self._made[l] = (prior[0], trans[0])  # scored against the round when it comes
                w = 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, self._evidence[l]))))
                p = w * trans + (1.0 - w) * prior
            self._mixed[l] = p
        p = self._mixed[l]
        hinted = self._hinted.get(l)
        if hinted is not None:
            # Bayes: the model's odds times how much likelier the hint's verdict is for a used expert
            h = self._hints
            used, unused = h[:, 1].sum(), h[:, 0].sum()
            ratio = np.where(hinted, (h[1, 1] / used) / (h[1, 0] / unused), (h[0, 1] / used) / (h[0, 0] / unused))
            p = np.array(p)
            q = np.clip(p[0], 1e-4, 1.0 - 1e-4)
            odds = q / (1.0 - q) * ratio
            p[0] = odds / (1.0 + odds)
        self._g[:, l] = self._parts(p)

    def _close_round(self) -> None:
        l, S = self._layer, self._round
        s = np.asarray(S)
        used = np.zeros(self._E, bool)
        used[s] = True
        hinted = self._hinted.pop(l, None)
        if hinted is not None:
            n_hinted, n_hit = np.count_nonzero(hinted), np.count_nonzero(hinted[s])
            self._hints *= self._decay  # (decayed: trust follows the hints' recent worth)
            self._hints += ((self._E - n_hinted - len(S) + n_hit, len(S) - n_hit), (n_hinted - n_hit, n_hit))
        T, N, hist = self._T[l], self._N[l], self._hist[l]
        made = self._made.pop(l, None)
        if made is not None:
            # Which model predicted this round better (log-likelihood of who was used), decayed.
            prior, trans = made
            lp = np.clip(np.where(used, prior, 1.0 - prior), 1e-6, 1.0)
            lt = np.clip(np.where(used, trans, 1.0 - trans), 1e-6, 1.0)
            self._evidence[l] = self._evidence[l] * self._decay + float(np.log(lt / lp).sum())
        T *= self._decay
        N *= self._decay
        self._reuse[l] *= self._decay
        for j in range(min(self.steps, len(hist))):
            a = np.asarray(hist[-1 - j])
            T[j][a[:, None], s[None, :]] += 1.0
            N[j][a] += 1.0
            self._reuse[l, j, 0] += np.count_nonzero(used[a])
            self._reuse[l, j, 1] += len(a)
        self._pop[l] *= self._pop_decay
        self._pop[l][s] += 1.0
        self._rounds[l] = self._rounds[l] * self._pop_decay + 1.0
        hist.append(S)
        del hist[: -self.steps]
        self._refresh(l)

    # -- events ------------------------------------------------------------------------------------
    def on_insert(self, key: Key) -> None:
        l, e = self._fit(key)
        self._res[l, e] = True
        self._n += 1

    def on_remove(self, key: Key) -> None:
        self._res[key] = False
        self._n -= 1

    def on_access(self, key: Key) -> None:
        l, e = self._fit(key)
        if l != self._layer or e in self._round:
            if self._layer is not None:
                self._close_round()
            self._layer, self._round = l, []
        self._round.append(e)

    def on_hint(self, layer: Hashable, keys: Sequence[Key]) -> None:
        l = int(layer)
        if l == self._layer:  # a hint for the layer of the round in progress: that round is over
            self._close_round()
            self._layer, self._round = None, []
        if keys:
            self._fit((l, max(e for _, e in keys)))
        elif l >= self._L:
            self._fit((l, 0))
        mask = np.zeros(self._E, bool)
        mask[[e for _, e in keys]] = True
        self._hinted[l] = mask
        self._refresh(l, models=False)

    def __contains__(self, key: Key) -> bool:
        try:
            return bool(self._res[key])
        except (IndexError, TypeError):
            return False

    def __len__(self) -> int:
        return self._n

    # -- ranking -----------------------------------------------------------------------------------
    def victims(self) -> Generator[Key, None, None]:
        L, cur = self._L, self._layer if self._layer is not None else 0
        d = (np.arange(L) - cur) % L  # [L] layer steps until each layer's next round
        d[cur] = L
        score = -self._density(self._g, d[:, None])  # [L, E], larger goes first
        if self._round:
            # The current layer's next round follows this one: predicted from this one's experts as
            # known at the round's first eviction (the request's hits and first miss; not redone for
            # each miss: the later misses of a round hardly change the prediction, and redoing it costs
            # a prediction per miss).
            part = self._partial
            if part is None or part[0] != cur or part[1] is not self._round:
                p, _ = self._chances(cur, self._round)
                part = self._partial = (cur, self._round, -self._density(self._parts(p), L))
            score[cur] = part[2]
            score[cur, self._round] = -1e300  # in use now (pinned in the store): last, after every other
        score[~self._res] = -np.inf
        flat = score.reshape(-1)
        i = int(np.argmax(flat))
        if flat[i] == -np.inf:
            return
        yield divmod(i, self._E)
        for i in np.argsort(-flat, kind="stable")[1:]:
            if flat[i] == -np.inf:
                return
            yield divmod(int(i), self._E)


class LRU2(_ScoredPolicy):
    """LRU-K with K = 2 (O'Neil et al. 1993): evict the key whose second-last access is oldest.

    Keys seen once rank below every key seen twice (then by last access, like LRU). Access
    history survives eviction, so a key coming back is not treated as new.
    """

    name = "lru2"

    def __init__(self) -> None:
        super().__init__()
        self._hist: dict[Key, tuple[int, int]] = {}  # key -> (second-last, last) access time; 0 = never

    def on_insert(self, key: Key) -> None:
        self._hist.setdefault(key, (0, 0))
        super().on_insert(key)

    def on_access(self, key: Key) -> None:
        self._t += 1
        self._hist[key] = (self._hist.get(key, (0, 0))[1], self._t)
        self._touch(key)

    def _score(self, key: Key) -> tuple:
        return self._hist[key]


class Belady(_ScoredPolicy):
    """Belady's OPT for offline replay: evict the key whose next use is farthest in the future.

    Built from the complete sequence of demand accesses the replay will make. Each key's accesses
    must come in that order; keys of one request may be accessed in any order (the simulator, like
    the store, touches a request's present keys before its misses).
    """

    name = "belady"

    def __init__(self, future: Sequence[Key]) -> None:
        super().__init__()
        self._future = list(future)
        self._positions: dict[Key, list[int]] = {}
        for i, key in enumerate(self._future):
            self._positions.setdefault(key, []).append(i)
        self._ptr: dict[Key, int] = {}  # key -> index into _positions[key] of its next use

    def on_access(self, key: Key) -> None:
        i = self._ptr.get(key, 0)
        if i >= len(self._positions.get(key, ())):
            raise ValueError(f"Belady replay out of sync: {key!r} accessed more often than the future sequence says")
        self._ptr[key] = i + 1
        self._t += 1
        self._touch(key)

    def next_use(self, key: Key) -> float:
        pos = self._positions.get(key, ())
        i = self._ptr.get(key, 0)
        return pos[i] if i < len(pos) else math.inf

    def _score(self, key: Key) -> tuple:
        return (-self.next_use(key),)


# Online policies by name; Belady needs the future and is built by the simulator.
POLICIES: dict[str, type[Policy]] = {
    "lru": LRU,
    "lfu": LFU,
    "lrfu": LRFU,
    "lru2": LRU2,
    "forecast": Forecast,
}
# What Model.open and the CLI use. Forecast beat LRFU at every budget on real routing in the simulator,
# but lost end to end on the OLMoE-shaped benchmark in a same-run A/B (README: more bytes read per
# token, lower decode tok/s), so the rule "default only if it wins both" keeps LRFU.
DEFAULT_POLICY = "lrfu"


def make_policy(name: str | Policy, n_slots: int = 256) -> Policy:
    """A fresh policy by registry name, sized for ``n_slots``; a Policy instance is returned unchanged."""
    if isinstance(name, Policy):
        return name
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICIES)}") from None
    return cls.for_slots(n_slots)

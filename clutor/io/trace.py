"""Routing traces: which experts each token asked for at each layer.

Shared by the model's trace recorder and the cache simulator. JSON Lines, one line per (token, layer)::

    {"clutor_trace": 2, "n_layers": 16, "n_experts": 64, "top_k": 8, "expert_bytes": 6684672}   <- optional header
    {"token": 0, "layer": 0, "experts": [12, 3, 40, 7, 1, 9, 33, 21], "weights": [0.31, ...],   <- weights optional
     "next": [5, 12, 60, 2, 41, 7, 9, 30]}                                                    <- next optional

``next`` (version 2): the experts layer+1's router picks from this step's hidden state, which the
model hands the store as a hint (``hint(layer + 1, next)``) BEFORE this record's get; the simulator
replays it at the same point, so a policy that uses predictions sees in replay what it saw live.
Version 1 files (no ``next``) still read. Records are replayed in file order. When the header is
present, every record is checked against it.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from .._util import open_regular
from ..errors import ClosedError, ClutorError, ModelFileError

__all__ = [
    "TRACE_VERSION",
    "TraceHeader",
    "TraceRecord",
    "Trace",
    "TraceWriter",
    "iter_trace",
    "read_trace",
    "write_trace",
    "check_output",
    "synthetic_trace",
]

TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)

log = logging.getLogger("clutor.trace")


@dataclass(frozen=True, slots=True)
class TraceHeader:
    n_layers: int
    n_experts: int
    top_k: int
    expert_bytes: int | None = None  # bytes of one expert (3 slabs); lets the simulator turn a byte budget into slots

    def to_json(self) -> dict:
        d = {"clutor_trace": TRACE_VERSION, "n_layers": self.n_layers, "n_experts": self.n_experts, "top_k": self.top_k}
        if self.expert_bytes is not None:
            d["expert_bytes"] = self.expert_bytes
        return d


@dataclass(frozen=True, slots=True)
class TraceRecord:
    token: int
    layer: int
    experts: tuple[int, ...]
    weights: tuple[float, ...] | None = None
    next: tuple[int, ...] | None = None  # experts predicted for layer + 1, hinted before this get

    def to_json(self) -> dict:
        d: dict = {"token": self.token, "layer": self.layer, "experts": list(self.experts)}
        if self.weights is not None:
            d["weights"] = [round(float(w), 6) for w in self.weights]
        if self.next is not None:
            d["next"] = list(self.next)
        return d


@dataclass(frozen=True)
class Trace:
    records: tuple[TraceRecord, ...]
    header: TraceHeader | None = None
    path: str | None = None

    def __len__(self) -> int:
        return len(self.records)

    @property
    def n_tokens(self) -> int:
        return len({r.token for r in self.records})

    def accesses(self) -> list[tuple[int, int]]:
        """Every (layer, expert) demand access in replay order (duplicates within a record kept once)."""
        out: list[tuple[int, int]] = []
        for r in self.records:
            out.extend((r.layer, e) for e in dict.fromkeys(r.experts))
        return out


# -- reading -------------------------------------------------------------------------------------
def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_header(path: str, lineno: int, d: dict) -> TraceHeader:
    if d.get("clutor_trace") not in READABLE_VERSIONS:
        raise ModelFileError(path, f"line {lineno}: clutor_trace", f"version {' or '.join(map(str, READABLE_VERSIONS))}",
                             d.get("clutor_trace"))
    fields = {}
    for name in ("n_layers", "n_experts", "top_k"):
        v = d.get(name)
        if not _is_int(v) or v < 1:
            raise ModelFileError(path, f"line {lineno}: {name}", "a positive integer", v)
        fields[name] = v
    eb = d.get("expert_bytes")
    if eb is not None and (not _is_int(eb) or eb < 1):
        raise ModelFileError(path, f"line {lineno}: expert_bytes", "a positive integer", eb)
    if fields["top_k"] > fields["n_experts"]:
        raise ModelFileError(path, f"line {lineno}: top_k", f"<= n_experts ({fields['n_experts']})", fields["top_k"])
    return TraceHeader(expert_bytes=eb, **fields)


def _parse_record(path: str, lineno: int, d: dict, header: TraceHeader | None) -> TraceRecord:
    where = f"line {lineno}"
    token, layer, experts = d.get("token"), d.get("layer"), d.get("experts")
    if not _is_int(token) or token < 0:
        raise ModelFileError(path, f"{where}: token", "an integer >= 0", token)
    n_layers = header.n_layers if header else None
    if not _is_int(layer) or layer < 0 or (n_layers is not None and layer >= n_layers):
        raise ModelFileError(path, f"{where}: layer", f"an integer in [0, {n_layers})" if n_layers else "an integer >= 0", layer)
    n_experts = header.n_experts if header else None
    if (
        not isinstance(experts, list)
        or not experts
        or not all(_is_int(e) and e >= 0 and (n_experts is None or e < n_experts) for e in experts)
    ):
        rng = f"in [0, {n_experts})" if n_experts else ">= 0"
        raise ModelFileError(path, f"{where}: experts", f"a non-empty list of integers {rng}", experts)
    if header is not None and len(experts) != header.top_k:
        raise ModelFileError(path, f"{where}: experts", f"{header.top_k} experts (top_k in the header)", len(experts))
    weights = d.get("weights")
    if weights is not None:
        if (
            not isinstance(weights, list)
            or len(weights) != len(experts)
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
        ):
            raise ModelFileError(path, f"{where}: weights", f"a list of {len(experts)} numbers", weights)
        weights = tuple(float(w) for w in weights)
    nxt = d.get("next")
    if nxt is not None:
        if n_layers is not None and layer + 1 >= n_layers:
            raise ModelFileError(path, f"{where}: next", f"no prediction after the last layer ({n_layers - 1})", nxt)
        if not isinstance(nxt, list) or not all(_is_int(e) and e >= 0 and (n_experts is None or e < n_experts) for e in nxt):
            rng = f"in [0, {n_experts})" if n_experts else ">= 0"
            raise ModelFileError(path, f"{where}: next", f"a list of integers {rng}", nxt)
        nxt = tuple(nxt)
    return TraceRecord(token, layer, tuple(experts), weights, nxt)


_MAX_LINE = 1 << 20  # a record is ~100 bytes per expert; a longer line is not a trace


def _open_text(path: str):
    """The trace file opened for reading lines (bytes), or ModelFileError for a missing, unreadable or
    non-regular path (a FIFO is refused without blocking on it)."""
    return os.fdopen(open_regular(path, "routing trace (JSONL)"), "rb")


def iter_trace(path: str | os.PathLike) -> Iterator[TraceHeader | TraceRecord]:
    """Yield the header (if any) then each record, validating as it goes."""
    path = os.fspath(path)
    header: TraceHeader | None = None
    with _open_text(path) as f:
        first = True
        for lineno, raw in enumerate(f, 1):
            if len(raw) > _MAX_LINE:
                raise ModelFileError(path, f"line {lineno}", f"a line of at most {_MAX_LINE} bytes", len(raw))
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ModelFileError(path, f"line {lineno}", "UTF-8 JSON text (a routing trace)",
                                     f"binary data {raw[:16]!r}") from None
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ModelFileError(path, f"line {lineno}", "one JSON object", f"invalid JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise ModelFileError(path, f"line {lineno}", "one JSON object", type(d).__name__)
            if "clutor_trace" in d:
                if not first:
                    raise ModelFileError(path, f"line {lineno}", "the header only on the first line", "a second header")
                header = _parse_header(path, lineno, d)
                yield header
            else:
                yield _parse_record(path, lineno, d, header)
            first = False


def read_trace(path: str | os.PathLike) -> Trace:
    """Load and validate a trace file; ModelFileError names the file and line of the first problem."""
    header: TraceHeader | None = None
    records: list[TraceRecord] = []
    for item in iter_trace(path):
        if isinstance(item, TraceHeader):
            header = item
        else:
            records.append(item)
    if not records:
        raise ModelFileError(path, "records", "at least one (token, layer) line", "none")
    return Trace(tuple(records), header, os.fspath(path))


# -- writing -------------------------------------------------------------------------------------
class TraceWriter:
    """Streams records to a JSONL file as they happen (the model's recorder uses this)::

        with TraceWriter(path, TraceHeader(16, 64, 8, expert_bytes), protect=model_paths) as w:
            w.write(token, layer, experts, weights, next=predicted)

    Nothing is lost by pointing it at the wrong path: it refuses the files in ``protect`` (the model
    and every part of a split set), any existing file that is not a routing trace, and anything that
    is not a regular file; records go to a temporary file next to ``path`` that replaces ``path``
    only at close(). abort() drops the temporary file and leaves ``path`` as it was.

    A trace must never fail the generation it records. When a write fails (a full disk, a file-size
    limit), the file is cut back to its last whole record, one warning is logged and the writer stops:
    later records are counted (``dropped``) but not written, even if space comes back, and close()
    publishes the records kept. ``on_error="raise"`` (write_trace: a whole trace written on purpose)
    raises ClutorError instead and publishes nothing.
    """

    FLUSH_BYTES = 64 << 10  # records are written in batches of about this size

    def __init__(self, path: str | os.PathLike, header: TraceHeader | None = None, *,
                 protect: Iterable[str | os.PathLike] = (), on_error: str = "stop"):
        if on_error not in ("stop", "raise"):
            raise ValueError(f"on_error must be 'stop' or 'raise', got {on_error!r}")
        self.path = os.fspath(path)
        self._raise = on_error == "raise"
        self._fd: int | None = None
        check_output(self.path, protect)
        d = os.path.dirname(os.path.abspath(self.path))
        try:
            self._fd, self._tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.", suffix=".tmp", dir=d)
        except OSError as e:
            raise ClutorError(f"{self.path}: cannot write the routing trace: {e.strerror or e}") from None
        self._buf: list[bytes] = []   # whole lines not yet written
        self._buf_bytes = 0
        self._buf_records = 0
        self._on_disk = 0             # bytes of whole lines in the file
        self.kept = 0                 # records in the file
        self.dropped = 0              # records not written because an earlier write failed
        self.error: str | None = None  # why writing stopped
        if header is not None:
            self._put(json.dumps(header.to_json()).encode() + b"\n", record=False)

    def write(self, token: int, layer: int, experts: Sequence[int], weights: Sequence[float] | None = None,
              next: Sequence[int] | None = None) -> None:
        rec = TraceRecord(
            int(token), int(layer), tuple(int(e) for e in experts),
            None if weights is None else tuple(float(w) for w in weights),
            None if next is None else tuple(int(e) for e in next),
        )
        self.write_record(rec)

    def write_record(self, rec: TraceRecord) -> None:
        if self._fd is None:
            raise ClosedError(f"{self.path}: trace writer is closed")
        if self.error is not None:
            self.dropped += 1
            return
        self._put(json.dumps(rec.to_json()).encode() + b"\n")

    def _put(self, line: bytes, record: bool = True) -> None:
        self._buf.append(line)
        self._buf_bytes += len(line)
        self._buf_records += record
        if self._buf_bytes >= self.FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._buf or self.error is not None:
            return
        data = b"".join(self._buf)
        n_records = self._buf_records
        self._buf, self._buf_bytes, self._buf_records = [], 0, 0
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            self.dropped += n_records
            self._failed(e)
            return
        self._on_disk += len(data)
        self.kept += n_records

    def _failed(self, e: OSError) -> None:
        """A write failed: cut the file back to its whole lines and stop (or raise, with on_error='raise')."""
        self.error = e.strerror or str(e)
        try:
            os.ftruncate(self._fd, self._on_disk)  # (shrinking needs no space)
        except OSError:
            pass
        if self._raise:
            self.abort()
            raise ClutorError(f"{self.path}: cannot write the routing trace: {self.error}")
        log.warning("%s: cannot write the routing trace (%s): tracing stopped for the rest of this run; "
                    "the %d records written so far are kept", self.path, self.error, self.kept)

    def close(self) -> None:
        """Finish the file and move it into place (an error leaves ``path`` untouched). After a failed
        write, the records written before it are published (none: ``path`` is left as it was)."""
        if self._fd is None:
            return
        self._flush()
        if self.error is not None and self._on_disk == 0:
            self.abort()
            return
        fd, self._fd = self._fd, None
        try:
            os.close(fd)
            os.replace(self._tmp, self.path)
        except OSError as e:
            _unlink(self._tmp)
            raise ClutorError(f"{self.path}: cannot write the routing trace: {e.strerror or e}") from None

    def abort(self) -> None:
        """Close without publishing: the temporary file is removed, ``path`` is left as it was."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.close(fd)
        except OSError:
            pass
        _unlink(self._tmp)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_output(path: str, protect: Iterable[str | os.PathLike]) -> None:
    """Refuse an output path that would destroy something: a protected file (the model), an existing
    file that is not a routing trace, or a non-regular file (a directory, device, FIFO)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ClutorError(f"{path}: cannot write the routing trace: {e.strerror or e}") from None
    for p in protect:
        try:
            pst = os.stat(p)
        except OSError:
            continue
        if (pst.st_dev, pst.st_ino) == (st.st_dev, st.st_ino):
            raise ClutorError(f"{path}: refusing to write the routing trace over the model file {os.fspath(p)}")
    if not stat.S_ISREG(st.st_mode):
        raise ClutorError(f"{path}: refusing to write the routing trace: exists and is not a regular file")
    if st.st_size and not _looks_like_trace(path):
        raise ClutorError(f"{path}: refusing to overwrite an existing file that is not a routing trace "
                          "(remove it or choose another name)")


def _looks_like_trace(path: str) -> bool:
    """The file starts with a trace header or record line (a JSON object with our keys)."""
    try:
        with open(path, "rb") as f:
            line = f.readline(1 << 16)
        d = json.loads(line)
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and ("clutor_trace" in d or {"token", "layer", "experts"} <= d.keys())


def write_trace(path: str | os.PathLike, records: Iterable[TraceRecord], header: TraceHeader | None = None) -> None:
    with TraceWriter(path, header, on_error="raise") as w:
        for rec in records:
            w.write_record(rec)


# -- synthetic traces ----------------------------------------------------------------------------
def synthetic_trace(
    n_tokens: int,
    n_layers: int,
    n_experts: int,
    top_k: int,
    *,
    skew: float = 1.0,
    reuse: float = 0.4,
    seed: int = 0,
    expert_bytes: int | None = None,
) -> Trace:
    """A routing trace with the two properties real MoE routing shows.

    - skew: popularity per layer is Zipf-like, p(rank r) ~ 1 / (r + 1)^skew over a random order of the
      layer's experts (0 = uniform).
    - reuse: each expert the previous token used at the same layer is kept with this probability
      (real OLMoE decodes keep ~35-43% of a layer's experts from one token to the next); the rest of
      the top-k is drawn from the popularity without replacement.
    Weights are a random softmax, largest first.
    """
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
    if not 0.0 <= reuse <= 1.0:
        raise ValueError(f"reuse must be in [0, 1], got {reuse}")
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, n_experts + 1, dtype=np.float64)
    base = ranks ** -float(skew)  # [E] popularity by rank
    popularity = []
    for _ in range(n_layers):
        p = np.empty(n_experts)
        p[rng.permutation(n_experts)] = base  # [E] popularity of each expert id
        popularity.append(p / p.sum())
    prev: list[list[int]] = [[] for _ in range(n_layers)]
    records: list[TraceRecord] = []
    for t in range(n_tokens):
        for layer in range(n_layers):
            kept = [e for e in prev[layer] if rng.random() < reuse]
            need = top_k - len(kept)
            p = popularity[layer].copy()
            p[kept] = 0.0
            fresh = rng.choice(n_experts, size=need, replace=False, p=p / p.sum()) if need else []
            experts = kept + [int(e) for e in fresh]
            order = rng.permutation(top_k)
            experts = [experts[i] for i in order]
            logits = rng.normal(size=top_k)
            w = np.sort(np.exp(logits) / np.exp(logits).sum())[::-1]  # [K] descending
            records.append(TraceRecord(t, layer, tuple(experts), tuple(float(x) for x in w)))
            prev[layer] = experts
    header = TraceHeader(n_layers, n_experts, top_k, expert_bytes)
    return Trace(tuple(records), header, None)

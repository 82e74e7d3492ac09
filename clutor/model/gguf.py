"""Open and validate a (possibly split) GGUF model file: metadata, tensor table, expert slab layout.

Only the header (key/value metadata and tensor table) is read at open; tensor bytes stay on disk and
are read on demand with ``os.pread`` (``GGUFFile.read``) or streamed by clutor.io from the
``ExpertLayout`` built here.

Why a hand parser rather than ``gguf.GGUFReader``: GGUFReader memory-maps the whole file and builds
numpy views from counts it has not checked, so a corrupt count becomes a huge allocation, a numpy
exception or a silent wrap-around instead of a clear error. The format is small, so we parse it
ourselves through a bounded reader: every count is checked against the bytes left in the file (and
against a sane cap) *before* anything is allocated from it, and every failure is a ModelFileError
naming the file, the field, what was expected and what was found. gguf-py is still the source of
truth for the enums and block sizes (GGMLQuantizationType, GGUFValueType, GGML_QUANT_SIZES).

Format (little-endian; v2 and v3 share this layout, v1 used 32-bit counts and is not supported):
    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)        string = u64 length + UTF-8 bytes
                                                          array  = u32 item_type, u64 count, items
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32), then the data; offsets are relative to that start.
"""
from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .._util import open_regular
from ..errors import ClosedError, ClutorIOError, ModelFileError, UnsupportedError
from ..io.layout import ExpertLayout, ExpertTensor
from .weight_types import SUPPORTED, type_name

__all__ = ["TensorInfo", "GGUFFile", "tensor_nbytes", "SUPPORTED_TYPES", "split_part_path"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# Caps on counts read from the file. Real models are far below them (a 256k-entry vocabulary, ~1k
# tensors, a chat template of a few KiB); they exist so a corrupt count fails fast and clearly even
# when the file happens to be big enough to "hold" it.
_MAX_KV = 1 << 16
_MAX_TENSORS = 1 << 20
_MAX_STRING = 16 << 20          # bytes in one string value
_MAX_ARRAY = 1 << 24            # items in one array
_MAX_ARRAY_DEPTH = 2            # arrays of arrays are legal GGUF; nothing deeper is ever written
_MAX_NAME = 64                  # llama.cpp's GGML_MAX_NAME: tensor names must be shorter
_MAX_DIMS = 4                   # GGML_MAX_DIMS
_MAX_SPLIT = 99999              # the file name carries the part number in 5 digits
_CHUNK = 1 << 20                # header read-ahead

# The weight types Clutor reads (weight_types.TYPES is the one table of them).
SUPPORTED_TYPES: frozenset[int] = frozenset(int(t) for t in SUPPORTED)

_VT = GGUFValueType
# value type -> (struct format, numpy dtype) for fixed-size scalars
_SCALARS: dict[int, tuple[str, str]] = {
    int(_VT.UINT8): ("<B", "<u1"),
    int(_VT.INT8): ("<b", "<i1"),
    int(_VT.UINT16): ("<H", "<u2"),
    int(_VT.INT16): ("<h", "<i2"),
    int(_VT.UINT32): ("<I", "<u4"),
    int(_VT.INT32): ("<i", "<i4"),
    int(_VT.FLOAT32): ("<f", "<f4"),
    int(_VT.BOOL): ("<B", "<u1"),
    int(_VT.UINT64): ("<Q", "<u8"),
    int(_VT.INT64): ("<q", "<i8"),
    int(_VT.FLOAT64): ("<d", "<f8"),
}

_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_MISSING = object()


def split_part_path(path: str, part: int, count: int) -> str:
    """llama.cpp's split naming: ``PREFIX-00001-of-00003.gguf`` is part 1 (1-based) of 3."""
    d, base = os.path.split(path)
    m = _SPLIT_NAME.match(base)
    prefix = m.group("prefix") if m else base.removesuffix(".gguf")
    return os.path.join(d, f"{prefix}-{part:05d}-of-{count:05d}.gguf")


def tensor_nbytes(qtype: int, shape, *, path: str = "<tensor>", name: str = "tensor") -> int:
    """Bytes of a tensor of ``qtype`` with numpy ``shape`` (quant blocks run along shape[-1])."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise UnsupportedError(path, f"tensor {name} type", "a known ggml type", type_name(qtype)) from None
    shape = tuple(int(n) for n in shape)
    if not shape or any(n <= 0 for n in shape):
        raise ModelFileError(path, f"tensor {name} shape", "positive dimensions", shape)
    if shape[-1] % block:
        raise ModelFileError(
            path, f"tensor {name} row length",
            f"a multiple of the {type_name(qtype)} block size {block}", shape[-1],
        )
    return math.prod(shape[:-1]) * (shape[-1] // block) * type_size


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: int                 # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]     # numpy order: GGUF ne reversed, so ne=[D, F, E] -> (E, F, D)
    path: str                  # the file (part) holding the data
    offset: int                # absolute byte offset of the data in `path`
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


# ---------------------------------------------------------------------------------------------
# header parsing


class _Reader:
    """Sequential reads of the header with every length checked against the file size first."""

    def __init__(self, fd: int, path: str, size: int):
        self.fd, self.path, self.size = fd, path, size
        self.pos = 0                 # file offset of the next byte to parse
        self._buf = b""              # read-ahead window
        self._buf_off = 0            # file offset of _buf[0]

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            raise ModelFileError(
                self.path, field, f"{n} bytes at offset {self.pos}",
                f"only {self.size - self.pos} left in the {self.size}-byte file (truncated or corrupt)",
            )

    def take(self, n: int, field: str) -> bytes:
        self.need(n, field)
        i = self.pos - self._buf_off
        if i + n > len(self._buf):
            want = min(max(n, _CHUNK), self.size - self.pos)
            self._buf = _pread_exact(self.fd, self.path, want, self.pos, field)
            self._buf_off, i = self.pos, 0
        self.pos += n
        return self._buf[i : i + n]

    def scalar(self, fmt: str, field: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]

    def u32(self, field: str) -> int:
        return self.scalar("<I", field)

    def u64(self, field: str) -> int:
        return self.scalar("<Q", field)

    def string(self, field: str, *, limit: int = _MAX_STRING, strict: bool = True) -> str:
        n = self.u64(f"{field} length")
        if n > limit:
            raise ModelFileError(self.path, f"{field} length", f"at most {limit} bytes", n)
        raw = self.take(n, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if strict:
                raise ModelFileError(self.path, field, "valid UTF-8", f"{raw[:40]!r} ({e.reason})") from None
            # Token texts are byte strings to llama.cpp; keep invalid bytes recoverable
            # (s.encode("utf-8", "surrogateescape")) instead of rejecting the vocabulary.
            return raw.decode("utf-8", "surrogateescape")


    def strings(self, count: int, field: str) -> list[str]:
        """An array's strings. Same checks as string(), with a fast path for strings already in
        the read-ahead window: a 150k-token vocabulary would otherwise dominate open()."""
        out: list[str] = []
        unpack = _U64.unpack_from
        for i in range(count):
            buf, j = self._buf, self.pos - self._buf_off
            if j + 8 <= len(buf):
                n = unpack(buf, j)[0]
                if n <= _MAX_STRING and j + 8 + n <= len(buf):
                    raw = buf[j + 8 : j + 8 + n]
                    self.pos += 8 + n
                    try:
                        out.append(raw.decode("utf-8"))
                    except UnicodeDecodeError:
                        out.append(raw.decode("utf-8", "surrogateescape"))
                    continue
            out.append(self.string(f"{field}[{i}]", strict=False))
        return out


_U64 = struct.Struct("<Q")


def _pread_exact(fd: int, path: str, n: int, offset: int, field: str) -> bytes:
    parts, got = [], 0
    while got < n:
        try:
            chunk = os.pread(fd, n - got, offset + got)
        except OSError as e:
            raise ClutorIOError(path, offset + got, n - got, e.strerror or str(e)) from None
        if not chunk:
            raise ModelFileError(path, field, f"{n} bytes at offset {offset}", f"end of file after {got}")
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_value(r: _Reader, vtype: int, field: str, depth: int = 0) -> object:
    if vtype in _SCALARS:
        v = r.scalar(_SCALARS[vtype][0], field)
        if vtype == _VT.BOOL:
            if v > 1:
                raise ModelFileError(r.path, field, "a bool (0 or 1)", v)
            return bool(v)
        return v
    if vtype == _VT.STRING:
        return r.string(field, strict=False)
    if vtype == _VT.ARRAY:
        if depth >= _MAX_ARRAY_DEPTH:
            raise ModelFileError(r.path, field, f"arrays nested at most {_MAX_ARRAY_DEPTH} deep", "deeper")
        item = r.u32(f"{field} item type")
        count = r.u64(f"{field} count")
        if count > _MAX_ARRAY:
            raise ModelFileError(r.path, f"{field} count", f"at most {_MAX_ARRAY} items", count)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1])
            raw = r.take(count * dtype.itemsize, f"{field} ({count} x {_VT(item).name})")
            arr = np.frombuffer(raw, dtype=dtype)  # [count]
            if item == _VT.BOOL:
                if count and int(arr.max()) > 1:
                    raise ModelFileError(r.path, field, "bools (0 or 1)", int(arr.max()))
                return arr.astype(bool).tolist()
            return arr.tolist()
        if item == _VT.STRING:
            # each string is at least its 8-byte length: reject an impossible count before looping
            r.need(count * 8, f"{field} ({count} strings)")
            return r.strings(count, field)
        if item == _VT.ARRAY:
            r.need(count * 12, f"{field} ({count} arrays)")
            return [_read_value(r, item, f"{field}[{i}]", depth + 1) for i in range(count)]
        raise ModelFileError(r.path, f"{field} item type", "a GGUF value type (0..12)", item)
    raise ModelFileError(r.path, f"{field} type", "a GGUF value type (0..12)", vtype)


@dataclass(frozen=True, slots=True)
class _Part:
    path: str
    fd: int
    size: int
    version: int
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]
    data_start: int


def _parse_part(path: str, fd: int) -> _Part:
    size = os.fstat(fd).st_size  # a regular file: open_regular checked
    r = _Reader(fd, path, size)
    version, n_tensors, n_kv = _read_header(r, path)
    metadata = _read_metadata(r, path, n_kv)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(path, "general.alignment", "a positive power of two integer", alignment)
    infos = _read_tensor_infos(r, path, n_tensors, alignment)
    data_start = -(-r.pos // alignment) * alignment
    tensors = _place_tensors(path, infos, data_start, size)
    return _Part(path, fd, size, version, metadata, tensors, data_start)


def _read_header(r: _Reader, path: str) -> tuple[int, int, int]:
    """(version, tensor count, metadata key count), each checked against what the file can hold."""
    magic = r.take(4, "magic")
    if magic != _MAGIC:
        raise ModelFileError(path, "magic", "b'GGUF' (a GGUF file)", magic)
    raw_version = r.take(4, "version")
    version = struct.unpack("<I", raw_version)[0]
    if version not in _VERSIONS:
        swapped = struct.unpack(">I", raw_version)[0]
        if swapped in (1, 2, 3):
            raise UnsupportedError(path, "byte order", "a little-endian GGUF", "big-endian")
        raise UnsupportedError(path, "version", f"GGUF version {' or '.join(map(str, _VERSIONS))}", version)

    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata key count")
    # Smallest possible encodings: a kv pair is >= 8 (key length) + 1 + 4 + 1 bytes, a tensor info
    # >= 8 + 1 + 4 + 8 + 4 + 8 bytes. Reject counts the file cannot hold before looping over them.
    if n_kv > _MAX_KV:
        raise ModelFileError(path, "metadata key count", f"at most {_MAX_KV}", n_kv)
    if n_tensors > _MAX_TENSORS:
        raise ModelFileError(path, "tensor count", f"at most {_MAX_TENSORS}", n_tensors)
    r.need(n_kv * 14 + n_tensors * 33, f"{n_kv} metadata pairs and {n_tensors} tensor infos")
    return version, n_tensors, n_kv


def _read_metadata(r: _Reader, path: str, n_kv: int) -> dict[str, object]:
    metadata: dict[str, object] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}", limit=1 << 16)
        if not key:
            raise ModelFileError(path, f"metadata key #{i}", "a non-empty key", "''")
        if key in metadata:
            raise ModelFileError(path, f"metadata key {key}", "a key appearing once", "a duplicate")
        vtype = r.u32(f"metadata {key} type")
        metadata[key] = _read_value(r, vtype, f"metadata {key}")
    return metadata


def _read_tensor_infos(r: _Reader, path: str, n_tensors: int,
                       alignment: int) -> list[tuple[str, int, tuple[int, ...], int, int]]:
    """(name, qtype, numpy shape, relative offset, nbytes) of each tensor; its bytes are checked
    against the file by _place_tensors, once the data section's start is known."""
    infos: list[tuple[str, int, tuple[int, ...], int, int]] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"tensor #{i} name", limit=_MAX_NAME - 1)
        if not name:
            raise ModelFileError(path, f"tensor #{i} name", "a non-empty name", "''")
        if name in seen:
            raise ModelFileError(path, f"tensor {name}", "a tensor name appearing once", "a duplicate")
        seen.add(name)
        n_dims = r.u32(f"tensor {name} n_dims")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFileError(path, f"tensor {name} n_dims", f"1..{_MAX_DIMS}", n_dims)
        ne = struct.unpack(f"<{n_dims}q", r.take(8 * n_dims, f"tensor {name} dimensions"))
        if any(n <= 0 for n in ne):
            raise ModelFileError(path, f"tensor {name} dimensions", "all > 0", list(ne))
        qtype = r.u32(f"tensor {name} type")
        offset = r.u64(f"tensor {name} offset")
        try:
            GGMLQuantizationType(qtype)
        except ValueError:
            raise ModelFileError(path, f"tensor {name} type", "a known ggml type", qtype) from None
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedError(
                path, f"tensor {name} type",
                "one of " + ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES)), type_name(qtype),
            )
        # Python ints do not overflow; the size check against the file bounds the product.
        shape = tuple(reversed(ne))
        nbytes = tensor_nbytes(qtype, shape, path=path, name=name)
        if offset % alignment:
            raise ModelFileError(path, f"tensor {name} offset", f"a multiple of the alignment {alignment}", offset)
        infos.append((name, qtype, shape, offset, nbytes))
    return infos


def _place_tensors(path: str, infos: list[tuple[str, int, tuple[int, ...], int, int]], data_start: int,
                   size: int) -> dict[str, TensorInfo]:
    """The tensor table with absolute offsets: every tensor inside the file, no two overlapping."""
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, qtype, shape, offset, nbytes in infos:
        if offset + nbytes > data_size:
            raise ModelFileError(
                path, f"tensor {name} data",
                f"{nbytes} bytes at data offset {offset} within the {max(data_size, 0)} data bytes",
                f"end at {offset + nbytes} (past the end of the file)",
            )
        tensors[name] = TensorInfo(name, qtype, shape, path, data_start + offset, nbytes)

    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.nbytes:
            raise ModelFileError(
                path, f"tensor {b.name} offset",
                f"not overlapping tensor {a.name} (which ends at {a.offset + a.nbytes})", b.offset,
            )
    return tensors


def _open_part(path: str) -> _Part:
    fd = open_regular(path, "GGUF file")
    try:
        return _parse_part(path, fd)
    except BaseException:
        os.close(fd)
        raise


def _split_int(part: _Part, key: str) -> int | None:
    v = part.metadata.get(key)
    if v is None:
        return None
    if type(v) is not int:
        raise ModelFileError(part.path, key, "an integer", repr(v))
    return v


# ---------------------------------------------------------------------------------------------
# the file


class GGUFFile:
    """A validated GGUF model (all parts of a split model); tensor data is read on demand."""

    path: str
    paths: tuple[str, ...]
    arch: str
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]

    def __init__(self, path: str, parts: list[_Part]):
        # Use GGUFFile.open(); this only assembles already-validated parts. The fds are adopted only
        # once nothing can fail any more, so a failed construction never closes them twice.
        self._fds: dict[str, int] | None = None
        self.path = path
        self.paths = tuple(p.path for p in parts)
        self.metadata = {}
        self.tensors = {}
        for p in parts:
            for k, v in p.metadata.items():
                self.metadata.setdefault(k, v)  # first part wins
            for name, t in p.tensors.items():
                if name in self.tensors:
                    raise ModelFileError(
                        p.path, f"tensor {name}", "a tensor name appearing once across parts",
                        f"also in {self.tensors[name].path}",
                    )
                self.tensors[name] = t
        self.arch = self.get("general.architecture", kind=str)
        self._fds = {p.path: p.fd for p in parts}

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFFile":
        path = os.fspath(path)
        parts = [_open_part(path)]
        try:
            parts += cls._open_other_parts(parts[0])
            return cls(path, parts)
        except BaseException:
            for p in parts:
                os.close(p.fd)
            raise

    @staticmethod
    def _open_other_parts(first: _Part) -> list[_Part]:
        count = _split_int(first, "split.count")
        no = _split_int(first, "split.no")
        total = _split_int(first, "split.tensors.count")
        if count is None or count == 1:
            if no not in (None, 0):
                raise ModelFileError(first.path, "split.no", "0 for a model in one file", no)
            if total is not None and total != len(first.tensors):
                raise ModelFileError(
                    first.path, "split.tensors.count", f"the {len(first.tensors)} tensors in the file", total
                )
            return []
        if not 1 <= count <= _MAX_SPLIT:
            raise ModelFileError(first.path, "split.count", f"1..{_MAX_SPLIT}", count)
        if no != 0:
            hint = split_part_path(first.path, 1, count)
            raise ModelFileError(
                first.path, "split.no",
                f"0: this is part {no + 1 if isinstance(no, int) else '?'} of {count}; open the first part {hint}",
                no,
            )
        m = _SPLIT_NAME.match(os.path.basename(first.path))
        if not m or int(m.group("no")) != 1 or int(m.group("count")) != count:
            raise ModelFileError(
                first.path, "file name",
                f"PREFIX-00001-of-{count:05d}.gguf for a model split in {count} parts (split.count)",
                os.path.basename(first.path),
            )
        n_tensors = len(first.tensors)
        arch = first.metadata.get("general.architecture")
        opened: list[_Part] = []
        try:
            for i in range(2, count + 1):
                p_path = split_part_path(first.path, i, count)
                if not os.path.exists(p_path):
                    raise ModelFileError(p_path, f"split part {i} of {count}", f"present next to {first.path}", "missing")
                part = _open_part(p_path)
                opened.append(part)
                if _split_int(part, "split.no") != i - 1:
                    raise ModelFileError(p_path, "split.no", str(i - 1), part.metadata.get("split.no", "missing"))
                if _split_int(part, "split.count") != count:
                    raise ModelFileError(p_path, "split.count", str(count), part.metadata.get("split.count", "missing"))
                p_arch = part.metadata.get("general.architecture", arch)
                if p_arch != arch:
                    raise ModelFileError(p_path, "general.architecture", repr(arch), repr(p_arch))
                n_tensors += len(part.tensors)
        except BaseException:
            for p in opened:
                os.close(p.fd)
            raise
        if total is not None and total != n_tensors:
            for p in opened:
                os.close(p.fd)
            raise ModelFileError(
                first.path, "split.tensors.count", f"the {n_tensors} tensors found in {count} parts", total
            )
        return opened

    # -- metadata --------------------------------------------------------------------------

    def get(self, key: str, default: object = _MISSING, *, kind: type | tuple[type, ...] | None = None) -> object:
        """Metadata value; a missing key without default or a value of the wrong kind is a ModelFileError.

        ``kind=float`` also accepts integers (returned as float); ``kind=int`` never accepts bools.
        """
        kinds = () if kind is None else (kind if isinstance(kind, tuple) else (kind,))
        kind_name = " or ".join(k.__name__ for k in kinds) if kinds else "any"
        if key not in self.metadata:
            if default is not _MISSING:
                return default
            raise ModelFileError(self.path, key, f"a {kind_name} value", "missing")
        v = self.metadata[key]
        if not kinds:
            return v
        if isinstance(v, bool):
            ok = bool in kinds
        elif isinstance(v, int) and int not in kinds and float in kinds:
            return float(v)
        else:
            ok = isinstance(v, kinds)
        if not ok:
            shown = repr(v) if not isinstance(v, list) else f"a list of {len(v)}"
            raise ModelFileError(self.path, key, f"a {kind_name} value", f"{type(v).__name__} {shown[:80]}")
        return v

    def arch_get(self, suffix: str, default: object = _MISSING, *, kind: type | tuple[type, ...] | None = None) -> object:
        return self.get(f"{self.arch}.{suffix}", default, kind=kind)

    # -- tensors ---------------------------------------------------------------------------

    def tensor(self, name: str, shape: tuple | None = None, types: Collection[int] | None = None) -> TensorInfo:
        """Tensor info, checked against an expected numpy shape (None entries match anything) and types."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(self.path, f"tensor {name}", "present", "missing")
        if shape is not None:
            shape = tuple(shape)
            if len(shape) != len(t.shape) or any(e is not None and e != g for e, g in zip(shape, t.shape)):
                raise ModelFileError(t.path, f"tensor {name} shape", str(shape), str(t.shape))
        if types is not None and t.qtype not in {int(x) for x in types}:
            names = ", ".join(type_name(int(x)) for x in types)
            raise UnsupportedError(t.path, f"tensor {name} type", f"one of {names}", t.type_name)
        return t

    def read(self, name: str) -> np.ndarray:
        """The tensor's raw bytes, uint8 [nbytes], copied into process-owned memory."""
        t = self.tensor(name)
        fd = self._fd(t.path)
        out = np.empty(t.nbytes, dtype=np.uint8)  # [nbytes]
        view = memoryview(out)
        done = 0
        while done < t.nbytes:
            try:
                n = os.preadv(fd, [view[done:]], t.offset + done)
            except OSError as e:
                raise ClutorIOError(t.path, t.offset + done, t.nbytes - done, e.strerror or str(e)) from None
            if n == 0:
                raise ClutorIOError(t.path, t.offset + done, t.nbytes - done, "end of file (file shrank after open?)")
            done += n
        return out

    def expert_slabs(self, layers: Sequence[Sequence[tuple[str, str]]], n_experts: int) -> ExpertLayout:
        """Where each routed expert's slabs lie, from the tensors that hold them: per layer, (tensor
        name, part) pairs in the order clutor.io.layout.PARTS gives them (gate, up, down, then the
        biases; no gate: up, down). A part "gate+up" is one tensor [E, 2F, D] holding each expert's
        gate rows then its up rows: two slabs. Which tensors those are is the architecture's table
        (clutor.model.weights.expert_layout); this checks that each splits into n_experts slabs."""
        out = []
        gated = True
        for parts in layers:
            slabs = []
            for name, part in parts:
                t = self.tensor(name)
                if part == "gate+up":
                    if len(t.shape) != 3 or t.shape[0] != n_experts or t.nbytes % (2 * n_experts):
                        raise ModelFileError(t.path, f"tensor {name} shape", f"({n_experts}, 2 x rows, cols)",
                                             str(t.shape))
                    half = t.nbytes // n_experts // 2
                    slabs += [ExpertTensor(t.path, t.offset, half, 2 * half),
                              ExpertTensor(t.path, t.offset + half, half, 2 * half)]
                    continue
                if part.endswith("bias"):
                    if len(t.shape) != 2 or t.shape[0] != n_experts or t.qtype != 0:
                        raise ModelFileError(t.path, f"tensor {name}", f"F32 of shape ({n_experts}, rows)",
                                             f"{type_name(t.qtype)} {tuple(t.shape)}")
                elif len(t.shape) != 3 or t.shape[0] != n_experts:
                    raise ModelFileError(t.path, f"tensor {name} shape", f"({n_experts}, rows, cols)", str(t.shape))
                if t.nbytes % n_experts:
                    raise ModelFileError(t.path, f"tensor {name} size", f"a multiple of {n_experts} experts", t.nbytes)
                slabs.append(ExpertTensor(t.path, t.offset, t.nbytes // n_experts))
            gated = any(p in ("gate", "gate+up") for _, p in parts)
            out.append(tuple(slabs))
        return ExpertLayout(n_experts, tuple(out), gated)

    # -- lifetime --------------------------------------------------------------------------

    def _fd(self, path: str) -> int:
        if self._fds is None:
            raise ClosedError(f"{self.path}: GGUF file used after close()")
        return self._fds[path]

    def close(self) -> None:
        fds, self._fds = getattr(self, "_fds", None), None
        for fd in (fds or {}).values():
            os.close(fd)

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # A forgotten close() must not leak fds for the life of the process.
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, arch={getattr(self, 'arch', '?')!r}, parts={len(self.paths)}, tensors={len(self.tensors)})"

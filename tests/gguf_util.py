"""Small GGUF files for tests: a raw byte encoder (for corrupt files) and a GGUFWriter wrapper.

The raw encoder is independent of clutor's parser on purpose: it writes exactly the bytes asked for,
including impossible counts, so tests can aim at one field at a time.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

_FMT = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
    VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}


def enc_str(s: str | bytes, length: int | None = None) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def enc_value(vtype: VT, value, item_type: VT | None = None, count: int | None = None) -> bytes:
    if vtype == VT.STRING:
        return enc_str(value)
    if vtype == VT.ARRAY:
        assert item_type is not None
        body = b"".join(enc_value(item_type, v) for v in value)
        return struct.pack("<IQ", item_type, len(value) if count is None else count) + body
    return struct.pack(_FMT[vtype], value)


@dataclass
class RawTensor:
    name: str
    ne: list[int]                  # GGUF order (fastest first)
    qtype: int
    data: bytes = b""
    offset: int | None = None      # relative to data start; None = packed with alignment
    n_dims: int | None = None      # override the count written (default len(ne))
    place: bool = True             # False: write only the header entry, not the data


@dataclass
class RawGGUF:
    """A GGUF built field by field. ``kv`` items are (key, encoded value type, encoded value bytes)."""

    kv: list[tuple[str, int, bytes]] = field(default_factory=list)
    tensors: list[RawTensor] = field(default_factory=list)
    magic: bytes = b"GGUF"
    version: int = 3
    alignment: int = 32
    n_tensors: int | None = None   # override the counts written in the header
    n_kv: int | None = None

    def add(self, key: str, vtype: VT, value, item_type: VT | None = None) -> "RawGGUF":
        self.kv.append((key, int(vtype), enc_value(vtype, value, item_type)))
        return self

    def to_bytes(self) -> bytes:
        head = self.magic + struct.pack("<I", self.version)
        head += struct.pack("<QQ", len(self.tensors) if self.n_tensors is None else self.n_tensors,
                            len(self.kv) if self.n_kv is None else self.n_kv)
        for key, vtype, raw in self.kv:
            head += enc_str(key) + struct.pack("<I", vtype) + raw
        offsets, pos = [], 0
        for t in self.tensors:
            pos = -(-pos // self.alignment) * self.alignment
            offsets.append(pos if t.offset is None else t.offset)
            pos = offsets[-1] + len(t.data)
        for t, off in zip(self.tensors, offsets):
            n_dims = len(t.ne) if t.n_dims is None else t.n_dims
            head += enc_str(t.name) + struct.pack("<I", n_dims)
            head += b"".join(struct.pack("<Q", n & (2**64 - 1)) for n in t.ne)
            head += struct.pack("<IQ", t.qtype, off)
        data_start = -(-len(head) // self.alignment) * self.alignment
        out = bytearray(head + b"\0" * (data_start - len(head)))
        for t, off in zip(self.tensors, offsets):
            if not t.place:
                continue
            end = data_start + off + len(t.data)
            if len(out) < end:
                out += b"\0" * (end - len(out))
            out[data_start + off : end] = t.data
        return bytes(out)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def f32_tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> tuple[str, np.ndarray]:
    return name, np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def write_gguf(
    path: Path,
    tensors: list[tuple[str, np.ndarray, int]],   # (name, array, qtype); Q types given as float arrays
    kv: dict[str, tuple[str, object]] | None = None,  # key -> (GGUFWriter add_* suffix, value)
    arch: str = "olmoe",
) -> dict[str, bytes]:
    """Write a GGUF with GGUFWriter; returns the exact data bytes of each tensor as written."""
    w = gguf.GGUFWriter(path, arch)
    for key, (kind, value) in (kv or {}).items():
        if kind == "array":
            w.add_array(key, value)
        else:
            getattr(w, f"add_{kind}")(key, value)
    written = {}
    for name, arr, qtype in tensors:
        raw = encode_tensor(arr, qtype)
        w.add_tensor(name, raw, raw_dtype=QT(qtype) if qtype not in (QT.F32, QT.F16) else None)
        written[name] = raw.tobytes()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def copy_gguf(src: Path, dst: Path, split_max_tensors: int = 0,
              retype: dict[str, tuple[int, np.ndarray]] | None = None, drop: frozenset[str] = frozenset(),
              as_arrays: dict[str, list[int]] | None = None, strings: dict[str, str] | None = None) -> None:
    """Rewrite src with GGUFWriter: every key and tensor as it is, except the tensors named in
    `retype` (name -> (qtype, raw bytes uint8 [..., row_bytes])), the keys and tensors in `drop` (left out) and
    those in `as_arrays` (written as that array of the key's integer type, as a converter writes a
    per-layer value), with the string keys of `strings` set (added or replaced); split in parts of
    split_max_tensors tensors when given (llama.cpp's NAME-0000k-of-0000N.gguf)."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch, split_max_tensors=split_max_tensors)
    for name, fld in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop or name in (strings or {}):
            continue
        vtype = fld.types[0]
        if name in (as_arrays or {}):
            w.add_key_value(name, as_arrays[name], VT.ARRAY, sub_type=vtype)
            continue
        w.add_key_value(name, fld.contents(), vtype, sub_type=fld.types[-1] if vtype == VT.ARRAY else None)
    for name, value in (strings or {}).items():
        w.add_string(name, value)
    for t in (t for t in r.tensors if t.name not in drop):
        qt, data = (retype or {}).get(t.name, (QT(t.tensor_type), np.asarray(t.data)))
        w.add_tensor(t.name, data, raw_dtype=None if qt in (QT.F32, QT.F16) else QT(qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def encode_tensor(arr: np.ndarray, qtype: int) -> np.ndarray:
    if qtype == QT.F32:
        return arr.astype(np.float32)
    if qtype == QT.F16:
        return arr.astype(np.float16)
    return gguf.quants.quantize(arr.astype(np.float32), QT(qtype))  # uint8 [..., row_bytes]

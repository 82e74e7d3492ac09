"""The fuzz worker of tests/test_fuzz.py: mutate a GGUF model, open each mutant the way a user would,
and print one JSON line per mutant (outcome + peak RSS) so the parent can watch for hangs and growth.

    python tests/fuzz_util.py MODEL --seed 0 --count 300 --dir /tmp/x

Mutants are a pure function of (model, seed, index): a failure reproduces with the same arguments
(``--first INDEX --count 1``). Only ClutorError subclasses are acceptable outcomes besides success.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import traceback
from pathlib import Path

import numpy as np

# values that break naive size/count arithmetic (as u32/u64 little-endian)
_INTERESTING = [0, 1, 2, 3, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
                0xFFFFFFFF, 1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


_FLOATS = [0.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e38, 1e-45, 65536.0, 1e30]


def scalar_fields(path: str) -> list[tuple[int, int, int, bool]]:
    """(offset of the value, its size, offset of its type field or -1, is a float) for every scalar
    in the metadata and the tensor table, found with gguf-py's reader (not ours)."""
    import gguf

    r = gguf.GGUFReader(path)
    out = []
    for field in [*r.fields.values(), *(t.field for t in r.tensors)]:
        starts = np.cumsum([0] + [len(p.tobytes()) for p in field.parts])
        for k in field.data:
            size = len(field.parts[k].tobytes())
            if size in (1, 2, 4, 8):
                is_float = field.parts[k].dtype.kind == "f"
                out.append((field.offset + int(starts[k]), size, -1, is_float))
        if len(field.parts) >= 3 and not field.name.startswith("GGUF.") and field.types:
            # key length, key, value type: the type field is the third part; an array's item type
            # (e.g. token_type's INT32 -> FLOAT32) the fourth
            out.append((field.offset + int(starts[2]), 4, 0, False))
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                out.append((field.offset + int(starts[3]), 4, 0, False))
    return out


def _targeted(buf: bytearray, fields, rng: np.random.Generator) -> None:
    at, size, type_field, is_float = fields[int(rng.integers(len(fields)))]
    if at + size > len(buf):
        return
    if type_field == 0:
        buf[at:at + 4] = struct.pack("<I", int(rng.integers(0, 14)))  # another GGUF value type
    elif is_float:
        v = _FLOATS[int(rng.integers(len(_FLOATS)))]
        buf[at:at + size] = struct.pack("<f" if size == 4 else "<d", v)
    else:
        v = _INTERESTING[int(rng.integers(len(_INTERESTING)))] & ((1 << (8 * size)) - 1)
        buf[at:at + size] = v.to_bytes(size, "little")


# -- structure-aware mutants: well-formed GGUF whose metadata values have the wrong type or value ----
_VT_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class Layout:
    """The original file cut where metadata ends: its kv pairs as (key, types, value), the raw tensor
    table, and the data (which stays valid whatever the header's length, after re-alignment)."""

    def __init__(self, path: str):
        import gguf

        r = gguf.GGUFReader(path)
        data = Path(path).read_bytes()
        self.version = struct.unpack_from("<I", data, 4)[0]
        self.kvs = [(f.name, [int(t) for t in f.types], f.contents()) for f in r.fields.values()
                    if not f.name.startswith("GGUF.")]
        self.n_tensors = len(r.tensors)
        ti_start = r.tensors[0].field.offset
        self.table = data[ti_start:ti_start + _table_len(data, ti_start, self.n_tensors)]
        self.alignment = int(dict((k, v) for k, _, v in self.kvs).get("general.alignment", 32))
        self.data = data[r.data_offset:]

    def encode(self, kvs) -> bytes:
        head = b"GGUF" + struct.pack("<IQQ", self.version, self.n_tensors, len(kvs))
        for key, types, value in kvs:
            head += _enc_str(key.encode()) + struct.pack("<I", types[0]) + _enc(types, value)
        head += self.table
        pad = -len(head) % self.alignment
        return head + b"\0" * pad + self.data


def _table_len(data: bytes, at: int, n: int) -> int:
    pos = at
    for _ in range(n):
        (ln,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + ln
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * nd + 4 + 8
    return pos - at


def _enc_str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _enc(types: list[int], value) -> bytes:
    t = types[0]
    if t == STRING:
        return _enc_str(value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value))
    if t == ARRAY:
        sub = types[1:] or [4]
        return struct.pack("<IQ", sub[0], len(value)) + b"".join(_enc(sub, v) for v in value)
    fmt = _VT_FMT[t]
    if fmt[-1] in "fd":
        return struct.pack(fmt, float(value))
    bits = 8 * struct.calcsize(fmt)
    v = int(value) & ((1 << bits) - 1)
    return v.to_bytes(bits // 8, "little")


def _mutate_value(types: list[int], value, rng: np.random.Generator):
    """The same key with another type or an extreme value: what a careless converter might write."""
    k = int(rng.integers(0, 8))
    if k == 0:                                   # a scalar or string wrapped in an array
        return [ARRAY, *types], [value] * int(rng.integers(0, 3))
    if k == 1 and types[0] == ARRAY:             # an array's items as floats, with inf and nan
        return [ARRAY, 6], [_FLOATS[int(rng.integers(len(_FLOATS)))] for _ in value]
    if k == 2 and types[0] == ARRAY:             # an array unwrapped to its first item (or a string)
        return (types[1:], value[0]) if value else ([STRING], "")
    if k == 3:                                   # a float, maybe inf/nan
        return [6], _FLOATS[int(rng.integers(len(_FLOATS)))]
    if k == 4:                                   # an extreme integer of some width
        t = int(rng.choice([4, 5, 10, 11]))
        return [t], _INTERESTING[int(rng.integers(len(_INTERESTING)))]
    if k == 5:                                   # a string where a number was
        return [STRING], str(value)[:64]
    if k == 6:                                   # a bool
        return [7], bool(rng.integers(0, 2))
    return types, value                          # unchanged (another key may be dropped instead)


def structural(layout: Layout, rng: np.random.Generator) -> bytes:
    kvs = list(layout.kvs)
    for _ in range(int(rng.integers(1, 3))):
        i = int(rng.integers(len(kvs)))
        key, types, value = kvs[i]
        if key == "general.alignment":
            continue
        if rng.random() < 0.15:
            del kvs[i]
        else:
            kvs[i] = (key, *_mutate_value(types, value, rng))
    return layout.encode(kvs)


def mutate(data: bytes, header_end: int, rng: np.random.Generator, fields=()) -> bytes:
    """One to four mutations, mostly inside the header (metadata + tensor table), where parsing is:
    half of them aimed at a scalar value or a value type, the rest at random bytes."""
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 5))):
        if fields and rng.random() < 0.5:
            _targeted(buf, fields, rng)
            continue
        in_header = rng.random() < 0.9
        hi = min(header_end if in_header else len(buf), len(buf))
        at = int(rng.integers(0, max(hi - 8, 1)))
        kind = int(rng.integers(0, 7))
        if kind == 0:    # flip bits of one byte
            buf[at] ^= int(rng.integers(1, 256))
        elif kind == 1:  # an interesting u32
            buf[at:at + 4] = struct.pack("<I", _INTERESTING[int(rng.integers(len(_INTERESTING)))] & 0xFFFFFFFF)
        elif kind == 2:  # an interesting u64
            buf[at:at + 8] = struct.pack("<Q", _INTERESTING[int(rng.integers(len(_INTERESTING)))])
        elif kind == 3:  # truncate
            del buf[at:]
        elif kind == 4:  # delete a few bytes (shifts everything after)
            del buf[at:at + int(rng.integers(1, 16))]
        elif kind == 5:  # insert random bytes
            buf[at:at] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        else:            # a value type field set to another type (0..12) or beyond
            buf[at:at + 4] = struct.pack("<I", int(rng.integers(0, 16)))
        if len(buf) < 8:
            break
    return bytes(buf)


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


async def exercise(path: str, deep: bool) -> str:
    """What a user does with a file: info-level parsing, the tokenizer, and (deep) open + a forward."""
    import clutor
    from clutor.model.arch import read_arch
    from clutor.model.chat import render_chat
    from clutor.model.gguf import GGUFFile
    from clutor.model.weights import expert_layout

    with GGUFFile.open(path) as f:
        expert_layout(f, read_arch(f))
    tok = clutor.Tokenizer.from_gguf(path)
    ids = tok.encode("Hello, world! <|im_end|> ünïcode", special=True)
    tok.decode(ids)
    render_chat(tok.chat_template, [{"role": "user", "content": "hi"}])
    if not deep:
        return "parsed"
    async with clutor.Model.open(path, io="memory", n_ctx=8) as model:
        await model.logits([0, 1])
        async for _ in model.generate([0, 1], max_tokens=2, temperature=0):
            pass
    return "ran"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()

    from clutor.errors import ClutorError
    from clutor.model.gguf import GGUFFile

    data = Path(a.model).read_bytes()
    with GGUFFile.open(a.model) as f:
        header_end = min(t.offset for t in f.tensors.values())
    fields = scalar_fields(a.model)
    layout = Layout(a.model)
    path = os.path.join(a.dir, "mutant.gguf")
    for i in range(a.first, a.first + a.count):
        rng = np.random.default_rng([a.seed, i])
        with open(path, "wb") as f:
            # a third of the mutants are well-formed files with one wrong metadata value
            f.write(structural(layout, rng) if i % 3 == 1 else mutate(data, header_end, rng, fields))
        deep = i % 4 == 0
        try:
            outcome = asyncio.run(exercise(path, deep))
        except ClutorError as e:
            outcome = f"{type(e).__name__}"
            detail = str(e)[:200]
        except BaseException as e:  # noqa: BLE001 - exactly what the fuzz test looks for
            outcome = "CRASH"
            detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]
        else:
            detail = ""
        print(json.dumps({"i": i, "outcome": outcome, "detail": detail, "vm_hwm": vm_hwm()}), flush=True)


if __name__ == "__main__":
    sys.exit(main())

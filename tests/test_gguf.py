"""clutor.model.gguf: round trips through gguf-py's writer, split models, and corrupt files."""
from __future__ import annotations

import os
import struct
import sys
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_util import QT, VT, RawGGUF, RawTensor, write_gguf  # noqa: E402

from clutor.errors import ClosedError, ClutorError, ModelFileError, UnsupportedError  # noqa: E402
from clutor.model.gguf import SUPPORTED_TYPES, GGUFFile, TensorInfo, tensor_nbytes  # noqa: E402

pytestmark = pytest.mark.timeout(60)

RNG = np.random.default_rng(1234)


def _arr(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------------------------
# good files


ALL_KV = {
    "t.u8": ("uint8", 200),
    "t.i8": ("int8", -100),
    "t.u16": ("uint16", 65000),
    "t.i16": ("int16", -32000),
    "t.u32": ("uint32", 4_000_000_000),
    "t.i32": ("int32", -2_000_000_000),
    "t.f32": ("float32", 0.25),
    "t.bool_t": ("bool", True),
    "t.bool_f": ("bool", False),
    "t.str": ("string", "héllo <|im_end|>"),
    "t.u64": ("uint64", 2**63 + 5),
    "t.i64": ("int64", -(2**62)),
    "t.f64": ("float64", 1e-300),
    "t.arr_str": ("array", ["a", "", "Ġthe", "日本"]),
    "t.arr_int": ("array", [1, -2, 3]),
    "t.arr_float": ("array", [0.5, -1.5]),
    "t.arr_bool": ("array", [True, False, True]),
}


@pytest.fixture
def good(tmp_path):
    tensors = [
        ("token_embd.weight", _arr(10, 64), QT.F32),
        ("blk.0.attn_q.weight", _arr(64, 64), QT.F16),
        ("blk.0.ffn_down_exps.weight", _arr(3, 5, 64), QT.Q8_0),
        ("odd", _arr(7), QT.F32),  # 28 bytes: the next tensor needs alignment padding
        ("blk.0.ffn_gate_inp.weight", _arr(3, 64), QT.F32),
    ]
    path = tmp_path / "good.gguf"
    written = write_gguf(path, tensors, ALL_KV, arch="olmoe")
    return path, tensors, written


def test_metadata_round_trip(good):
    path, _, _ = good
    with GGUFFile.open(path) as g:
        assert g.arch == "olmoe"
        assert g.paths == (str(path),) and g.path == str(path)
        for key, (kind, value) in ALL_KV.items():
            got = g.metadata[key]
            if kind == "float32":
                assert got == pytest.approx(value) and isinstance(got, float)
            elif kind == "array" and value and isinstance(value[0], float):
                assert got == pytest.approx(value)
            else:
                assert got == value, key
                assert type(got) is type(value), key
        # ints stored by add_array are int32 in gguf-py: make sure sign survived
        assert g.get("t.arr_int", kind=list) == [1, -2, 3]


def test_matches_gguf_py_reader(good):
    """Offsets and shapes agree with gguf-py's own reader (an independent parser)."""
    path, _, _ = good
    ref = gguf.GGUFReader(path)
    with GGUFFile.open(path) as g:
        assert set(g.tensors) == {t.name for t in ref.tensors}
        for rt in ref.tensors:
            t = g.tensors[rt.name]
            assert t.offset == rt.data_offset
            assert t.nbytes == rt.n_bytes
            assert t.shape == tuple(int(n) for n in reversed(rt.shape.tolist()))
            assert t.qtype == int(rt.tensor_type)


def test_tensor_info_and_read(good):
    path, tensors, written = good
    raw = path.read_bytes()
    with GGUFFile.open(path) as g:
        for name, arr, qtype in tensors:
            t = g.tensors[name]
            assert isinstance(t, TensorInfo)
            assert t.qtype == qtype and t.type_name == QT(qtype).name
            assert t.shape == arr.shape  # numpy order
            assert t.offset % 32 == 0
            assert t.nbytes == len(written[name]) == tensor_nbytes(qtype, arr.shape)
            assert raw[t.offset : t.offset + t.nbytes] == written[name]  # absolute offset
            data = g.read(name)
            assert data.dtype == np.uint8 and data.shape == (t.nbytes,)
            assert data.tobytes() == written[name]
            assert data.flags.owndata and data.flags.writeable  # a copy, not a file view
        f32 = g.read("token_embd.weight").view(np.float32).reshape(10, 64)
        np.testing.assert_array_equal(f32, tensors[0][1])
        q = g.read("blk.0.ffn_down_exps.weight")
        deq = gguf.quants.dequantize(q.reshape(3, 5, -1), QT.Q8_0)
        np.testing.assert_allclose(deq, tensors[2][1], atol=0.05)


def test_get_and_tensor_checks(good):
    path, _, _ = good
    with GGUFFile.open(path) as g:
        assert g.get("t.u32", kind=int) == 4_000_000_000
        assert g.get("t.u32", kind=float) == 4e9  # ints are acceptable floats
        assert g.get("nope", 7) == 7
        assert g.get("nope", None, kind=int) is None
        assert g.arch_get("missing_thing", 3) == 3
        with pytest.raises(ModelFileError) as e:
            g.get("nope", kind=int)
        assert e.value.field == "nope" and e.value.got == "missing" and "good.gguf" in str(e.value)
        with pytest.raises(ModelFileError, match="olmoe.block_count"):
            g.arch_get("block_count", kind=int)
        with pytest.raises(ModelFileError, match="t.str"):
            g.get("t.str", kind=int)
        with pytest.raises(ModelFileError, match="t.bool_t"):
            g.get("t.bool_t", kind=int)  # a bool is not an int here
        assert g.get("t.bool_t", kind=bool) is True

        t = g.tensor("blk.0.ffn_down_exps.weight", (3, 5, 64), {QT.Q8_0, QT.Q4_K})
        assert t.shape == (3, 5, 64)
        assert g.tensor("blk.0.ffn_down_exps.weight", (3, None, 64)).shape == (3, 5, 64)
        with pytest.raises(ModelFileError) as e:
            g.tensor("output.weight")
        assert e.value.field == "tensor output.weight" and e.value.got == "missing"
        with pytest.raises(ModelFileError) as e:
            g.tensor("blk.0.ffn_down_exps.weight", (3, 64, 5))
        assert "(3, 64, 5)" in str(e.value) and "(3, 5, 64)" in str(e.value)
        with pytest.raises(ModelFileError) as e:
            g.tensor("blk.0.ffn_down_exps.weight", types=[QT.F32])
        assert "Q8_0" in str(e.value) and "F32" in str(e.value)


def test_close_and_context_manager(good):
    path, _, _ = good
    g = GGUFFile.open(path)
    g.close()
    g.close()  # idempotent
    with pytest.raises(ClosedError):
        g.read("odd")
    with GGUFFile.open(path) as g2:
        assert g2.read("odd").nbytes == 28
    with pytest.raises(ClosedError):
        g2.read("odd")


def test_no_fd_leak_on_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 99) + b"\0" * 64)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(ModelFileError):
            GGUFFile.open(bad)
    assert len(os.listdir("/proc/self/fd")) == before


def test_tensor_nbytes():
    assert tensor_nbytes(QT.F32, (3, 4)) == 48
    assert tensor_nbytes(QT.Q8_0, (2, 64)) == 2 * 2 * 34
    assert tensor_nbytes(QT.Q4_K, (60, 256)) == 60 * 144
    with pytest.raises(ModelFileError, match="block size 256"):
        tensor_nbytes(QT.Q4_K, (4, 1408))
    assert tensor_nbytes(QT.Q5_0, (4, 1408)) == 4 * 44 * 22


def test_expert_layout(tmp_path):
    n_layers, n_exp, ff, d = 2, 4, 8, 64
    tensors = []
    for l in range(n_layers):
        tensors += [
            (f"blk.{l}.ffn_gate_exps.weight", _arr(n_exp, ff, d), QT.Q8_0),
            (f"blk.{l}.ffn_up_exps.weight", _arr(n_exp, ff, d), QT.F16),
            (f"blk.{l}.ffn_down_exps.weight", _arr(n_exp, d, ff * 4), QT.Q8_0),
        ]
    path = tmp_path / "moe.gguf"
    written = write_gguf(path, tensors, {"olmoe.expert_count": ("uint32", n_exp)})
    raw = path.read_bytes()
    with GGUFFile.open(path) as g:
        names = lambda n: [[(f"blk.{l}.ffn_{p}_exps.weight", p) for p in ("gate", "up", "down")] for l in range(n)]
        layout = g.expert_slabs(names(n_layers), n_exp)
        assert layout.n_experts == n_exp and layout.n_layers == n_layers
        assert layout.files == (str(path),)
        for l in range(n_layers):
            for e in range(n_exp):
                slabs = layout.slabs(l, e)
                for slab, part in zip(slabs, ("gate", "up", "down")):
                    full = written[f"blk.{l}.ffn_{part}_exps.weight"]
                    per = len(full) // n_exp
                    assert slab.nbytes == per and slab.path == str(path)
                    assert raw[slab.offset : slab.offset + slab.nbytes] == full[e * per : (e + 1) * per]
            # gate Q8_0 [ff, d], up F16 [ff, d], down Q8_0 [d, 4 ff]: 34 bytes per 32 Q8_0 values
            assert layout.expert_bytes(l) == ff * (d // 32) * 34 + ff * d * 2 + d * (4 * ff // 32) * 34
        with pytest.raises(ModelFileError, match="blk.0.ffn_gate_exps.weight"):
            g.expert_slabs(names(n_layers), n_exp + 1)
        with pytest.raises(ModelFileError, match="blk.2.ffn_gate_exps.weight"):
            g.expert_slabs(names(n_layers + 1), n_exp)


# --------------------------------------------------------------------------------------------
# split models


def _write_split(tmp_path: Path, n_parts: int, prefix: str = "m", total: int | None = None):
    """n_parts parts of 2 tensors each, written by GGUFWriter with llama.cpp's split keys."""
    written, names = {}, []
    n_total = 2 * n_parts if total is None else total
    paths = []
    for i in range(n_parts):
        p = tmp_path / f"{prefix}-{i + 1:05d}-of-{n_parts:05d}.gguf"
        kv = {
            "split.no": ("uint16", i),
            "split.count": ("uint16", n_parts),
            "split.tensors.count": ("int32", n_total),
        }
        if i == 0:
            kv["olmoe.block_count"] = ("uint32", 1)
        else:
            kv["olmoe.block_count"] = ("uint32", 99)  # the first part's value must win
        tensors = [(f"p{i}.t{j}", _arr(3, 32 * (i + j + 1)), [QT.F32, QT.Q8_0][j]) for j in range(2)]
        written.update(write_gguf(p, tensors, kv))
        names += [t[0] for t in tensors]
        paths.append(p)
    return paths, written, names


@pytest.mark.parametrize("n_parts", [2, 3])
def test_split_open_and_read(tmp_path, n_parts):
    paths, written, names = _write_split(tmp_path, n_parts)
    with GGUFFile.open(paths[0]) as g:
        assert g.paths == tuple(str(p) for p in paths)
        assert set(g.tensors) == set(names)
        assert g.get("olmoe.block_count") == 1
        assert g.get("split.no") == 0
        for name in names:
            t = g.tensors[name]
            part = int(name[1])
            assert t.path == str(paths[part])
            assert g.read(name).tobytes() == written[name]
            assert paths[part].read_bytes()[t.offset : t.offset + t.nbytes] == written[name]


def test_split_by_gguf_writer(tmp_path):
    """gguf-py's own sharding (split_max_tensors) uses the same names and keys."""
    w = gguf.GGUFWriter(tmp_path / "sh.gguf", "qwen3moe", split_max_tensors=2)
    arrays = {f"t{i}": _arr(2, 32) for i in range(5)}
    for k, a in arrays.items():
        w.add_tensor(k, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = tmp_path / "sh-00001-of-00003.gguf"
    assert first.exists()
    with GGUFFile.open(first) as g:
        assert len(g.paths) == 3 and g.arch == "qwen3moe"
        for k, a in arrays.items():
            np.testing.assert_array_equal(g.read(k).view(np.float32).reshape(2, 32), a)


def test_split_open_non_first_part(tmp_path):
    paths, _, _ = _write_split(tmp_path, 3)
    with pytest.raises(ModelFileError) as e:
        GGUFFile.open(paths[1])
    msg = str(e.value)
    assert "m-00002-of-00003.gguf" in msg and "split.no" in msg and "m-00001-of-00003.gguf" in msg


def test_split_missing_part(tmp_path):
    paths, _, _ = _write_split(tmp_path, 3)
    paths[2].unlink()
    with pytest.raises(ModelFileError) as e:
        GGUFFile.open(paths[0])
    assert "m-00003-of-00003.gguf" in str(e.value) and e.value.got == "missing"


def test_split_tensor_count_mismatch(tmp_path):
    paths, _, _ = _write_split(tmp_path, 2, total=5)
    with pytest.raises(ModelFileError, match="split.tensors.count"):
        GGUFFile.open(paths[0])


def test_split_renamed_first_part(tmp_path):
    paths, _, _ = _write_split(tmp_path, 2)
    renamed = tmp_path / "model.gguf"
    paths[0].rename(renamed)
    with pytest.raises(ModelFileError, match="file name"):
        GGUFFile.open(renamed)


def test_split_duplicate_tensor_across_parts(tmp_path):
    for i in range(2):
        kv = {"split.no": ("uint16", i), "split.count": ("uint16", 2), "split.tensors.count": ("int32", 2)}
        write_gguf(tmp_path / f"d-{i + 1:05d}-of-00002.gguf", [("same", _arr(4), QT.F32)], kv)
    with pytest.raises(ModelFileError, match="same"):
        GGUFFile.open(tmp_path / "d-00001-of-00002.gguf")


# --------------------------------------------------------------------------------------------
# corrupt files


def _base(**kw) -> RawGGUF:
    g = RawGGUF(**kw)
    g.add("general.architecture", VT.STRING, "olmoe")
    g.add("olmoe.block_count", VT.UINT32, 1)
    g.add("tokenizer.ggml.tokens", VT.ARRAY, ["a", "bc", "d"], VT.STRING)
    g.tensors.append(RawTensor("w", [32, 2], QT.F32, bytes(range(256))))
    g.tensors.append(RawTensor("q", [32, 1], QT.Q8_0, bytes(34)))
    return g


def _open_bad(path: Path, exc: type = ModelFileError, field: str | None = None) -> ModelFileError:
    """The file must be rejected with `exc` naming the file (and the field), without a big allocation."""
    tracemalloc.start()
    try:
        with pytest.raises(ClutorError) as e:
            GGUFFile.open(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert type(e.value) is exc, f"{type(e.value).__name__}: {e.value}"
    assert path.name in str(e.value)
    if field is not None:
        assert field in e.value.field, (field, e.value.field)
    assert peak < 16 << 20, f"peak {peak} bytes while rejecting {path.name}"
    return e.value


def test_raw_builder_is_valid(tmp_path):
    """The corrupt cases below differ from this valid file in one field each."""
    g = _base()
    g.add("t.empty", VT.ARRAY, [], VT.STRING)  # GGUFWriter skips empty arrays; the format allows them
    g.kv.append(("t.nested", int(VT.ARRAY), struct.pack("<IQ", VT.ARRAY, 2)
                + struct.pack("<IQ", VT.INT32, 2) + struct.pack("<2i", 1, 2)
                + struct.pack("<IQ", VT.INT32, 1) + struct.pack("<i", 3)))
    p = g.write(tmp_path / "base.gguf")
    with GGUFFile.open(p) as f:
        assert f.read("w").tobytes() == bytes(range(256))
        assert f.metadata["tokenizer.ggml.tokens"] == ["a", "bc", "d"]
        assert f.metadata["t.empty"] == []
        assert f.metadata["t.nested"] == [[1, 2], [3]]
    assert gguf.GGUFReader(p).tensors[0].name == "w"


def test_truncated_everywhere(tmp_path):
    raw = _base().to_bytes()
    with GGUFFile.open(_base().write(tmp_path / "full.gguf")) as g:
        end = max(t.offset + t.nbytes for t in g.tensors.values())
    assert end == len(raw)
    for cut in list(range(0, end, 7)) + [end - 1]:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(raw[:cut])
        _open_bad(p)
        p.unlink()


def test_every_header_byte_corrupted(tmp_path):
    """Any single corrupt header byte either still parses or raises a ClutorError, never anything else."""
    raw = _base().to_bytes()
    with GGUFFile.open(_base().write(tmp_path / "full.gguf")) as g:
        header_end = min(t.offset for t in g.tensors.values())
    p = tmp_path / "flip.gguf"
    rejected: list[int] = []  # the byte of each corruption refused
    for i in range(header_end):
        for value in (0xFF, raw[i] ^ 0x01):
            flipped = bytearray(raw)
            flipped[i] = value
            p.write_bytes(flipped)
            try:
                GGUFFile.open(p).close()
            except ClutorError as e:
                assert p.name in str(e)
                rejected.append(i)
    # The sweep must detect something: every magic and version byte (0xFF there is never valid), and
    # more besides (a flip elsewhere may land on a value that is still valid, so not every byte).
    assert set(range(8)) <= set(rejected), f"undetected at bytes {sorted(set(range(8)) - set(rejected))}"
    assert len(rejected) > 16, f"only {len(rejected)} of {2 * header_end} corruptions were detected"


def test_wrong_magic(tmp_path):
    _open_bad(_base(magic=b"GGML").write(tmp_path / "magic.gguf"), field="magic")


def test_version_99(tmp_path):
    e = _open_bad(_base(version=99).write(tmp_path / "v99.gguf"), UnsupportedError, "version")
    assert e.got == 99


def test_version_1(tmp_path):
    _open_bad(_base(version=1).write(tmp_path / "v1.gguf"), UnsupportedError, "version")


def test_big_endian(tmp_path):
    raw = bytearray(_base().to_bytes())
    raw[4:8] = struct.pack(">I", 3)
    p = tmp_path / "be.gguf"
    p.write_bytes(raw)
    _open_bad(p, UnsupportedError, "byte order")


def test_huge_string_length(tmp_path):
    g = _base()
    g.kv.insert(1, ("general.name", int(VT.STRING), struct.pack("<Q", 2**62) + b"abc"))
    _open_bad(g.write(tmp_path / "hugestr.gguf"), field="general.name")


def test_string_longer_than_file(tmp_path):
    g = _base()
    g.kv.insert(1, ("general.name", int(VT.STRING), struct.pack("<Q", 5000) + b"abc"))
    _open_bad(g.write(tmp_path / "longstr.gguf"), field="general.name")


def test_huge_key_length(tmp_path):
    raw = bytearray(_base().to_bytes())
    raw[24:32] = struct.pack("<Q", 2**60)  # first key's length
    p = tmp_path / "hugekey.gguf"
    p.write_bytes(raw)
    _open_bad(p, field="metadata key")


@pytest.mark.parametrize("item", [VT.UINT8, VT.UINT64, VT.STRING, VT.ARRAY])
def test_huge_array_count(tmp_path, item):
    g = _base()
    g.kv.insert(1, ("a.b", int(VT.ARRAY), struct.pack("<IQ", item, 2**40) + b"\0" * 16))
    _open_bad(g.write(tmp_path / f"hugearr{int(item)}.gguf"), field="a.b")


def test_array_count_just_past_file(tmp_path):
    g = _base()
    g.kv.insert(1, ("a.b", int(VT.ARRAY), struct.pack("<IQ", VT.UINT32, 10_000) + b"\0" * 16))
    _open_bad(g.write(tmp_path / "arrpast.gguf"), field="a.b")


def test_bad_value_type(tmp_path):
    g = _base()
    g.kv.insert(1, ("a.b", 77, b"\0" * 8))
    _open_bad(g.write(tmp_path / "vtype.gguf"), field="a.b")


def test_bad_bool(tmp_path):
    g = _base()
    g.kv.insert(1, ("a.b", int(VT.BOOL), b"\x07"))
    _open_bad(g.write(tmp_path / "bool.gguf"), field="a.b")


def test_invalid_utf8_key(tmp_path):
    g = _base()
    g.kv.insert(1, ("x", int(VT.UINT8), b"\0"))
    raw = g.to_bytes().replace(struct.pack("<Q", 1) + b"x", struct.pack("<Q", 1) + b"\xff", 1)
    p = tmp_path / "utf8.gguf"
    p.write_bytes(raw)
    _open_bad(p, field="metadata key")


def test_invalid_utf8_token_kept(tmp_path):
    """Token texts are bytes to llama.cpp: invalid UTF-8 survives (surrogateescape), not an error."""
    g = _base()
    bad = b"\xe6\x97 x"  # a multi-byte character cut short
    g.kv.append(("tokenizer.ggml.merges", int(VT.ARRAY), struct.pack("<IQ", VT.STRING, 1) + struct.pack("<Q", 4) + bad))
    with GGUFFile.open(g.write(tmp_path / "tok.gguf")) as f:
        assert f.metadata["tokenizer.ggml.merges"][0].encode("utf-8", "surrogateescape") == bad


def test_huge_n_tensors(tmp_path):
    _open_bad(_base(n_tensors=2**62).write(tmp_path / "ntens.gguf"), field="tensor count")


def test_n_tensors_past_file(tmp_path):
    _open_bad(_base(n_tensors=1000).write(tmp_path / "ntens2.gguf"))


def test_huge_n_kv(tmp_path):
    _open_bad(_base(n_kv=2**40).write(tmp_path / "nkv.gguf"), field="metadata key count")


def test_huge_dimension(tmp_path):
    g = _base()
    g.tensors[0] = RawTensor("w", [32, 2**40], QT.F32, bytes(256))
    e = _open_bad(g.write(tmp_path / "dim.gguf"), field="tensor w")
    assert "past the end" in str(e)


def test_dimension_product_overflow(tmp_path):
    g = _base()
    g.tensors[0] = RawTensor("w", [2**31, 2**31, 2**31, 2**31], QT.F32, bytes(256))
    _open_bad(g.write(tmp_path / "overflow.gguf"), field="tensor w")


@pytest.mark.parametrize("ne", [[32, 0], [32, -1]])
def test_nonpositive_dimension(tmp_path, ne):
    g = _base()
    g.tensors[0] = RawTensor("w", ne, QT.F32, bytes(256))
    _open_bad(g.write(tmp_path / "dim0.gguf"), field="tensor w dimensions")


@pytest.mark.parametrize("n_dims", [0, 7])
def test_bad_n_dims(tmp_path, n_dims):
    g = _base()
    g.tensors[0] = RawTensor("w", [32, 2, 1, 1, 1, 1, 1][:n_dims] or [], QT.F32, bytes(256))
    g.tensors[0].n_dims = n_dims
    _open_bad(g.write(tmp_path / f"ndims{n_dims}.gguf"), field="n_dims")


def test_n_dims_huge(tmp_path):
    g = _base()
    g.tensors[0] = RawTensor("w", [32, 2], QT.F32, bytes(256), n_dims=2**31)
    _open_bad(g.write(tmp_path / "ndimsbig.gguf"), field="n_dims")


def test_offset_past_eof(tmp_path):
    g = _base()
    g.tensors[1].offset, g.tensors[1].place = 1 << 30, False
    e = _open_bad(g.write(tmp_path / "offpast.gguf"), field="tensor q")
    assert "past the end" in str(e)


def test_data_extends_past_eof(tmp_path):
    raw = _base().to_bytes()
    p = tmp_path / "short.gguf"
    p.write_bytes(raw[:-1])
    e = _open_bad(p, field="tensor q")
    assert "past the end" in str(e)


@pytest.mark.parametrize("qtype", [QT.Q8_1, QT.TQ1_0, QT.Q8_K, QT.I32, QT.F64, QT.Q1_0])
def test_unsupported_type(tmp_path, qtype):
    g = _base()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    g.tensors[1] = RawTensor("q", [block, 1], qtype, bytes(size))
    e = _open_bad(g.write(tmp_path / f"type{qtype.name}.gguf"), UnsupportedError, "tensor q type")
    assert qtype.name in str(e)


def test_unknown_type(tmp_path):
    g = _base()
    g.tensors[1] = RawTensor("q", [32, 1], 200, bytes(34))
    e = _open_bad(g.write(tmp_path / "type200.gguf"), ModelFileError, "tensor q type")
    assert "200" in str(e)


def test_supported_types_all_open(tmp_path):
    for qtype in sorted(SUPPORTED_TYPES):
        block, size = gguf.GGML_QUANT_SIZES[QT(qtype)]
        g = _base()
        g.tensors[1] = RawTensor("q", [block * 2, 3], qtype, bytes(range(256)) * (size * 6 // 256 + 1))
        g.tensors[1].data = g.tensors[1].data[: size * 6]
        with GGUFFile.open(g.write(tmp_path / f"ok{qtype}.gguf")) as f:
            t = f.tensor("q")
            assert t.shape == (3, block * 2) and t.nbytes == size * 6
            assert f.read("q").tobytes() == g.tensors[1].data


def test_row_not_multiple_of_block(tmp_path):
    g = _base()
    g.tensors[1] = RawTensor("q", [48, 1], QT.Q8_0, bytes(64))
    _open_bad(g.write(tmp_path / "block.gguf"), field="tensor q row length")


def test_duplicate_tensor_name(tmp_path):
    g = _base()
    g.tensors[1].name = "w"
    _open_bad(g.write(tmp_path / "duptensor.gguf"), field="tensor w")


def test_duplicate_key(tmp_path):
    g = _base()
    g.add("olmoe.block_count", VT.UINT32, 2)
    _open_bad(g.write(tmp_path / "dupkey.gguf"), field="olmoe.block_count")


def test_misaligned_offset(tmp_path):
    g = _base()
    g.tensors[1].offset = 256 + 8
    _open_bad(g.write(tmp_path / "misaligned.gguf"), field="tensor q offset")


def test_overlapping_tensors(tmp_path):
    g = _base()
    g.tensors[1].offset = 224  # inside w's 256 bytes, but aligned
    _open_bad(g.write(tmp_path / "overlap.gguf"), field="offset")


def test_custom_alignment(tmp_path):
    g = _base(alignment=64)
    g.add("general.alignment", VT.UINT32, 64)
    with GGUFFile.open(g.write(tmp_path / "al64.gguf")) as f:
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        assert f.read("w").tobytes() == bytes(range(256))


@pytest.mark.parametrize("value", [0, 48])
def test_bad_alignment(tmp_path, value):
    g = _base()
    g.add("general.alignment", VT.UINT32, value)
    _open_bad(g.write(tmp_path / f"al{value}.gguf"), field="general.alignment")


def test_long_tensor_name(tmp_path):
    g = _base()
    g.tensors[0].name = "x" * 64
    _open_bad(g.write(tmp_path / "longname.gguf"), field="tensor #0 name")


def test_missing_architecture(tmp_path):
    g = _base()
    del g.kv[0]
    _open_bad(g.write(tmp_path / "noarch.gguf"), field="general.architecture")


def test_not_a_file(tmp_path):
    with pytest.raises(ModelFileError, match="missing"):
        GGUFFile.open(tmp_path / "absent.gguf")
    with pytest.raises(ModelFileError, match="directory"):
        GGUFFile.open(tmp_path)


def test_real_vocab_file():
    from conftest import shared_data

    path = shared_data("vocab/ggml-vocab-qwen2.gguf")
    ref = gguf.GGUFReader(path)
    with GGUFFile.open(path) as g:
        assert g.arch == ref.fields["general.architecture"].contents()
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            assert g.metadata[key] == ref.fields[key].contents(), key

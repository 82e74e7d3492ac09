"""The CLI, run in-process: generate, info, chat (scripted input), errors without tracebacks."""
from __future__ import annotations

import io
import json
import sys

import pytest

from clutor.cli import COMMANDS, main
from conftest import fixture_path


def test_every_command_has_help_with_an_example(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "example" in out.lower(), name


def test_clutor_alone_prints_the_overview(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["clutor"])
    assert main() == 0
    cap = capsys.readouterr()
    assert cap.err == "" and "Run Mixture-of-Experts GGUF models" in cap.out
    for name in COMMANDS:
        assert name in cap.out, name


def test_info(capsys):
    assert main(["info", str(fixture_path("qwen2moe", "Q4_K_M"))]) == 0
    out = capsys.readouterr().out
    assert "qwen2moe" in out and "shared expert" in out and "Q4_K" in out
    assert "kernels         F32, Q4_K, Q5_K, Q6_K, Q8_0\n" in out  # every type of the file has a kernel
    assert main(["info", "--json", str(fixture_path("olmoe", "Q8_0"))]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["arch"] == "olmoe"
    assert d["expert_bytes_per_token_worst"] == d["expert_bytes_one"] * d["config"]["n_expert_used"] * d["config"]["n_layers"]
    assert d["dense_bytes"] + d["expert_bytes_total"] <= sum(v["bytes"] for v in d["tensor_types"].values())


def test_info_names_the_types_without_a_kernel(capsys, tmp_path, monkeypatch):
    """A type without a kernel on this machine (Q3_K made so here: every type Clutor reads has one
    on x86 with AVX2) works but is dequantised on every product: `clutor info` says so, and lists the
    types that do have one."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

    from gguf_util import copy_gguf
    from clutor.model import kernels

    has = kernels.has_kernel
    monkeypatch.setattr(kernels, "has_kernel", lambda q: int(q) != int(QT.Q3_K) and has(q))

    block, nbytes = GGML_QUANT_SIZES[QT.Q3_K]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(256, 256 // block * nbytes), dtype=np.uint8)  # [rows, row_bytes]
    raw[:, 108:110] = np.array([0.01], np.float16).view(np.uint8)  # the f16 super-block scale
    path = tmp_path / "q3k.gguf"
    copy_gguf(fixture_path("qwen2moe", "Q4_K_M"), path,
              retype={f"blk.{i}.attn_output.weight": (QT.Q3_K, raw) for i in range(2)})
    assert main(["info", str(path)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("kernels "))
    assert line.split(None, 1)[1] == ("F32, Q4_K, Q6_K, Q8_0; no kernel for Q3_K: dequantised on every product (slow)")
    assert main(["info", "--json", str(path)]) == 0
    types = json.loads(capsys.readouterr().out)["tensor_types"]
    assert {k: v["kernel"] for k, v in types.items()} == {"F32": True, "Q3_K": False, "Q4_K": True, "Q6_K": True,
                                                           "Q8_0": True}


def test_info_lists_every_type_and_how_it_runs_here(capsys):
    """`clutor info` lists every type Clutor reads with how its products run on this machine."""
    from clutor.model import kernels
    from clutor.model.weight_types import TYPES

    assert main(["info", "--json", str(fixture_path("olmoe", "Q8_0"))]) == 0
    m = json.loads(capsys.readouterr().out)["machine"]
    assert set(m["types"]) == {t.name for t in TYPES.values()}
    for q, t in TYPES.items():
        assert (m["types"][t.name] == "dequantised per product") == (not kernels.has_kernel(q)), t.name
    if kernels.mode() == "q8":  # x86 with AVX2: every quantised type takes the int8 path
        assert all(m["types"][t.name] == "int8" for t in TYPES.values() if t.q8_block), m
    assert main(["info", str(fixture_path("olmoe", "Q8_0"))]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("this machine"))
    assert all(t.name in line for t in TYPES.values()) and m["backend"] in line


def test_generate_streams_text_and_stats(capsys):
    rc = main(["generate", str(fixture_path("olmoe", "F16")), "The quick brown fox", "-n", "6",
               "--temperature", "0", "--ignore-eos"])
    assert rc == 0
    cap = capsys.readouterr()
    assert cap.out.strip() != ""
    assert "tok/s decode" in cap.err and "6 generated" in cap.err


def test_generate_reads_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time"))
    assert main(["generate", str(fixture_path("qwen3moe", "Q8_0")), "-", "-n", "3", "--temperature", "0",
                 "--ignore-eos"]) == 0
    assert "3 generated" in capsys.readouterr().err


def test_chat_scripted(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\nHow are you?\n/exit\nnot read\n"))
    rc = main(["chat", str(fixture_path("qwen3moe", "F16")), "-n", "5", "--temperature", "0", "--ignore-eos"])
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("5 generated") == 2  # two replies, then /exit


@pytest.mark.parametrize("content", [b"", b"NOPE" + b"\0" * 64, b"GGUF\x03\0\0\0" + b"\xff" * 40])
def test_bad_file_is_a_message_not_a_traceback(capsys, tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    for cmd in (["info", str(bad)], ["generate", str(bad), "hi"]):
        assert main(cmd) == 1
        # (on a fresh checkout the kernels compile first, and the command says so before and after)
        err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True)
                      if not line.startswith(("clutor: compiling the compute kernels", "clutor: compute kernels ready")))
        assert err.startswith("clutor: error: ") and "bad.gguf" in err and "Traceback" not in err


def test_missing_file(capsys, tmp_path):
    assert main(["info", str(tmp_path / "nope.gguf")]) == 1
    assert "nope.gguf" in capsys.readouterr().err


def test_chat_keeps_going_when_the_conversation_outgrows_the_context(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    turns = "".join(f"Tell me more about topic number {i}, please.\n" for i in range(6))
    monkeypatch.setattr(sys, "stdin", io.StringIO(turns + "x " * 400 + "\n/exit\n"))
    rc = main(["chat", str(fixture_path("qwen3moe", "Q8_0")), "-n", "24", "--temperature", "0", "--ignore-eos",
               "--n-ctx", "96"])
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("generated") == 6  # every turn answered: old turns dropped to make room
    assert "does not fit" in err  # the over-long message is refused, the chat goes on to /exit


def test_the_demo_explains_itself(tmp_path, monkeypatch, capsys):
    """Random weights said up front, a legend for every figure of the report, the model's size and
    path, and what to run next (the demo's own model, at a tiny size)."""
    from clutor.cli import demo_model
    from conftest import tiny_demo_spec

    real = demo_model.ensure_demo_model
    monkeypatch.setattr(demo_model, "ensure_demo_model", lambda d, **kw: real(d, spec=tiny_demo_spec(), **kw))
    assert main(["demo", "-n", "3", "--cache-dir", str(tmp_path), "--expert-cache", "100%"]) == 0
    out, err = capsys.readouterr()
    (path,) = tmp_path.glob("*.gguf")
    assert out.startswith("Once upon a time")
    assert f"built here once (nothing was downloaded): {path}" in " ".join(err.split())
    assert "random: the text is gibberish by design" in " ".join(err.split())
    assert err.index("gibberish") < err.index("prompt tokens") < err.index("how to read the report")
    for figure in ("prefill / decode", "hit rate", "read N = N/token", "waiting on disk", "peak RSS",
                   "direct = O_DIRECT"):
        assert figure in err, figure
    assert "clutor pull " in err and "clutor chat " in err and f"DEMO = {path}" in err


def test_generate_with_a_draft_model_gives_the_same_text(capsys):
    """-md (llama.cpp's flag, and its --spec-draft-n-max): greedy text as without it, drafts in the report."""
    model, draft = str(fixture_path("olmoe", "Q8_0")), str(fixture_path("olmoe", "Q4_K_M"))
    common = ["generate", model, "The quick brown fox", "-n", "12", "--temperature", "0", "--ignore-eos",
              "--activations", "q8"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main(common + ["-md", draft, "--spec-draft-n-max", "4", "--draft-p-min", "0"]) == 0
    cap = capsys.readouterr()
    assert cap.out == plain
    assert "drafted" in cap.err


@pytest.mark.parametrize("flags,said", [(["--speculative", "draft"], "-md/--model-draft"),
                                        (["-md", "DRAFT", "--draft-p-min", "1.5"], "--draft-p-min"),
                                        (["-md", "nope.gguf"], "nope.gguf")])
def test_draft_flags_refused_with_the_flag_named(capsys, flags, said):
    flags = [str(fixture_path("olmoe", "Q4_K_M")) if f == "DRAFT" else f for f in flags]
    assert main(["generate", str(fixture_path("olmoe", "Q8_0")), "hi", "-n", "2"] + flags) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err

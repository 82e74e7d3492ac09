"""`clutor pull / list / rm` and `-hf REPO[:QUANT]`, with the real huggingface_hub client and no network:
a Hub on 127.0.0.1 (tests/hub_util.py: the API, /resolve/ and a CDN on another origin, as huggingface.co
answers) and Hub cache directories, downloaded into or laid out by hand."""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import gguf
import pytest

pytest.importorskip("huggingface_hub", reason="huggingface_hub is one of Clutor's dependencies")
from huggingface_hub import scan_cache_dir  # noqa: E402

from clutor import hub  # noqa: E402
from clutor.cli import main  # noqa: E402
from conftest import fixture_path  # noqa: E402
from gguf_util import copy_gguf  # noqa: E402
from hub_util import FakeHub, Repo  # noqa: E402

REPO = "tiny/OLMoE-GGUF"
GATED = "tiny/gated-GGUF"
TOKEN = "hf_test_secret"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    """A GGUF repo as they are published: single files per quant, a split set in a folder, a projector
    and a README that are not models."""
    d = tmp_path_factory.mktemp("split")
    src = fixture_path("qwen3moe", "Q6_K")
    n = len(gguf.GGUFReader(src).tensors)
    copy_gguf(src, d / "m.gguf", split_max_tensors=math.ceil(n / 2))
    return {
        "README.md": b"# tiny OLMoE\n",
        "OLMoE-tiny-Q8_0.gguf": fixture_path("olmoe", "Q8_0").read_bytes(),
        "OLMoE-tiny-Q4_K_M.gguf": fixture_path("olmoe", "Q4_K_M").read_bytes(),
        "Q6_K/OLMoE-tiny-Q6_K-00001-of-00002.gguf": (d / "m-00001-of-00002.gguf").read_bytes(),
        "Q6_K/OLMoE-tiny-Q6_K-00002-of-00002.gguf": (d / "m-00002-of-00002.gguf").read_bytes(),
        "mmproj-OLMoE-tiny-F16.gguf": b"GGUF not a model",
    }


@pytest.fixture(scope="module")
def fake_hub(files):
    h = FakeHub({REPO: Repo(dict(files)),
                 GATED: Repo({"g-Q8_0.gguf": files["OLMoE-tiny-Q8_0.gguf"]}, commit="f" * 40, token=TOKEN)})
    yield h
    h.close()


@pytest.fixture
def cache(tmp_path, monkeypatch, fake_hub) -> Path:
    """A fresh Hub cache, HF_ENDPOINT at the fake Hub, no token, online."""
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    fake_hub.requests.clear()
    return tmp_path / "hub"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _one_error_line(err: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("clutor: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err


# -- names -----------------------------------------------------------------------------------------
NAMES = {p: 1 for p in ("README.md", "Model-Q4_K_M.gguf", "Model-IQ4_XS.gguf", "Model-Q8_0.gguf",
                        "mmproj-Model-F16.gguf", "Model.imatrix.gguf",
                        "Q6_K/Model-Q6_K-00001-of-00002.gguf", "Q6_K/Model-Q6_K-00002-of-00002.gguf",
                        "UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00003.gguf",
                        "UD-Q4_K_XL/Model-UD-Q4_K_XL-00002-of-00003.gguf",
                        "UD-Q4_K_XL/Model-UD-Q4_K_XL-00003-of-00003.gguf")}


def _pick(quant: str | None, names=NAMES) -> tuple[str, ...]:
    return hub.choose(hub.gguf_sets(names), hub.HubRef("o/r", quant)).files


def test_a_quant_names_its_files_as_llama_cpp_resolves_them():
    assert _pick(None) == ("Model-Q4_K_M.gguf",)  # no tag: Q4_K_M, then Q8_0
    assert _pick(None, {p: 1 for p in NAMES if "Q4_K_M" not in p}) == ("Model-Q8_0.gguf",)
    assert _pick(None, {"a-F16.gguf": 1, "mmproj-b.gguf": 1}) == ("a-F16.gguf",)  # else the first model
    assert _pick("q6_k") == ("Q6_K/Model-Q6_K-00001-of-00002.gguf", "Q6_K/Model-Q6_K-00002-of-00002.gguf")
    assert len(_pick("UD-Q4_K_XL")) == 3 and _pick("Q4_K_XL") == _pick("UD-Q4_K_XL")
    assert _pick("IQ4_XS") == ("Model-IQ4_XS.gguf",)
    with pytest.raises(hub.ClutorError, match="no Q4_XS model in o/r; it has: IQ4_XS.*Q4_K_M.*Q8_0.*Q6_K"):
        _pick("Q4_XS")  # a tag is a whole word: IQ4_XS is not Q4_XS
    assert _pick("Q6_K/Model-Q6_K-00001-of-00002.gguf")[1].endswith("00002-of-00002.gguf")  # a file by its path
    with pytest.raises(hub.ClutorError, match="no GGUF model in this repo"):
        _pick(None, {"README.md": 1, "mmproj-x.gguf": 1})
    incomplete = hub.gguf_sets({"Q6_K/Model-Q6_K-00001-of-00002.gguf": 5})[0]
    assert not incomplete.complete and incomplete.parts == 2 and incomplete.quant == "Q6_K"


def test_names_on_the_command_line(tmp_path, monkeypatch):
    assert hub.parse_ref("Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M") == hub.HubRef("Qwen/Qwen3-30B-A3B-GGUF", "Q4_K_M")
    assert hub.parse_ref("a/b") == hub.HubRef("a/b")
    for bad in ("justaname", "a/b/c", "a/b:", "/b", "a/:x"):
        with pytest.raises(hub.ClutorError):
            hub.parse_ref(bad)
    # names only the Hub's own validator refuses: one line naming its rule, no traceback
    for bad, rule in (("a" * 100 + "/b", "maximum length is 96"), ("a/" + "b" * 100 + ":Q4_K_M", "maximum length"),
                      ("a/b--c", "Cannot have -- or .."), ("a/.b", "cannot start or end")):
        with pytest.raises(hub.ClutorError, match=rule) as e:
            hub.parse_ref(bad)
        assert "\n" not in str(e.value) and len(str(e.value)) < 400
    assert main(["pull", "a/" + "b" * 100]) == 1
    assert hub.looks_like_ref("a/b:Q8_0") and hub.looks_like_ref("a/b")
    assert not hub.looks_like_ref("models/x.gguf")  # a missing file stays a file, and its error names it
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert not hub.looks_like_ref("a/b")  # a file that exists is a file


# -- pull ------------------------------------------------------------------------------------------
def test_pull_downloads_one_quant_into_the_hub_cache(cache, fake_hub, files, capsys):
    assert main(["pull", f"{REPO}:Q8_0"]) == 0
    out, err = capsys.readouterr()
    path = Path(out.strip())
    commit = fake_hub.repos[REPO].commit
    root = cache / "models--tiny--OLMoE-GGUF"
    data = files["OLMoE-tiny-Q8_0.gguf"]
    assert path == root / "snapshots" / commit / "OLMoE-tiny-Q8_0.gguf"
    assert path.is_symlink() and os.readlink(path) == f"../../blobs/{_sha(data)}"  # the Hub cache's layout
    assert path.read_bytes() == data and (root / "refs" / "main").read_text() == commit
    assert f"{REPO}:Q8_0" in err and "downloading OLMoE-tiny-Q8_0.gguf" in err
    # what huggingface_hub asked, as of the real Hub
    asked = [(r.origin, r.method, r.path.split("?")[0]) for r in fake_hub.requests]
    assert ("hub", "GET", f"/api/models/{REPO}/revision/main") in asked
    assert ("hub", "HEAD", f"/{REPO}/resolve/{commit}/OLMoE-tiny-Q8_0.gguf") in asked
    assert [a for a in asked if a[0] == "cdn"] == [("cdn", "GET", f"/blob/{_sha(data)}")]  # that quant alone
    # huggingface_hub's own scanner reads what was written
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and {f.file_name for r in repo.revisions for f in r.files} == {"OLMoE-tiny-Q8_0.gguf"}
    fake_hub.requests.clear()
    assert main(["pull", f"{REPO}:Q8_0"]) == 0  # again: asks the Hub what is current, downloads nothing
    assert not fake_hub.asked("cdn") and "cached" in capsys.readouterr().err


def test_default_quant_split_sets_and_hf_on_the_commands(cache, fake_hub, capsys):
    assert main(["pull", REPO]) == 0
    assert Path(capsys.readouterr().out.strip()).name == "OLMoE-tiny-Q4_K_M.gguf"  # llama.cpp's default
    assert main(["pull", f"{REPO}:q6_k"]) == 0
    first = Path(capsys.readouterr().out.strip())
    assert first.name == "OLMoE-tiny-Q6_K-00001-of-00002.gguf"
    assert (first.parent / "OLMoE-tiny-Q6_K-00002-of-00002.gguf").is_file()  # every part of the set
    fake_hub.requests.clear()
    assert main(["info", "-hf", f"{REPO}:Q6_K"]) == 0
    out, err = capsys.readouterr()
    assert "(+1 parts)" in out and "qwen3moe" in out and "from the Hub cache" in err
    assert main(["info", f"{REPO}:Q6_K", "--json"]) == 0  # the name as MODEL, as ollama and mlx-lm take it
    assert len(json.loads(capsys.readouterr().out)["files"]) == 2
    assert fake_hub.requests == []  # a cached model runs without the network


def test_hf_downloads_what_is_missing_then_runs(cache, fake_hub, capsys):
    assert main(["generate", "-hf", f"{REPO}:Q8_0", "Hello", "-n", "2", "--temperature", "0", "--ignore-eos",
                 "--io", "memory"]) == 0
    out, err = capsys.readouterr()
    assert "downloading OLMoE-tiny-Q8_0.gguf" in err and "2 generated" in err
    assert main(["generate", "-m", str(fixture_path("olmoe", "Q8_0")), "Hello", "-n", "2", "--temperature", "0",
                 "--ignore-eos", "--io", "memory"]) == 0  # -m FILE TEXT: TEXT is the prompt
    assert capsys.readouterr().out == out  # the same file, the same greedy text


def test_list_and_rm(cache, fake_hub, files, capsys):
    assert main(["pull", f"{REPO}:Q8_0"]) == 0 and main(["pull", f"{REPO}:Q6_K"]) == 0
    capsys.readouterr()
    assert main(["list", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert set(listed) == {f"{REPO}:Q8_0", f"{REPO}:Q6_K"}
    q6 = listed[f"{REPO}:Q6_K"]
    assert len(q6["files"]) == 2 and q6["complete"] and q6["refs"] == ["main"]
    assert q6["bytes"] == sum(len(files[f]) for f in files if "Q6_K" in f)
    assert main(["list"]) == 0
    table = capsys.readouterr().out
    assert f"{REPO}:Q8_0" in table and "2 models" in table

    blob8 = cache / "models--tiny--OLMoE-GGUF" / "blobs" / _sha(files["OLMoE-tiny-Q8_0.gguf"])
    assert blob8.exists()
    assert main(["rm", f"{REPO}:Q8_0"]) == 0
    assert "1 file," in capsys.readouterr().err and not blob8.exists()
    assert main(["list", "--json"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)] == [f"{REPO}:Q6_K"]
    assert main(["rm", f"{REPO}:Q8_0"]) == 1  # not cached any more: one line saying so
    _one_error_line(capsys.readouterr().err)
    assert main(["rm", REPO]) == 0 and not (cache / "models--tiny--OLMoE-GGUF").exists()
    assert main(["rm", REPO]) == 1
    _one_error_line(capsys.readouterr().err)


def test_offline_and_unreachable_use_the_cache(cache, fake_hub, monkeypatch, capsys):
    assert main(["pull", f"{REPO}:Q6_K"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    assert main(["pull", f"{REPO}:Q6_K"]) == 0
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    assert main(["pull", f"{REPO}:Q8_0"]) == 1
    err = capsys.readouterr().err
    _one_error_line(err)
    assert "cannot reach" in err and "holds only Q6_K" in err
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.requests.clear()
    assert main(["info", "--offline", "-hf", f"{REPO}:Q6_K"]) == 0
    assert main(["pull", f"{REPO}:Q8_0"]) == 1 and "offline" in capsys.readouterr().err
    assert fake_hub.requests == []


def test_an_interrupted_download_resumes(cache, fake_hub, files):
    data = files["OLMoE-tiny-Q4_K_M.gguf"]
    # within one run: the connection drops and huggingface_hub tries again (from the last 10 MB chunk
    # it wrote: here, from the start)
    fake_hub.cut_after = 100_000
    path = hub.pull(f"{REPO}:Q4_K_M", say=None)
    assert path.read_bytes() == data and len(fake_hub.asked("cdn", "GET")) == 2
    # across runs: the partial blob an interrupted process left is continued, not thrown away
    hub.remove(f"{REPO}:Q4_K_M")
    blobs = cache / "models--tiny--OLMoE-GGUF" / "blobs"
    half = len(data) // 2
    (blobs / f"{_sha(data)}.incomplete").write_bytes(data[:half])
    fake_hub.requests.clear()
    fake_hub.served_bytes = 0
    assert hub.pull(f"{REPO}:Q4_K_M", say=None).read_bytes() == data
    (get,) = fake_hub.asked("cdn", "GET")
    assert get.headers.get("range") == f"bytes={half}-" and fake_hub.served_bytes == len(data) - half
    assert not list(blobs.glob("*.incomplete"))


def test_a_gated_repo_needs_hf_token(cache, fake_hub, monkeypatch, capsys):
    assert main(["pull", GATED]) == 1
    err = capsys.readouterr().err
    _one_error_line(err)
    assert "HF_TOKEN" in err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    fake_hub.requests.clear()
    assert main(["pull", GATED]) == 0
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in fake_hub.asked("hub"))
    assert fake_hub.asked("cdn") and not any("authorization" in r.headers for r in fake_hub.asked("cdn"))


def test_unknown_repos_and_quants_are_one_line(cache, capsys):
    for name, says in ((f"{REPO}:Q2_K", "no Q2_K model in tiny/OLMoE-GGUF; it has: Q4_K_M"),
                       ("tiny/nothing-GGUF", "no such model on"), ("not-a-name", "expected a Hugging Face model")):
        assert main(["pull", name]) == 1
        err = capsys.readouterr().err
        _one_error_line(err)
        assert says in err, err


def test_a_hub_cache_laid_out_by_hand(tmp_path, monkeypatch, capsys):
    """The cache another tool (hf download, llama.cpp) filled: found by name, listed, removed, offline."""
    data = fixture_path("olmoe", "Q8_0").read_bytes()
    commit = "c" * 40
    root = tmp_path / "hub" / "models--acme--Tiny-GGUF"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / _sha(data)).write_bytes(data)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "Tiny-Q8_0.gguf").symlink_to(f"../../blobs/{_sha(data)}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the network is never needed
    assert main(["list"]) == 0
    assert "acme/Tiny-GGUF:Q8_0" in capsys.readouterr().out
    assert main(["info", "acme/Tiny-GGUF:Q8_0"]) == 0
    assert "olmoe" in capsys.readouterr().out
    assert main(["rm", "acme/Tiny-GGUF:Q8_0"]) == 0
    assert not (snap / "Tiny-Q8_0.gguf").exists() and not (root / "blobs" / _sha(data)).exists()

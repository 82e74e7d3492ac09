"""llama-server's own routes (/tokenize, /detokenize, /apply-template, /props, /slots) answer as
llama-server does: each request of tools/record_llama_server.py is sent to clutor serve on the same
file and compared with llama-server's recorded answer (tests/golden/llama_server/): the same token ids,
pieces, text and rendered prompt; the same fields in /props and /slots, with the model's facts equal."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.server import create_app  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "llama_server"
MODEL = fixture_path("qwen3moe", "Q8_0")  # the file tools/record_llama_server.py asks llama-server about
CASES = sorted(p.stem for p in GOLDEN.glob("*.json"))


def _golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def client():
    s = LiveServer(create_app(clutor.Model.open(MODEL, io="memory", n_ctx=512), served_model_name="tiny",
                              max_sequences=2))
    with httpx.Client(base_url=s.url, timeout=60) as c:
        yield c
    s.stop()


def _ask(client, rec: dict) -> httpx.Response:
    r = rec["request"]
    return client.request(r["method"], r["path"], json=r["body"]) if r["body"] is not None else \
        client.request(r["method"], r["path"])


def test_every_recorded_route_is_here():
    assert {"tokenize", "detokenize", "apply_template", "props", "slots"} <= set(CASES)


@pytest.mark.parametrize("name", [c for c in CASES if c not in ("props", "slots")])
def test_the_answer_equals_llama_servers(client, name):
    rec = _golden(name)
    r = _ask(client, rec)
    assert r.status_code == rec["status"], r.text
    assert r.json() == rec["answer"]


def test_props_has_llama_servers_fields_and_the_models_facts(client):
    want = _golden("props")["answer"]
    got = client.get("/props").json()
    assert set(got) >= set(want) - {"chat_template_tool_use"}
    assert set(got["default_generation_settings"]) == set(want["default_generation_settings"])
    assert set(got["default_generation_settings"]["params"]) <= set(want["default_generation_settings"]["params"])
    for key in ("total_slots", "model_ftype", "modalities", "chat_template", "bos_token", "eos_token", "is_sleeping"):
        assert got[key] == want[key], key
    assert got["default_generation_settings"]["n_ctx"] == want["default_generation_settings"]["n_ctx"]
    assert set(got["chat_template_caps"]) == set(want["chat_template_caps"])
    assert got["chat_template_caps"] == want["chat_template_caps"]
    for k in ("top_k", "top_p", "min_p", "repeat_last_n", "n_predict"):
        assert got["default_generation_settings"]["params"][k] == pytest.approx(
            want["default_generation_settings"]["params"][k]), k
    assert got["model_alias"] == "tiny" and got["model_path"].endswith(MODEL.name)


def test_slots_lists_each_sequence_as_llama_server_does(client):
    want = _golden("slots")["answer"]
    assert client.get("/slots").json() == want


def test_posting_props_is_refused_as_llama_server_without_props(client):
    r = client.post("/props", json={})
    assert r.status_code == 501


@pytest.mark.parametrize("path,body,field", [
    ("/detokenize", {"tokens": [5, 100000]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["a", 99999]}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/apply-template", {"messages": "hi"}, "messages"),
])
def test_bad_values_are_a_400_naming_the_field(client, path, body, field):
    """(llama-server answers an id outside the vocabulary with a 500.)"""
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field

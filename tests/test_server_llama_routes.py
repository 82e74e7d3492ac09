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
    assert {"tokenize", "detokenize", "apply_template", "props", "slots", "completion"} <= set(CASES)


@pytest.mark.parametrize("name", [c for c in CASES if c not in ("props", "slots") and not c.startswith("completion")])
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


def _shape(x):
    """A value's JSON shape: the keys of objects (recursively), the type of the rest."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    return "number" if isinstance(x, (int, float)) and not isinstance(x, bool) else type(x).__name__


@pytest.mark.parametrize("name", ["completion", "completion_stop"])
def test_completion_answers_in_llama_servers_fields(client, name):
    """/completion: the same greedy text, counts, stop type and stopping word as llama-server on this file,
    and its reply's fields (generation_settings: those clutor has, a subset of llama-server's)."""
    rec = _golden(name)
    r = _ask(client, rec)
    assert r.status_code == rec["status"], r.text
    got, want = r.json(), rec["answer"]
    for k in ("content", "tokens", "stop", "tokens_predicted", "tokens_evaluated", "prompt", "has_new_line",
              "truncated", "stop_type", "stopping_word", "tokens_cached"):
        assert got[k] == want[k], k
    assert set(got) == set(want)
    assert set(got["timings"]) >= set(want["timings"])
    assert set(got["generation_settings"]) <= set(want["generation_settings"])
    settings = {k: _shape(v) for k, v in got["generation_settings"].items()}
    assert settings == {k: _shape(want["generation_settings"][k]) for k in settings}
    assert got["generation_settings"]["n_predict"] == want["generation_settings"]["n_predict"]


def test_a_streamed_completion_sends_llama_servers_events(client):
    rec = _golden("completion_stream")
    events = []
    with client.stream("POST", "/completion", json=rec["request"]["body"]) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert not any("[DONE]" in line for line in lines)  # (llama-server's native stream has none)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    want = rec["answer"]
    assert [e["content"] for e in events[:-1]] == [e["content"] for e in want[:-1]]
    assert [e["tokens"] for e in events[:-1]] == [e["tokens"] for e in want[:-1]]
    assert [set(e) for e in events[:-1]] == [set(e) for e in want[:-1]]
    assert [e["tokens_predicted"] for e in events[:-1]] == [e["tokens_predicted"] for e in want[:-1]]
    last, want_last = events[-1], want[-1]
    assert set(last) == set(want_last) and last["stop"] is True and last["content"] == ""
    assert last["stop_type"] == want_last["stop_type"] and last["tokens_predicted"] == want_last["tokens_predicted"]


def test_completion_takes_a_grammar_and_n_probs(client):
    r = client.post("/completion", json={"prompt": "Answer:", "n_predict": 12, "temperature": 0,
                                         "grammar": 'root ::= "yes" | "no"', "n_probs": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["content"] in ("yes", "no")
    probs = out["completion_probabilities"]
    assert probs and all(len(p["top_logprobs"]) == 2 and {"id", "token", "bytes", "logprob"} <= set(p) for p in probs)


@pytest.mark.parametrize("body,field", [({"prompt": "hi", "n_predict": 0}, "n_predict"),
                                        ({"prompt": 5}, "prompt"), ({"prompt": "hi", "n_probs": 50}, "n_probs"),
                                        ({"prompt": "hi", "cache_prompt": "yes"}, "cache_prompt"),
                                        ({"prompt": ["a", [1, 2]]}, "prompt")])
def test_bad_completion_fields_are_a_400_naming_them(client, body, field):
    r = client.post("/completion", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field

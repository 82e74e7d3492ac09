"""Speculative decoding over HTTP: the request's `speculative` / `n_draft` fields (llama-server's), the
reply's timings draft_n / draft_n_accepted, the /metrics counters, and the model's own setting as the
default.

The server's model drafts by default (Model.open(speculative="ngram")), so a request without the field
shows the default is the model's; "off" is the baseline every drafted reply must equal token for token
(int8 activations: a row's logits do not depend on the rows verified beside it).
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.server import create_app  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

MODEL = fixture_path("olmoe", "Q8_0")
OPEN = dict(io="memory", n_ctx=512, activations="q8", speculative="ngram")
# ids that repeat: prompt lookup has matches from the first step
PROMPT = "The expert cache streams weights from the disk. " * 6


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name="tiny", max_sequences=4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def _complete(c: httpx.Client, **kw) -> dict:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 30, "temperature": 0,
                                         "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_drafted_greedy_replies_equal_the_undrafted_one(client):
    base = _complete(client, speculative="off")
    assert "draft_n" not in base["timings"]  # (as llama-server: only when something was drafted)
    text = base["choices"][0]["text"]
    assert base["usage"]["completion_tokens"] == 30
    drafted = 0
    for kw in ({"speculative": {"n_max": 8}}, {"n_draft": 4}, {"speculative.n_max": 6, "speculative.p_min": 0.5},
               {"speculative": {"n_max": 8, "type": "ngram", "adaptive": False, "ngram_min": 1}}, {}):
        got = _complete(client, **kw)
        assert got["choices"][0]["text"] == text, kw
        t = got["timings"]
        assert t["predicted_n"] == 30
        if "draft_n" in t:
            assert 0 <= t["draft_n_accepted"] <= t["draft_n"], kw
            drafted += t["draft_n"]
    assert drafted > 0
    for off in ({"n_draft": 0}, {"speculative": False}, {"speculative": {"n_max": 0}},
                {"speculative": {"type": "off", "n_max": 8}}):
        assert "draft_n" not in _complete(client, **off)["timings"], off


def test_the_metrics_count_what_the_replies_drafted(srv, client):
    m0 = srv.metrics()
    assert "clutor_draft_tokens_total" in m0 and "clutor_draft_tokens_accepted_total" in m0
    t = _complete(client, speculative={"n_max": 8, "adaptive": False})["timings"]
    assert t["draft_n"] > 0
    m1 = srv.metrics()
    assert m1["clutor_draft_tokens_total"] - m0["clutor_draft_tokens_total"] == t["draft_n"]
    assert m1["clutor_draft_tokens_accepted_total"] - m0["clutor_draft_tokens_accepted_total"] == t["draft_n_accepted"]


def test_a_streamed_chat_reply_carries_the_draft_figures(client):
    """The chat route takes n_draft too; the stream's last chunk has the timings, drafts included."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30,
            "temperature": 0}
    r = client.post("/v1/chat/completions", json={**body, "n_draft": 0})
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["message"]["content"]
    text, timings = [], None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "n_draft": 8}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                text += [ch["delta"].get("content") or "" for ch in ev["choices"]]
                timings = ev.get("timings", timings)
    assert "".join(text) == want
    assert timings["predicted_n"] == 30 and timings["draft_n"] > 0  # (the reply loops: lookup drafts it)


@pytest.mark.parametrize("extra,param", [
    ({"speculative": {"n_max": -1}}, "speculative.n_max"),
    ({"speculative": {"type": "eagle"}}, "speculative.type"),
    ({"speculative": 5}, "speculative"),
    ({"speculative": "eagle"}, "speculative"),
    ({"speculative": {"n_max": 65}}, "speculative.n_max"),
    ({"speculative": {"n_min": 4, "n_max": 2}}, "speculative"),
    ({"speculative": {"p_min": 2}}, "speculative.p_min"),
    ({"speculative": {"draft": 4}}, "speculative"),
    ({"speculative.n_min": "x"}, "speculative.n_min"),
    ({"n_draft": -1}, "n_draft"),
    ({"n_draft": True}, "n_draft"),
])
def test_bad_values_are_a_400_naming_the_field(client, extra, param):
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/responses", {"input": "hi"})):
        r = client.post(route, json={"model": "tiny", "max_tokens": 2, **body, **extra})
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (route, err)
    r = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user",
                                                                                           "content": "hi"}], **extra})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text  # (Anthropic's shape names no field)


def test_a_draft_type_without_a_draft_model_is_a_400(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                             "speculative": {"type": "draft"}})
    assert r.status_code == 400, r.text
    assert "draft model" in r.json()["error"]["message"]


def test_a_server_with_a_draft_model_drafts_with_it_by_default():
    """Model.open(draft_model=...): a request's fields without a type use the draft model (its p_min
    too); the replies equal the undrafted one."""
    s = LiveServer(create_app(clutor.Model.open(MODEL, io="memory", n_ctx=512, activations="q8",
                                                draft_model=fixture_path("olmoe", "Q4_K_M")),
                              served_model_name="tiny", max_sequences=4))
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            text = _complete(c, speculative="off")["choices"][0]["text"]
            for kw in ({}, {"speculative": {"n_max": 4, "p_min": 0.0}}, {"speculative": {"type": "draft"}},
                       {"speculative": {"n_max": 4, "p_min": 1.0}}):
                got = _complete(c, **kw)
                assert got["choices"][0]["text"] == text, kw
                if kw.get("speculative", {}).get("p_min") == 1.0:  # no token is that sure: nothing drafted
                    assert "draft_n" not in got["timings"]
                elif kw:
                    assert got["timings"]["draft_n"] > 0, kw
    finally:
        s.stop()

"""Every POST endpoint, field by field: each field of a valid request replaced by a wrong type, a huge or
odd number, a lone surrogate, deep nesting, ... Whatever comes in, the answer is a 2xx or a 4xx with a
JSON error (never a 5xx), the server keeps serving, and its loop thread never spends over 50 ms of CPU
in one callback. Seeded: a few hundred mutants in CI, every one with ``-m fuzz_api_full``."""
from __future__ import annotations

import gc
import json
import random

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

from test_server_hardening import _LoopCPU, _server  # noqa: E402

TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
BASES = {
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                             "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1,
                             "presence_penalty": 0, "frequency_penalty": 0, "repeat_penalty": 1.1, "stop": ["x"],
                             "logprobs": False, "top_logprobs": 0, "n": 1, "stream": False, "tools": [TOOL],
                             "tool_choice": "auto", "response_format": {"type": "text"}, "user": "u",
                             "stream_options": {"include_usage": True}, "logit_bias": {"1": 1},
                             "max_completion_tokens": 2, "parallel_tool_calls": True, "reasoning_format": "auto",
                             "chat_template_kwargs": {"enable_thinking": False}, "grammar": None},
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0, "echo": False,
                        "stop": "x", "logprobs": None, "seed": 2, "ignore_eos": False, "n": 1, "suffix": None,
                        "best_of": 1},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "instructions": "Be brief.",
                      "temperature": 0.7, "top_p": 1, "stream": False, "tools": [], "text": {"format": {"type": "text"}},
                      "store": False, "reasoning": {"effort": "low"}},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                     "system": "Be brief.", "temperature": 0.5, "top_k": 5, "top_p": 0.9, "stop_sequences": ["x"],
                     "stream": False, "tools": [], "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"}},
    "/v1/embeddings": {"model": "tiny", "input": "Hi", "encoding_format": "float", "dimensions": None, "user": "u"},
}
# (raw JSON text) each replaces one field's value
VALUES = ["null", "true", "false", "0", "-1", "1", "1.5", "-1e308", "1e308", "1" + "0" * 400, "-" + "9" * 400,
          "1e-400", '""', '"x"', json.dumps("y" * 20_000), '"\\ud800"', '"\\udfff x"', '"\\u0000"', "[]", "{}",
          "[null]", '[1, "a", {}]', '{"a": {"b": {"c": []}}}', "[" * 5_000 + "]" * 5_000, '{"$ref": "#"}',
          '[{"role": "user", "content": 5}]', '[{"role": "tool"}]', '{"type": "json_schema"}', "9007199254740993",
          '"auto"', '"none"', '"required"', '{"type": "function", "function": {"name": "nope"}}']


def _mutants() -> list[tuple[str, str, str, str | None]]:
    """(path, field, raw value, nested key or None) for every field of every base."""
    out = []
    for path, base in BASES.items():
        for key in base:
            out += [(path, key, v, None) for v in VALUES]
        for key in ("messages", "input"):  # one level down: the first message's fields
            if isinstance(base.get(key), list):
                out += [(path, key, v, f) for f in ("role", "content") for v in VALUES]
    return out


def _body(path: str, key: str, raw: str, inner: str | None) -> bytes:
    body = json.loads(json.dumps(BASES[path]))
    if inner is None:
        body[key] = "\x00RAW\x00"
    else:
        body[key][0][inner] = "\x00RAW\x00"
    return json.dumps(body).replace('"\\u0000RAW\\u0000"', raw).encode()


def _run(mutants) -> None:
    with _LoopCPU() as cpu:
        s = _server(loop="asyncio")
        try:
            cpu.thread = s.thread_id
            fails = []
            gc.collect()
            gc.disable()  # (a collection's pause lands on whichever thread allocates: not the code under test)
            cpu.worst = 0.0
            with httpx.Client(base_url=s.url, timeout=120) as client:
                for path, key, raw, inner in mutants:
                    r = client.post(path, content=_body(path, key, raw, inner),
                                    headers={"content-type": "application/json"})
                    if r.status_code >= 500 or (r.status_code >= 400 and not r.headers.get(
                            "content-type", "").startswith("application/json")):
                        fails.append((path, key, inner, raw[:60], r.status_code, r.text[:200]))
                assert client.get("/health").status_code == 200
            gc.enable()
            assert not fails, fails[:10]
            assert cpu.worst < 0.050, (cpu.worst, cpu.what)
            assert not s.logged, s.logged[:3]
        finally:
            gc.enable()
            s.stop()


def test_fuzz_every_post_endpoint_field_by_field():
    every = _mutants()
    _run(random.Random(20261207).sample(every, 300))


@pytest.mark.fuzz_api_full
def test_fuzz_api_full(request):
    if "fuzz_api_full" not in (request.config.getoption("-m") or ""):
        pytest.skip("the full API fuzz run is opt-in: python -m pytest -m fuzz_api_full tests/test_server_fuzz.py")
    _run(_mutants())


def test_the_mutants_cover_every_endpoint_and_field():
    every = _mutants()
    assert {p for p, *_ in every} == set(BASES)
    assert {(p, k) for p, k, _, inner in every if inner is None} == {(p, k) for p, b in BASES.items() for k in b}
    assert {(p, inner) for p, _, _, inner in every if inner} == {(p, f) for p in ("/v1/chat/completions",
                                                                              "/v1/messages") for f in ("role", "content")}
    assert len(set(every)) == len(every) == sum(len(b) for b in BASES.values()) * len(VALUES) + 2 * 2 * len(VALUES)

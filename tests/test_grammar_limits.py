"""What a client's grammar may make llguidance's native compiler do: bounded before it compiles, and
compiled where a deep chain cannot overflow a stack (a segfault would take the server down).

In an ordinary 8 MiB thread llguidance 1.9 overflows at ~3,000 chained $refs or ~4,000 chained rules;
every chain below is past that, so without the compiler thread these tests die with SIGSEGV."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("llguidance")

import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.grammar import Grammar, GrammarError  # noqa: E402
from clutor.grammar import compiler  # noqa: E402
from clutor.server import create_app  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

MODEL = fixture_path("qwen3moe", "Q8_0")


def ref_chain(n: int) -> dict:
    """A schema whose $ref chain is n long."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def props_chain(n: int) -> dict:
    """n nested objects, each reached by a $ref from the one before (the most stack per level)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(n)) + f'\nr{n} ::= "x"'


# -- the library ------------------------------------------------------------------------------------
_AT_THE_LIMITS = """
import json, sys
sys.path.insert(0, "tests")
from test_grammar_limits import ref_chain, props_chain, gbnf_chain
from clutor.grammar import Grammar, compiler
from clutor.model.tokenizer import Tokenizer
tok = Tokenizer.from_gguf(sys.argv[1])
R, N = compiler.MAX_RULES - 2, compiler.MAX_NODES - 8
lark_rules = "start: r0\\n" + "\\n".join(f"r{i}: r{i+1}" for i in range(R))
for name, make in [
    ("gbnf", lambda: Grammar.gbnf(tok, gbnf_chain(R))),
    ("refs", lambda: Grammar.json_schema(tok, ref_chain(N))),
    ("props", lambda: Grammar.json_schema(tok, props_chain(N // 3 - 1))),
    ("rules+refs", lambda: Grammar.lark(tok, lark_rules + f"\\nr{R}: %json " + json.dumps(ref_chain(N)))),
]:
    m = make().matcher()
    print(name, m.allowed() is not None and m.error is None, flush=True)
"""


def test_the_longest_chains_within_the_limits_compile():
    """Every kind of chain, as long as the bounds let it be, compiles and masks (in a child process: a
    crash is a failed test, not a dead test run)."""
    p = subprocess.run([sys.executable, "-c", _AT_THE_LIMITS, str(MODEL)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"rc {p.returncode} (a negative rc is a signal: -11 SIGSEGV)\n{p.stdout}{p.stderr}"
    assert p.stdout.split() == ["gbnf", "True", "refs", "True", "props", "True", "rules+refs", "True"], p.stdout


@pytest.fixture(scope="module")
def tok():
    from clutor.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(str(MODEL))


def test_past_a_limit_the_grammar_is_refused_naming_it(tok):
    over_rules = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(compiler.MAX_RULES)) + '\nrx: "x"'
    with pytest.raises(GrammarError, match=f"defines {compiler.MAX_RULES + 2} rules.*at most {compiler.MAX_RULES}"):
        Grammar.lark(tok, over_rules)
    with pytest.raises(GrammarError, match=f"at most {compiler.MAX_RULES}"):
        Grammar.gbnf(tok, gbnf_chain(compiler.MAX_RULES + 1))
    with pytest.raises(GrammarError, match=f"objects .* at most {compiler.MAX_NODES}"):
        Grammar.json_schema(tok, ref_chain(compiler.MAX_NODES))
    with pytest.raises(GrammarError, match=f"bytes; this server compiles at most {compiler.MAX_TEXT}"):
        Grammar.lark(tok, 'start: "' + "x" * compiler.MAX_TEXT + '"')


def test_x_guidance_must_be_an_object_and_cannot_lift_the_whitespace_bound(tok):
    with pytest.raises(GrammarError, match="'x-guidance' must be an object"):
        Grammar.json_schema(tok, {"type": "object", "x-guidance": 5})
    with pytest.raises(GrammarError, match="whitespace_pattern' cannot be set"):
        Grammar.json_schema(tok, {"type": "object", "x-guidance": {"whitespace_pattern": r"\s*"}})

    def takes(schema, text: str) -> bool:
        m = Grammar.json_schema(tok, schema).matcher()
        for t in tok.encode(text):
            m.accept(t)
        return m.error is None

    assert takes({"type": "object"}, '{ "a": 1}')
    assert not takes({"type": "object"}, "{" + " " * 40 + '"a": 1}')  # bounded: no padding forever
    compact = {"type": "object", "x-guidance": {"whitespace_flexible": False}}
    assert takes(compact, '{"a":1}') and not takes(compact, '{ "a":1}')


# -- every server path that compiles a client's grammar -------------------------------------------------
@pytest.fixture(scope="module")
def srv():
    s = LiveServer(create_app(clutor.Model.open(MODEL, io="threads", expert_cache="50%", n_ctx=512),
                              served_model_name="tiny"))
    yield s
    s.stop()


def _paths(schema: dict | None, gbnf: str | None, tools: bool) -> list[tuple[str, str, dict]]:
    """(name, route, body) for each way a request hands the server a grammar to compile. ``tools``: the
    paths whose schema is also rendered into the prompt (a chain long enough to matter needs a context
    longer than the test model's 512 tokens: those are parsed as the server does, without a server)."""
    msgs = [{"role": "user", "content": "Hi"}]
    chat = dict(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    if gbnf is not None:
        return [] if tools else [("grammar", "/v1/chat/completions", dict(chat, grammar=gbnf))]
    if tools:
        fn = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        return [("tool_choice required", "/v1/chat/completions", dict(chat, tools=fn, tool_choice="required")),
                ("tool_choice named", "/v1/chat/completions",
                 dict(chat, tools=fn, tool_choice={"type": "function", "function": {"name": "f"}})),
                ("messages tool_choice any", "/v1/messages",
                 dict(model="tiny", messages=msgs, max_tokens=2, tools=[{"name": "f", "input_schema": schema}],
                      tool_choice={"type": "any"}))]
    return [
        ("response_format", "/v1/chat/completions",
         dict(chat, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})),
        ("json_schema", "/v1/chat/completions", dict(chat, json_schema=schema)),
        ("responses text.format", "/v1/responses",
         dict(model="tiny", input="Hi", max_output_tokens=2,
              text={"format": {"type": "json_schema", "name": "x", "schema": schema}})),
    ]


def _post(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + route, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=120)


def _parse(tok, route: str, body: dict):
    """What the server's worker thread does with a body (requests.parse_chat / messages_api.parse_messages),
    with room for any prompt."""
    from clutor.server.messages_api import parse_messages
    from clutor.server.requests import Defaults, decode_body, parse_chat

    parse = parse_messages if route == "/v1/messages" else parse_chat
    return parse(decode_body(json.dumps(body).encode()), tok, 1 << 30, Defaults())


CHAINS = ["refs 4000", "props 2000", "gbnf 4000"]


def _chain(chain: str):
    kind, n = chain.split()
    if kind == "gbnf":
        return None, gbnf_chain(int(n))
    return {"refs": ref_chain, "props": props_chain}[kind](int(n)), None


@pytest.mark.parametrize("chain", CHAINS)
def test_chains_that_overflow_an_ordinary_stack_are_answered_on_every_path(srv, chain):
    for name, route, body in _paths(*_chain(chain), tools=False):
        r = _post(srv, route, body)
        assert r.status_code == 200, (name, r.status_code, r.text[:300])
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("chain", CHAINS[:2])
def test_chains_that_overflow_an_ordinary_stack_compile_for_tool_calls(tok, chain):
    for name, route, body in _paths(*_chain(chain), tools=True):
        req = _parse(tok, route, body)
        assert req.plan.grammar is not None and req.plan.grammar.matcher().allowed() is not None, name


def test_chains_past_the_limits_get_a_400_naming_the_limit_on_every_path(srv, tok):
    from clutor.server.errors import APIError

    cases = [(ref_chain(compiler.MAX_NODES), None, f"at most {compiler.MAX_NODES}"),
             (None, gbnf_chain(compiler.MAX_RULES + 1), f"at most {compiler.MAX_RULES}")]
    for schema, gbnf, limit in cases:
        for name, route, body in _paths(schema, gbnf, tools=False):
            r = _post(srv, route, body)
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert limit in err["message"] and err["param"] is not None, (name, err)
        for name, route, body in _paths(schema, gbnf, tools=True):
            with pytest.raises(APIError, match=limit) as e:
                _parse(tok, route, body)
            assert e.value.status == 400 and e.value.param is not None, name
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200

#!/usr/bin/env python3
"""Record llama.cpp's renderings of chat templates (llama-server --jinja, its own C++ Jinja engine and
its message handling) as the reference Clutor's renderer is tested against.

    python tools/record_templates.py [--server PATH] [--out tests/golden/chat_templates.json]

For each template in tests/fixtures/templates/ (with the fixture model whose vocabulary it is run
with), llama-server is started with --jinja --chat-template-file and each conversation of
CONVERSATIONS is posted to /apply-template as an OpenAI chat request (messages, tools,
add_generation_prompt, chat_template_kwargs); the prompt it returns is stored. Written (JSON):
  llama_server      the binary's --version line
  templates         {template file: {"model": fixture, "cases": {case: {"request": ..., "prompt": ...}}}}
The test (tests/test_templates.py) renders each request through Clutor's server path (plan_chat) and
compares the prompt.
"""
from __future__ import annotations

import argparse
import copy
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
SERVER = Path("/work/build/llama.cpp-src/build/bin/llama-server")

# template file -> the fixture whose vocabulary (BOS/EOS texts, special tokens) it is rendered with
MODELS = {
    "google-gemma-4-31B-it.jinja": "tiny-gemma4-F16.gguf",
    "google-gemma-4-31B-it-interleaved.jinja": "tiny-gemma4-F16.gguf",
    "MiniMax-M2.jinja": "tiny-minimax-m2-F16.gguf",
    "meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja": "tiny-llama4-F16.gguf",
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer", "description": "How many days"},
        "units": {"type": "string", "enum": ["metric", "imperial"]}},
        "required": ["city"]}}}
TODO = {"type": "function", "function": {
    "name": "todo_list", "description": "Replace the todo list",
    "parameters": {"type": "object", "properties": {
        "todos": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object", "properties": {"sort": {"type": "boolean"}}}},
        "required": ["todos"]}}}
TOOLS = [WEATHER, TODO]


def _call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Weather in Zürich?"}
CALL = {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
        "tool_calls": [_call("call_a1", "get_weather", {"city": "Zürich", "days": 2})]}
RESULT = {"role": "tool", "tool_call_id": "call_a1", "content": '{"temp": 3, "sky": "snow"}'}
ANSWER = {"role": "assistant", "content": "3 °C and snow."}
THANKS = {"role": "user", "content": "Thanks! And my todo list: milk, bread."}
TWO_CALLS = {"role": "assistant", "content": "Both at once.",
             "tool_calls": [_call("call_b1", "get_weather", {"city": "Paris", "units": "metric"}),
                            _call("call_b2", "todo_list", {"todos": ["milk", "bread"], "options": {"sort": True}})]}
TWO_RESULTS = [{"role": "tool", "tool_call_id": "call_b1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "call_b2", "content": '{"ok": true}'}]

# name -> the request's fields (messages, and tools / add_generation_prompt / chat_template_kwargs)
CONVERSATIONS = {
    "user": {"messages": [USER]},
    "system": {"messages": [SYSTEM, USER]},
    "multi_turn": {"messages": [SYSTEM, USER, {"role": "assistant", "content": "Which unit?"},
                                {"role": "user", "content": "Celsius."}]},
    # (a conversation ending with the assistant is, to llama-server, a reply to continue: not asked here)
    "no_generation_prompt": {"messages": [SYSTEM, USER, {"role": "assistant", "content": "Cold."},
                                          {"role": "user", "content": "Sure?"}], "add_generation_prompt": False},
    "tools": {"messages": [SYSTEM, USER], "tools": TOOLS},
    "tools_no_system": {"messages": [USER], "tools": TOOLS},
    "tool_result": {"messages": [SYSTEM, USER, CALL, RESULT], "tools": TOOLS},
    "tool_round": {"messages": [SYSTEM, USER, CALL, RESULT, ANSWER, THANKS], "tools": TOOLS},
    "parallel_calls": {"messages": [USER, TWO_CALLS, *TWO_RESULTS], "tools": TOOLS},
    "parallel_round": {"messages": [USER, TWO_CALLS, *TWO_RESULTS, {"role": "assistant", "content": "Done."},
                                    {"role": "user", "content": "Good."}], "tools": TOOLS},
    "thinking": {"messages": [SYSTEM, USER], "chat_template_kwargs": {"enable_thinking": True}},
    "thinking_tools": {"messages": [USER, CALL, RESULT], "tools": TOOLS,
                       "chat_template_kwargs": {"enable_thinking": True}},
    "reasoning_history": {"messages": [USER, {"role": "assistant", "content": "Cold.", "reasoning_content": "Recall."},
                                       {"role": "user", "content": "Sure?"}]},
}


# llama-server turns thinking on by default where a template has the switch; Clutor passes only what the
# request says. Every request here says it, so both render the same variables.
for _req in CONVERSATIONS.values():
    _req.setdefault("chat_template_kwargs", {"enable_thinking": False})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    """The reply's JSON; a refusal (HTTP 4xx/5xx) as {"error": its message}."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        err = json.loads(e.read() or b"{}").get("error", {})
        return {"error": err.get("message", str(e)) if isinstance(err, dict) else str(err)}


def record_template(server: Path, template: Path, model: Path) -> dict:
    port = _free_port()
    proc = subprocess.Popen([str(server), "-m", str(model), "--jinja", "--chat-template-file", str(template),
                             "--port", str(port), "-c", "2048", "-np", "1", "-t", "1", "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"llama-server exited: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
        cases = {}
        for name, req in CONVERSATIONS.items():
            reply = _post(port, "/apply-template", req)
            cases[name] = {"request": copy.deepcopy(req), **({"prompt": reply["prompt"]} if "prompt" in reply else
                                                             {"error": reply["error"]})}
        return cases
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", type=Path, default=SERVER)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / "chat_templates.json")
    args = ap.parse_args(argv)
    version = subprocess.run([str(args.server), "--version"], capture_output=True, text=True)
    out = {"llama_server": (version.stdout + version.stderr).strip().splitlines()[0], "templates": {}}
    for name, model in MODELS.items():
        cases = record_template(args.server, TEMPLATES / name, ROOT / "tests" / "fixtures" / model)
        out["templates"][name] = {"model": model, "cases": cases}
        print(f"{name}: {len(cases)} conversations", file=sys.stderr)
    args.out.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

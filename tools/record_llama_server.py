"""Record llama-server's answers on its own routes as golden files (tests/golden/llama_server/).

    python tools/record_llama_server.py LLAMA_SERVER [MODEL]    # default: the tiny qwen3moe Q8_0 fixture

LLAMA_SERVER is llama-server built from llama.cpp's source (llama-cpp-python's sdist vendors it:
``cmake -B build && cmake --build build --target llama-server`` in vendor/llama.cpp). Each request in
REQUESTS is sent once; the file holds the request, the status and the JSON answer, with the server's
build and command line. tests/test_server_llama_routes.py asks clutor serve the same and compares.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "llama_server"
MODEL = ROOT / "tests" / "fixtures" / "tiny-qwen3moe-Q8_0.gguf"
N_CTX, SLOTS = 512, 2

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
REQUESTS = {  # in this order: /slots before any generation (a slot that ran one shows its last task)
    "tokenize": ("POST", "/tokenize", {"content": "Hello world, it's 2026!"}),
    "tokenize_special": ("POST", "/tokenize", {"content": "<|im_start|>user\nhi<|im_end|>", "add_special": True}),
    "tokenize_no_parse_special": ("POST", "/tokenize", {"content": "<|im_start|>hi", "parse_special": False}),
    "tokenize_pieces": ("POST", "/tokenize", {"content": "Hello wörld ✓ <|im_end|>", "with_pieces": True}),
    "tokenize_mixed": ("POST", "/tokenize", {"content": ["Hello", 11, " world"]}),
    "tokenize_empty": ("POST", "/tokenize", {}),
    "detokenize": ("POST", "/detokenize", {"tokens": [72, 332, 423, 264, 195, 182, 114, 366, 44]}),
    "detokenize_special": ("POST", "/detokenize", {"tokens": [510, 104, 105, 511]}),
    "detokenize_empty": ("POST", "/detokenize", {}),
    "apply_template": ("POST", "/apply-template", {"messages": MESSAGES}),
    "props": ("GET", "/props", None),
    "slots": ("GET", "/slots", None),
    "completion": ("POST", "/completion", {"prompt": "The quick brown fox", "n_predict": 8, "temperature": 0,
                                           "cache_prompt": True}),
    "completion_stop": ("POST", "/completion", {"prompt": [72, 332, 423], "n_predict": 16, "temperature": 0,
                                                "stop": ["e"], "return_tokens": True}),
    "completion_stream": ("POST", "/completion", {"prompt": "The quick brown fox", "n_predict": 4,
                                                  "temperature": 0, "stream": True}),
}


def main() -> int:
    exe = sys.argv[1]
    model = Path(sys.argv[2]) if len(sys.argv) > 2 else MODEL
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe, "-m", str(model), "-c", str(N_CTX * SLOTS), "-np", str(SLOTS), "--port", str(port),
           "--host", "127.0.0.1", "-t", "2", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        OUT.mkdir(parents=True, exist_ok=True)
        for name, (method, path, body) in REQUESTS.items():
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"}, method=method)
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    raw = r.read().decode()
                    status = r.status
                    if (body or {}).get("stream"):  # server-sent events: each data line's object
                        answer = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
                    else:
                        answer = json.loads(raw)
            except urllib.error.HTTPError as e:
                status, answer = e.code, json.loads(e.read())
            rec = {"request": {"method": method, "path": path, "body": body}, "status": status, "answer": answer,
                   "server": {"command": ["llama-server"] + cmd[1:2] + [model.name] + cmd[3:]}}
            (OUT / f"{name}.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
            print(name, status)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

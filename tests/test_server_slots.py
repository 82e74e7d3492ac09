"""llama-server's slot files (POST /slots/{id}?action=save|restore|erase, --slot-save-path): a slot saved
by one server is restored by another, and its prompt then reuses the restored pages (the second has no
prefix cache in RAM: the restore is the only way they can be reused), answering what a fresh run answers."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.server import create_app  # noqa: E402
from clutor.server.slots import filename_problem  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

MODEL = fixture_path("qwen3moe", "Q8_0")
OPEN = dict(io="threads", expert_cache="50%", n_ctx=512, activations="f32", kv_type="f32")
PROMPT = " ".join(f"line {i}: the expert cache streams weights from the disk" for i in range(12))


def _server(path, prefix_cache="256MiB", **kw):
    return LiveServer(create_app(clutor.Model.open(MODEL, **OPEN, prefix_cache=prefix_cache), served_model_name="tiny",
                                 max_sequences=4, slot_save_path=path, **kw))


def _complete(c: httpx.Client, **kw) -> dict:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_saved_slot_restored_by_another_server_is_reused(tmp_path):
    s = _server(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            first = _complete(c, id_slot=1)
            n_prompt = first["usage"]["prompt_tokens"]
            assert first["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
            r = c.post("/slots/1?action=save", json={"filename": "one.bin"})
            assert r.status_code == 200, r.text
            saved = r.json()
            held = n_prompt + first["usage"]["completion_tokens"] - 1  # the last token is never fed
            assert saved["id_slot"] == 1 and saved["n_saved"] == held // 16 * 16 > 0
            assert saved["n_written"] == os.path.getsize(tmp_path / "one.bin")
    finally:
        s.stop()
    s = _server(tmp_path, prefix_cache=0)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            control = _complete(c, prompt=PROMPT + " once more", max_tokens=1)
            assert control["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
            r = c.post("/slots/0?action=restore", json={"filename": "one.bin"})
            assert r.status_code == 200, r.text
            restored = r.json()
            assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] > 0
            reused = _complete(c, id_slot=0)
            cached = reused["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (n_prompt - 1) // 16 * 16 <= cached <= n_prompt - 1
            assert reused["choices"][0]["text"] == first["choices"][0]["text"]
            # the slot's request ended: the restored pages went back, and erase forgets its tokens
            r = c.post("/slots/0?action=erase")
            assert r.status_code == 200 and r.json()["n_erased"] == n_prompt + 5
            assert s.state.model.engine_stats().kv_bytes == 0
    finally:
        s.stop()


def test_slot_requests_that_cannot_be_served_say_why(tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"not a slot file" * 100)
    s = _server(tmp_path, api_key="k")
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers={"authorization": "Bearer k"}) as c:
            def post(url, body=None):
                r = c.post(url, json=body)
                return r.status_code, r.json()["error"]

            for name in ("../x.bin", "a/b", "", " x", "x.", ".."):
                code, err = post("/slots/0?action=save", {"filename": name})
                assert code == 400 and err["param"] == "filename" and "Invalid filename" in err["message"], name
            assert post("/slots/0?action=dump", {"filename": "a"})[0] == 400
            code, err = post("/slots/4?action=save", {"filename": "a"})
            assert code == 400 and "[0, 4)" in err["message"]
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "id_slot": 9})
            assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot"
            code, err = post("/slots/0?action=restore", {"filename": "missing.bin"})
            assert code == 404
            code, err = post("/slots/0?action=restore", {"filename": "junk.bin"})
            assert code == 400 and "not a Clutor slot file" in err["message"]
            assert str(tmp_path) not in err["message"]
        r = httpx.post(s.url + "/slots/0?action=erase", timeout=30)
        assert r.status_code == 401
    finally:
        s.stop()
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name="tiny"))
    try:
        r = httpx.post(s.url + "/slots/0?action=save", json={"filename": "a.bin"}, timeout=30)
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    finally:
        s.stop()


def test_file_names_as_llama_cpp_takes_them():
    assert filename_problem("slot_save_file.bin") is None
    assert filename_problem("état-1.bin") is None
    for bad in ("", "a/b", "a\\b", "..", "x\x00y", "x\ny", "a:b", "\ufeffx", "x" * 256, None, 3):
        assert filename_problem(bad), bad


def test_a_restarted_server_loads_a_prompt_from_the_disk_prefix_cache(tmp_path):
    """--prefix-cache-disk through the server: the second process answers the same prompt from the pages
    the first wrote, with the same text, and /metrics counts them."""
    def session():  # one server process: the prompt's completion and the metrics after it
        s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN, prefix_cache_disk=tmp_path / "kv"),
                                  served_model_name="tiny"))
        try:
            with httpx.Client(base_url=s.url, timeout=120) as c:
                return _complete(c), c.get("/metrics").text
        finally:
            s.stop()

    first, metrics1 = session()
    second, metrics = session()
    n = first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // 16 * 16 > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]

    def value(name, text=metrics):
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value("clutor_disk_prompt_tokens_total") >= (n - 1) // 16 * 16
    assert value('clutor_prefix_cache_disk_pages_total{op="loaded"}') >= (n - 1) // 16
    assert value("clutor_prefix_cache_disk_bytes") > 0
    assert value("clutor_disk_prompt_tokens_total", metrics1) == 0
    # the first computed the prompt: in one window where it is longer than a step (256 tokens)
    assert value("clutor_prompt_windows_total", metrics1) == (1 if n > 256 else 0)

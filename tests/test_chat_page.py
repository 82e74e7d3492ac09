"""The chat page at / in a real browser: headless Chromium (Debian's package) driven by Playwright.

Type a message, see the reply stream in, see its stats; the page loads nothing from elsewhere.
"""
from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
playwright = pytest.importorskip("playwright.sync_api", reason="Python's playwright package is in the test extra")
CHROMIUM = os.environ.get("CLUTOR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)",
                allow_module_level=True)

import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.server import create_app  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

# Flags known to work here: no sandbox as root, and none of Chromium's own network traffic.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def srv():
    model = clutor.Model.open(fixture_path("qwen3moe", "Q8_0"), io="threads", expert_cache="50%", n_ctx=512)
    s = LiveServer(create_app(model, served_model_name="tiny", max_sequences=2))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def page(srv):
    with playwright.sync_playwright() as p:  # Playwright gives the browser a new empty profile
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            pg = browser.new_page()
            outside = []
            pg.on("request", lambda r: outside.append(r.url) if not r.url.startswith(srv.url) else None)
            pg.outside = outside
            yield pg
        finally:
            browser.close()


def test_page_is_served_with_its_assets(srv):
    r = httpx.get(srv.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for asset in ("/static/chat.js", "/static/chat.css"):
        assert httpx.get(srv.url + asset).status_code == 200
    assert "http" not in r.text.replace(srv.url, "")  # no CDN: every asset is the server's


def test_type_a_message_and_see_the_reply_stream_in(page, srv):
    page.goto(srv.url + "/")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny')")
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")
    page.fill("#input", "Tell me about the expert cache")
    # record the reply's text each time it changes: it must grow over several updates (a stream)
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const c = document.querySelector('.msg.assistant .content');
            if (c) window.seen.push(c.textContent);
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
    }""")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant .stats", timeout=60_000)
    user = page.text_content(".msg.user .content")
    reply = page.text_content(".msg.assistant .content")
    stats = page.text_content(".msg.assistant .stats")
    seen = [s for s in page.evaluate("window.seen") if s]
    assert user == "Tell me about the expert cache"
    assert reply and "Error" not in reply
    assert len(set(seen)) >= 3 and all(reply.startswith(s) for s in seen), seen  # it streamed in, growing
    assert "tok/s" in stats and "hit rate" in stats and "read" in stats
    assert not page.outside, page.outside


def test_second_turn_keeps_the_conversation(page, srv):
    page.fill("#input", "And then?")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant .stats').length == 2", timeout=60_000)
    assert page.locator(".msg.user").count() == 2
    assert page.text_content("#status") == ""

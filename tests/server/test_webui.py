"""The bundled chat page (`GET /`) in a real browser against a real `kvtier serve` on the embedded model.

Headless Debian Chromium driven by Playwright (`executable_path=`, so Playwright never downloads a
browser). `make install-test` installs both; as root a missing browser is a failure, not a skip.
The screenshot lands in $KVTIER_ARTIFACTS or tests/artifacts/ (git-ignored).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvtier.cli import chat_page_url
from tests.server.conftest import API_KEY, REPO, make_client

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
UI_TIMEOUT_MS = 30_000  # one short answer from SmolLM2-135M on a slow 2-core CPU, with margin
ABORT_SETTLE_S = 10  # the server must drop an aborted request well before its 1,000 tokens could finish
STATUS_RE = re.compile(r"TTFT [\d,]+ ms · [\d.]+ tok/s · prompt ([\d,]+) \(([\d,]+) cached, ([\d,]+) new\) · "
                       r"([\d,]+) generated")


# ---- without a browser: routes, auth and headers over the FakeEngine ----------------------------

WEBUI_FILES = ("chat.js", "chat.css", "markdown.js", "store.js", "api.js", "favicon.svg")


def test_page_and_assets_are_public_and_the_stats_need_the_key(engine):
    engine.model_name = "<b>m</b>"
    with make_client(engine, api_key=API_KEY, model_name="<b>m</b>") as c:
        page = c.get("/")
        assert page.status_code == 200
        assert "<b>m</b>" not in page.text and "&lt;b&gt;m&lt;/b&gt;" in page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe" not in csp
        for name in WEBUI_FILES:
            r = c.get(f"/webui/{name}")
            assert r.status_code == 200 and r.content and r.headers["cache-control"] == "no-cache", name
        assert c.get("/webui/nope.js").status_code == 404
        assert c.get("/v1/kvtier/stats").status_code == 401
        st = c.get("/v1/kvtier/stats", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert st["max_model_len"] == engine.max_model_len and st["model"] == "<b>m</b>"
        assert set(st["gpu"]) == {"pages_total", "pages_used", "pages_cached", "pages_free"} == set(st["host"])
        evil = {"Host": "evil.example:8000"}  # DNS rebinding: the page and its files are refused too
        assert c.get("/", headers=evil).status_code == 403
        assert c.get("/webui/chat.js", headers=evil).status_code == 403


def test_serve_prints_a_one_time_login_link():
    assert chat_page_url("127.0.0.1", 8000, None) == "http://127.0.0.1:8000/"
    assert chat_page_url("0.0.0.0", 80, "a+b/c#d") == "http://127.0.0.1:80/#key=a%2Bb%2Fc%23d"
    assert chat_page_url("::1", 8000, "k") == "http://[::1]:8000/#key=k"


# ---- in Chromium, against `kvtier serve` on the embedded model ----------------------------------

def _browser_or_reason() -> tuple[str | None, str]:
    path = os.environ.get("KVTIER_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None, "the playwright package is missing (pip install -e '.[test]')"
    if path is None:
        return None, "no Chromium on PATH (apt-get install chromium, or set KVTIER_CHROMIUM)"
    return path, ""


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path, reason = _browser_or_reason()
    if path is None:
        if os.geteuid() == 0:  # `make install-test` can install it here: its absence is a broken setup
            pytest.fail(f"browser test cannot run: {reason}; run `make install-test`")
        pytest.skip(f"browser test skipped (not root, cannot install): {reason}")
    return path


@pytest.fixture(scope="module")
def ui(chromium_path, real_server):
    """One page for the module's tests (in order), with every request and page error it saw."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, args=["--disable-gpu"])
        page = browser.new_page(viewport={"width": 1180, "height": 820}, color_scheme="light")
        page.set_default_timeout(UI_TIMEOUT_MS)
        seen = SimpleNamespace(page=page, requests=[], errors=[])
        page.on("request", lambda r: seen.requests.append(r))
        page.on("pageerror", lambda e: seen.errors.append(e))
        yield seen
        browser.close()


def _assert_clean(ui, server) -> None:
    """Nothing but this server was contacted, and no script error happened."""
    urls = [r.url for r in ui.requests]
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls
    assert not ui.errors, ui.errors


def _artifacts() -> Path:
    d = Path(os.environ.get("KVTIER_ARTIFACTS") or REPO / "tests" / "artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=5).json()


def _send(page, text: str) -> None:
    page.fill("#input", text)
    page.keyboard.press("Enter")


def _set(page, **fields: str) -> None:
    """Change settings through the form, as a user would, and fold the form again."""
    if not page.locator("#settings").evaluate("d => d.open"):
        page.click("#settings summary")
    for name, value in fields.items():
        page.fill(f"#set-{name}", value)
        page.locator(f"#set-{name}").dispatch_event("change")
    page.click("#settings summary")


MARKDOWN_ATTACKS = "\n".join([
    "<img src=x onerror=alert(1)> <script>alert(2)</script> **<b>bold</b>**",
    "[click](javascript:alert(3)) [ok](https://example.org/?a=1&b=\"2\") ![img](https://example.org/x.png)",
    "`<i>code</i>` and *em \" onmouseover=alert(4) x=\"*",
    "```html", "<iframe src=//example.org></iframe>", "```",
    "| a | <svg onload=alert(5)> |", "|---|---|", "| <u>1</u> | 2 |",
])
ALLOWED_TAGS = {"P", "BR", "STRONG", "EM", "DEL", "CODE", "PRE", "A", "UL", "OL", "LI", "H1", "H2", "H3", "H4", "H5",
                "H6", "BLOCKQUOTE", "HR", "DIV", "SPAN", "BUTTON", "TABLE", "THEAD", "TBODY", "TR", "TH", "TD"}


def test_page_logs_in_and_loads_from_this_server_only(ui, real_server):
    page = ui.page
    page.goto(real_server.url + "/")  # no key yet: the page loads, and asks for one
    page.wait_for_selector("#notice >> text=needs an API key")
    # The markdown renderer leaves model text inert: only its own tags, no handlers, safe links.
    tags, attrs, hrefs = page.evaluate("""src => {
        const t = document.createElement("template");
        t.innerHTML = KvMarkdown.render(src);
        const els = [...t.content.querySelectorAll("*")];
        return [[...new Set(els.map(e => e.tagName))], els.flatMap(e => e.getAttributeNames()),
                els.filter(e => e.tagName === "A").map(e => e.getAttribute("href"))];
    }""", MARKDOWN_ATTACKS)
    assert set(tags) <= ALLOWED_TAGS and "A" in tags and "PRE" in tags, tags
    assert set(attrs) <= {"class", "href", "target", "rel", "type"}, attrs
    assert hrefs == ['https://example.org/?a=1&b="2"', "https://example.org/x.png"], hrefs
    page.goto(f"{real_server.url}/#key={API_KEY}")
    page.wait_for_selector("#pool .bar")  # /v1/kvtier/stats answered with the key
    assert "key=" not in page.url, "the one-time #key= fragment must leave the address bar"
    assert page.evaluate("localStorage.getItem('kvtier.key')") == API_KEY
    assert page.locator("#model").inner_text() == _health(real_server)["model"]
    assert re.fullmatch(r"0 / 2,048", page.locator("#context-text").inner_text())
    _set(page, temperature="0", max_tokens="24")  # short greedy answers: fast and repeatable
    _assert_clean(ui, real_server)


def test_answer_streams_with_status_and_regenerate_hits_the_cache(ui, real_server):
    page = ui.page
    with page.expect_request("**/v1/chat/completions") as req:
        _send(page, "Name three colors.")
    body = req.value.post_data_json
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"][-1] == {"role": "user", "content": "Name three colors."}
    assert req.value.headers.get("authorization") == f"Bearer {API_KEY}"
    page.wait_for_selector("#stop:visible")  # busy while streaming
    page.wait_for_selector("body:not(.busy)")
    answer = page.locator(".msg.assistant").last
    assert answer.locator(".content").inner_text().strip(), "no answer text streamed"
    m = STATUS_RE.search(answer.locator(".status").inner_text())
    assert m, answer.locator(".status").inner_text()
    prompt, cached, new, generated = (int(g.replace(",", "")) for g in m.groups())
    assert prompt == cached + new and 0 < generated <= 24
    used = int(page.locator("#context-text").inner_text().split(" / ")[0].replace(",", ""))
    assert used == prompt + generated

    page.click(".msg.assistant .regenerate")  # same prompt again: served from the prefix cache
    page.wait_for_selector(".msg.assistant .status >> text=generated")
    page.wait_for_selector("body:not(.busy)")
    assert page.locator(".msg.assistant").count() == 1
    m2 = STATUS_RE.search(page.locator(".msg.assistant .status").inner_text())
    assert m2 and int(m2.group(1)) == prompt and int(m2.group(2)) > 0, m2 and m2.groups()
    page.screenshot(path=str(_artifacts() / "webui-chat.png"))
    _assert_clean(ui, real_server)


def test_stop_aborts_the_request_and_returns_to_idle(ui, real_server):
    from playwright.sync_api import expect

    page = ui.page
    _set(page, max_tokens="1000")
    _send(page, "Write a very long story about a lighthouse keeper.")
    answer = page.locator(".msg.assistant").last
    expect(answer.locator(".content")).to_have_text(re.compile(r"\w"))  # tokens are arriving
    assert _health(real_server)["engine"]["running"] == 1
    with page.expect_event("requestfailed", predicate=lambda r: r.url.endswith("/v1/chat/completions")) as ev:
        page.click("#stop")
    assert "ABORTED" in (ev.value.failure or "").upper(), ev.value.failure
    page.wait_for_selector("body:not(.busy)")
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()
    assert "stopped" in answer.locator(".status").inner_text()
    deadline = time.monotonic() + ABORT_SETTLE_S
    while (h := _health(real_server))["engine"]["running"] or h["active"]:
        assert time.monotonic() < deadline, f"server still generating {ABORT_SETTLE_S} s after stop: {h}"
        time.sleep(0.1)
    page.reload()  # the conversation survives in localStorage
    page.wait_for_selector(".conv.active")
    assert page.locator(".msg.user").count() == 2
    _assert_clean(ui, real_server)

"""The chat page of `edgespec serve`, in a real headless Chromium driven by
playwright (no browser is ever downloaded): type a prompt, see the streamed
answer with the drafted text highlighted and the stats line.  The browser
comes from conftest's `chromium` fixture, which skips with the reason where
there is none and fails under CI's require variable (tests/conftest.py).  The
screenshot goes to EDGESPEC_SCREENSHOT when that is set (the README's
picture is taken this way)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import CHROMIUM_FLAGS
from serving import request, running_server

pytestmark = pytest.mark.model

PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps."


@pytest.fixture(scope="module")
def page_server(model):
    # --no-gate: every proposed draft is verified, so whether this copy task shows drafted text does not
    # hang on the gate's learned step costs (they move with the machine's load; once none was drafted)
    with running_server("--ctx", "2048", "--max-tokens", "48", "--no-gate") as (base, proc):
        yield base


def test_chat_page_streams_and_highlights_drafts(chromium, page_server, tmp_path):
    from playwright import sync_api
    # the answer the page must show, asked through the API
    status, _, body = request(page_server, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48})
    assert status == 200
    want = json.loads(body)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 620})
            page.goto(page_server + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes('SmolLM2')")
            page.fill("#max_tokens", "48")
            page.fill("#prompt", PROMPT)
            page.press("#prompt", "Enter")
            stats = page.locator(".msg.assistant .stats")
            stats.wait_for(timeout=600_000)
            answer = page.inner_text(".msg.assistant .body")
            drafted = page.locator(".msg.assistant .body span.d").all_inner_texts()
            line = stats.inner_text()
            shot = tmp_path / "chat.png"
            page.screenshot(path=str(shot))
            if os.environ.get("EDGESPEC_SCREENSHOT"):
                shutil.copy(shot, os.environ["EDGESPEC_SCREENSHOT"])
        finally:
            browser.close()
    assert answer == want["choices"][0]["message"]["content"]
    t = want["timings"]
    assert t["draft_n_accepted"] > 0 and drafted            # this copy task drafts
    assert sum(len(s) for s in drafted) <= len(answer)
    assert f"{t['predicted_n']} tokens" in line and "tok/s" in line and "tokens/step" in line
    assert shot.stat().st_size > 10_000

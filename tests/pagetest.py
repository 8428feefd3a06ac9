"""What the service's page tests share: a real headless Chromium (Debian's, driven by Playwright) opened on the page,
and the checks of the page that run against ``test_serve``'s service (called from there, so that one service
serves them all). Screenshots go to $DIFFUSE_ARTIFACTS (default: artifacts/ in the checkout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (apt-get install chromium)")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required"]


def shot(page, name: str) -> None:
    where = os.environ.get("DIFFUSE_ARTIFACTS") or os.path.join(os.path.dirname(os.path.dirname(__file__)), "artifacts")
    os.makedirs(where, exist_ok=True)
    page.screenshot(path=os.path.join(where, name), full_page=True)


@contextmanager
def opened(url: str, key: str | None = None):
    """The page at ``url`` in a fresh headless Chromium, with the API key stored as the page keeps it."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            if key:
                page.add_init_script(f"localStorage.setItem('diffuse-api-key', {json.dumps(key)})")
            page.goto(url + "/")
            page.wait_for_function("document.querySelectorAll('#gen-model option, #chat-model option').length > 0",
                                   timeout=30000)
            yield page
        finally:
            browser.close()


def generate(page, model: str, prompt: str, steps: str = "", size: str = "") -> None:
    page.select_option("#gen-model", model)
    page.fill("#gen-prompt", prompt)
    page.fill("#gen-steps", steps)
    page.fill("#gen-size", size)
    page.click("#gen-go")
    page.wait_for_function("document.querySelector('#gen-status').textContent.startsWith('done')"
                           " || document.querySelector('#gen-status').textContent.startsWith('error')", timeout=120000)
    assert page.inner_text("#gen-status").startswith("done"), page.inner_text("#gen-status")


SHOWN = """sel => { const e = document.querySelector(sel); const c = e.closest('figure').querySelector('.real-size');
  return {width: e.getBoundingClientRect().width, height: e.getBoundingClientRect().height, scale: e.dataset.scale,
          rendering: getComputedStyle(e).imageRendering, said: c.textContent,
          download: e.closest('figure').querySelector('a.download').getAttribute('download')}; }"""


def chats_and_generates(served, key: str) -> None:
    """A chat message answered by streamed tokens; a 16 x 16 image generated and drawn 16 times larger, sharp, its
    real size said beside it and a link to download it."""
    expected = served.client().chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello"}]).choices[0].message.content
    with opened(served.url, key) as page:
        page.select_option("#chat-model", "chat")
        page.check("#chat-figures")  # how the answer was made, said under it
        page.fill("#chat-input", "hello")
        page.press("#chat-input", "Enter")
        page.wait_for_selector("#chat-log .msg.assistant.done", timeout=120000)
        assert page.inner_text("#chat-log .msg.assistant") == expected  # the page streamed the whole answer
        said = page.inner_text("#chat-log .msg.figures")
        assert re.fullmatch(r"\d+ tokens in \d+ trips around the ring \([\d.]+ a trip\), (\d+ of \d+ drafted tokens "
                            r"accepted|no drafts)(, [\d.]+ tokens/s after the first)?, first token \d+ ms", said), said
        shot(page, "page-chat.png")
        generate(page, "image", "a red cat", steps="3", size="16x16")
        page.wait_for_function("() => { const i = document.querySelector('#gen-result img.picture');"
                               " return i && i.complete && i.naturalWidth === 16 && i.dataset.scale; }", timeout=30000)
        assert page.eval_on_selector("#gen-progress", "e => e.value") == 100
        shown = page.evaluate(SHOWN, "#gen-result img.picture")
        assert (shown["width"], shown["height"], shown["scale"]) == (256, 256, "16"), shown
        assert shown["rendering"] == "pixelated" and shown["said"] == "16 × 16 px, shown 16× larger", shown
        assert shown["download"].endswith(".png")
        shot(page, "page-generate.png")


def plays_video_and_sound(served, key: str) -> None:
    """A 32 x 32 video of 9 frames plays in the page (it has a length and moves on), drawn 8 times larger with its
    real size beside it and a link to download the mp4, every frame shown beside it; a sound plays."""
    with opened(served.url, key) as page:
        generate(page, "video", "a red cat", steps="2")
        page.wait_for_function("() => { const v = document.querySelector('#gen-result video');"
                               " return v && v.readyState >= 2 && v.dataset.scale; }", timeout=30000)
        shown = page.evaluate(SHOWN, "#gen-result video")
        assert (shown["width"], shown["height"], shown["scale"]) == (256, 256, "8"), shown
        assert shown["said"].startswith("32 × 32 px, shown 8× larger, ") and shown["said"].endswith(" s"), shown
        assert shown["download"] == "diffuse-video.mp4"
        page.wait_for_function("document.querySelector('#gen-result video').currentTime > 0", timeout=15000)
        sheet = page.evaluate(SHOWN, "#gen-result img.picture")  # nine 32 x 32 frames side by side, as wide as fits
        k = int(sheet["scale"])
        assert (sheet["width"], sheet["height"]) == (288 * k, 32 * k) and sheet["said"].startswith("288 × 32 px"), sheet
        shot(page, "page-video.png")
        generate(page, "sound", "happy drums")
        page.wait_for_function("() => { const a = document.querySelector('#gen-result audio');"
                               " return a && a.readyState >= 1 && a.duration > 0; }", timeout=30000)
        page.eval_on_selector("#gen-result audio", "a => a.play()")
        page.wait_for_function("document.querySelector('#gen-result audio').currentTime > 0", timeout=15000)
        said = page.inner_text("#gen-result figure.audio .real-size")
        assert said.endswith(" s of sound") and float(said.split()[0]) > 0, said
        assert page.get_attribute("#gen-result figure.audio a.download", "download") == "diffuse-sound.wav"
        shot(page, "page-sound.png")

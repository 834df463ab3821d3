"""`lmtrace serve`'s page in Debian's Chromium through Playwright, at a chosen width: the page, the
problems it reported (console errors and warnings, page errors), and a check that no value was left
unfilled. Skips where Playwright or Chromium is not installed."""

from __future__ import annotations

import re
from contextlib import contextmanager

import pytest

from tests.helpers.browser import CHROMIUM

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextmanager
def served_page(width: int = 1280, height: int = 900):
    """(page, problems): one Chromium page `width` px wide; problems collects console errors, warnings
    and page errors."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; it is in the `test` extra)")
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it when run as root)")
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on(
                "console",
                lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None,
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            yield page, problems
        finally:
            browser.close()


def assert_no_placeholder_text(page) -> None:
    """No value the page failed to fill in: a JavaScript null, undefined or NaN written as text."""
    text = page.inner_text("main")
    assert not re.search(r"\b(null|undefined|NaN)\b", text), text


def assert_fits(page, selector: str) -> None:
    """The element ends inside the window: nothing of it sticks out sideways (it may scroll inside itself)."""
    right = page.eval_on_selector(selector, "e => e.getBoundingClientRect().right")
    width = page.evaluate("window.innerWidth")
    assert right <= width, f"{selector} ends at {right} px, the window is {width} px wide"

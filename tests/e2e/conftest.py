"""Browser tests: Debian's Chromium driven by Playwright against a real Fathom.

The server side is the control-plane tests' own: `live_web` (uvicorn on a free port) and
`celery_worker` (a real worker), with the same cast. Every page opened through `browser_page`
fails its test on a browser console error, unless the test said beforehand that the error is
what it provokes (an API answering 400 to a bad form value logs "Failed to load resource").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from django.db import connections
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright

from tests.platform.conftest import alice, bob, celery_worker, celery_worker_with_beat, live_web  # noqa: F401 (fixtures)

T = TypeVar("T")
OUTPUT = Path(__file__).resolve().parent / "output"
CHROMIUM = "/usr/bin/chromium"
# Headless Chromium on a shared CI box: no sandbox (no user namespaces in containers), no GPU,
# and none of the background traffic a fresh profile starts.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Playwright's per-action wait; longer waits (a run training) pass their own timeout.
ACTION_TIMEOUT_MS = 20_000

expect.set_options(timeout=ACTION_TIMEOUT_MS)


@dataclass
class ConsoleWatch:
    """Collects console errors and uncaught exceptions; `allow` names the ones a test provokes."""

    errors: list[str] = field(default_factory=list)
    allowed: list[re.Pattern[str]] = field(default_factory=list)

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"{message.text} (at {message.location.get('url', '?')})")

    def on_page_error(self, error: Exception) -> None:
        self.errors.append(f"uncaught: {error}")

    def allow_http_error(self, path: str, status: int) -> None:
        """Chromium logs every non-2xx fetch; this one is the test's doing."""
        self.allowed.append(re.compile(rf"status of {status} .*\(at https?://[^/]+{re.escape(path)}"))

    def allow(self, pattern: str) -> None:
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(p.search(e) for p in self.allowed)]

    def assert_clean(self) -> None:
        assert not self.unexpected(), "browser console errors:\n" + "\n".join(self.unexpected())


def off_loop(fn: Callable[[], T]) -> T:
    """Runs Django code from a test that drives a page.

    Playwright's sync API keeps an event loop on the test's thread, where Django refuses ORM
    calls and `async_to_sync` (which publishes events) cannot run; a thread of its own has no
    loop. It gets its own database connection, which is fine in `transaction=True` tests.
    """

    def call() -> T:
        try:
            return fn()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result()


@pytest.fixture
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def console() -> ConsoleWatch:
    return ConsoleWatch()


@pytest.fixture
def browser_page(browser: Browser, console: ConsoleWatch) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(ACTION_TIMEOUT_MS)
    page.on("console", console.on_console)
    page.on("pageerror", console.on_page_error)
    yield page
    context.close()
    console.assert_clean()  # also checked at the end of each test, where it fails the test itself


def log_in(page: Page, server_url: str, username: str, password: str) -> None:
    page.goto(f"{server_url}/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()


def screenshot(page: Page, name: str) -> Path:
    OUTPUT.mkdir(exist_ok=True)
    path = OUTPUT / name
    page.screenshot(path=str(path), full_page=True)
    return path

"""A real headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ending in NUL, commands on the browser's fd 3, answers and events on its fd 4), so a
test needs no driver and no Python package beyond the standard library. ``make test`` installs
Debian's ``chromium``; without it the test fails saying so."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

MISSING = (
    "chromium is not installed: the dashboard test drives a real headless Chromium "
    "(`make test` installs Debian's chromium; or apt-get install chromium)"
)


class BrowserError(AssertionError):
    pass


def chromium_path() -> str:
    """Where chromium is; fails (never skips) saying how to get it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise BrowserError(MISSING)
    return found


class Browser:
    """One tab of a headless Chromium whose profile lives in ``profile``."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000) -> None:
        chromium = chromium_path()
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        args = [
            "--headless",
            "--remote-debugging-pipe",
            "--no-sandbox",  # a test runs as root in containers; the page is our own
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        # bash puts the pipes at fds 3 and 4, where the browser looks for them.
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        profile.mkdir(parents=True, exist_ok=True)
        self.log = (profile / "chromium.log").open("wb")
        self.proc = subprocess.Popen(
            ["bash", "-c", script, chromium, *args],  # bash: dash takes one-digit fds only
            pass_fds=(to_browser_r, from_browser_w),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None
        target = self.command("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.command("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.command(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise BrowserError("chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise BrowserError(f"chromium exited (code {self.proc.poll()}); its log: {self.log.name}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def command(self, method: str, timeout_s: float = 60, **params: Any) -> dict[str, Any]:
        """Sends one DevTools command (to the tab once attached) and returns its result; events
        that arrive meanwhile are dropped."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def goto(self, url: str) -> None:
        self.command("Page.navigate", url=url)

    def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.command(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_js(self, expression: str, timeout_s: float, what: str) -> Any:
        """Polls a JavaScript expression until it is truthy; fails naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.js(expression)
            except BrowserError:  # the page is still loading: no document to evaluate in yet
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what} ({expression})")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        """The whole page, as PNG."""
        height = int(self.js("document.documentElement.scrollHeight"))
        width = int(self.js("document.documentElement.scrollWidth"))
        self.command(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        data = self.command("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):  # it may have gone already
            self.command("Browser.close", timeout_s=10)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self.log.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

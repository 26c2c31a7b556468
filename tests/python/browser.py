"""A real browser for the tests: headless Chromium (Debian's ``chromium``, installed by
scripts/setup.sh) driven over the Chrome DevTools Protocol on ``--remote-debugging-pipe``.

Enough of the protocol (https://chromedevtools.github.io/devtools-protocol/) to open a page,
collect what it logs, the errors it throws and the requests it makes, evaluate JavaScript, move
the mouse, click at a point and take a screenshot; no Selenium or driver download. Messages are
JSON, each ended by a NUL byte; Chromium reads commands on fd 3 and writes replies and events on
fd 4.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any


def chromium_path() -> str | None:
    """The Chromium binary: $DYNAPROBE_CHROMIUM, else ``chromium`` on PATH."""
    return os.environ.get("DYNAPROBE_CHROMIUM") or shutil.which("chromium")


class BrowserError(RuntimeError):
    """The browser did not answer as the protocol says, or a command failed."""


class Browser:
    """One headless Chromium with one page. Use as a context manager.

    Attributes:
        console: ``(level, text)`` of every console message and log entry of the page.
        exceptions: the text of every uncaught exception.
        requests: the URL of every request the page made.
    """

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 60.0):
        binary = chromium_path()
        if binary is None:
            raise BrowserError("chromium not found: apt-get install chromium (scripts/setup.sh)")
        self.timeout = timeout
        self.console: list[tuple] = []
        self.exceptions: list[str] = []
        self.requests: list[str] = []
        self._profile = tempfile.mkdtemp(prefix="dynaprobe-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Above the fds the child gets, so the dup2 below never overwrites one it still needs.
        high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 100)
        high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 100)
        os.close(to_browser_r)
        os.close(from_browser_w)

        def child_fds() -> None:
            os.dup2(high_r, 3)  # inheritable, unlike the originals
            os.dup2(high_w, 4)

        self._process = subprocess.Popen(
            [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-sync", "--mute-audio",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # preexec_fn only dup2()s two fds, which is safe after fork even with threads.
            preexec_fn=child_fds, pass_fds=(3, 4))  # noqa: PLW1509
        os.close(high_r)
        os.close(high_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self._session: str | None = None
        targets = self.call("Target.getTargets", session=False)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self._session = self.call("Target.attachToTarget", {"targetId": page["targetId"],
                                                            "flatten": True},
                                  session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    # -- protocol
    def _send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to_browser, data):]

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise BrowserError(f"chromium did not answer within {self.timeout} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError("chromium closed its DevTools pipe (did it crash?)")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        parsed = json.loads(message)
        if "method" in parsed:
            self._record(parsed)
        return parsed

    def _record(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        params = event.get("params", {})
        if event["method"] == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.console.append((params["type"], text))
        elif event["method"] == "Log.entryAdded":
            self.console.append((params["entry"]["level"], params["entry"]["text"]))
        elif event["method"] == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.exceptions.append(details.get("exception", {}).get("description")
                                   or details.get("text", ""))
        elif event["method"] == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: bool = True) -> dict[str, Any]:
        """Sends a command (to the page unless ``session`` is False) and returns its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self._session:
            message["sessionId"] = self._session
        self._send(message)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def wait_for_event(self, method: str) -> dict[str, Any]:
        """The next event called ``method`` (one already received counts once)."""
        deadline = time.monotonic() + self.timeout
        while True:
            for index, event in enumerate(self._events):
                if event["method"] == method:
                    return self._events.pop(index)
            self._receive(deadline)

    # -- what the tests do
    def open(self, url: str) -> None:
        """Loads ``url`` and waits for its load event."""
        self._events.clear()
        self.call("Page.navigate", {"url": url})
        self.wait_for_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, expression: str) -> Any:
        """Waits until a JavaScript expression is truthy (the page's asynchronous start-up) and
        returns its value; raises BrowserError after the timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression} still false after {self.timeout} s "
                                   f"(errors: {self.errors()})")
            time.sleep(0.05)

    def click(self, x: float, y: float) -> None:
        """A left click at page coordinates (x, y), as a user's mouse makes it."""
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left",
                                                   "clickCount": 0 if kind == "mouseMoved" else 1})

    def hover(self, x: float, y: float) -> None:
        """Moves the mouse to page coordinates (x, y) without a click."""
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def screenshot(self, path: str, full_page: bool = False) -> None:
        """Writes a PNG of the page (the whole page when ``full_page``)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                              "scale": 1}
            params["captureBeyondViewport"] = True
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", params)["data"]))

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions so far."""
        return self.exceptions + [text for level, text in self.console if level == "error"]

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False)
        except (BrowserError, OSError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:  # noqa: PYI034 (typing.Self needs Python 3.11; we support 3.10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

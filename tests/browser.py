"""A small Chrome DevTools Protocol driver for the dashboard tests: headless Chromium, one page.

    with Browser() as b:
        b.goto(url)
        b.wait("document.querySelectorAll('tr.job').length > 0")
        b.js("document.querySelector('tr.job').click()")

Needs a Chromium binary and the `websocket-client` package (`import websocket`). Every wait polls a JS
condition in the page until it is truthy (no fixed sleeps); `exceptions` collects the page's uncaught
JS exceptions and unhandled promise rejections for the whole session.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time

try:
    import websocket
except ImportError:  # the tests skip with a reason (tests.conftest.need)
    websocket = None

# Headless, and quiet: no network of its own, nothing on first run.
HEADLESS_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-extensions", "--mute-audio"]
FLAGS = [*HEADLESS_FLAGS, "--remote-debugging-port=0"]


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


def launch(args: list[str], profile: str, **popen) -> subprocess.Popen:
    """Chromium with `args` and its profile folder `profile`, in its own process group (``kill_group``
    ends its helper processes too) and with TMPDIR in the profile (its singleton-socket folder,
    org.chromium.Chromium.*, outlives a killed Chromium: it goes with the profile)."""
    binary = chromium_binary()
    if binary is None:
        raise BrowserError("no Chromium binary found")
    return subprocess.Popen([binary, f"--user-data-dir={profile}", *args], start_new_session=True,
                            env={**os.environ, "TMPDIR": profile}, **popen)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, width: int = 1400, height: int = 900, start_timeout: float = 30):
        if websocket is None:
            raise BrowserError("the websocket-client package is not installed (pip install websocket-client)")
        self.profile = tempfile.TemporaryDirectory(prefix="lmscope-chromium-", ignore_cleanup_errors=True)
        self.proc = launch([*FLAGS, f"--window-size={width},{height}", "about:blank"], self.profile.name,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.exceptions: list[str] = []
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        try:
            browser_ws = self._devtools_url(start_timeout)
            # One page target: the tab Chromium opened. Find it through the browser endpoint.
            self._ws = websocket.create_connection(browser_ws, suppress_origin=True, timeout=start_timeout)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
            targets = self.send("Target.getTargets")["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            self._session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            for domain in ("Page", "Runtime"):
                self.page(f"{domain}.enable")
            self.resize(width, height)
        except Exception:
            self.close()
            raise

    # ------------------------------------------------------------ protocol

    def _devtools_url(self, timeout: float) -> str:
        # A thread reads stderr, so a Chromium that hangs without a word cannot block past the deadline;
        # it goes on draining the pipe afterwards, so Chromium never blocks on a full one.
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stderr], daemon=True).start()
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            if line.startswith("DevTools listening on "):
                return line.split(" on ", 1)[1].strip()
        raise BrowserError("Chromium did not start: " + "".join(seen[-20:]))

    def _read(self):
        while True:
            try:
                message = json.loads(self._ws.recv())
            except Exception:
                for q in list(self._replies.values()):
                    q.put({"error": {"message": "connection to Chromium closed"}})
                return
            if "id" in message:
                q = self._replies.get(message["id"])
                if q is not None:
                    q.put(message)
            else:
                self._event(message)

    def _event(self, message: dict):
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            text = (d.get("exception") or {}).get("description") or d.get("text", "")
            self.exceptions.append(f"{text} at {d.get('url', '')}:{d.get('lineNumber')}")

    def send(self, method: str, session: str | None = None, timeout: float = 60, **params) -> dict:
        i = next(self._ids)
        q: queue.Queue = queue.Queue()
        self._replies[i] = q
        message = {"id": i, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        with self._lock:
            self._ws.send(json.dumps(message))
        try:
            reply = q.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no reply in {timeout}s") from None
        finally:
            self._replies.pop(i, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def page(self, method: str, **params) -> dict:
        """A command to the page (its session)."""
        return self.send(method, session=self._session, **params)

    # ------------------------------------------------------------ what tests use

    def resize(self, width: int, height: int, mobile: bool = False):
        self.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=mobile)

    def goto(self, url: str, ready: str = "document.readyState === 'complete'", timeout: float = 30):
        self.page("Page.navigate", url=url)
        self.wait(ready, timeout=timeout)

    def js(self, expression: str):
        """The value of a JS expression (a promise is awaited); a JS error raises BrowserError."""
        result = self.page("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            d = result["exceptionDetails"]
            raise BrowserError(f"{expression[:200]!r} threw: "
                               f"{(d.get('exception') or {}).get('description') or d.get('text')}")
        return result["result"].get("value")

    def wait(self, condition: str, timeout: float = 30, interval: float = 0.05):
        """Poll a JS expression until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            try:
                last = self.js(f"(() => {{ try {{ const v = ({condition}); return v instanceof Node ? true : v; }} "
                              "catch (e) { return false; } })()")
            except BrowserError:
                last = None  # e.g. the page is being replaced by a navigation
            if last:
                return last
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout}s: {condition}")
            time.sleep(interval)

    def click(self, selector: str):
        """Click the first element matching a CSS selector (it must exist)."""
        found = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (e) e.click(); return !!e; }})()")
        if not found:
            raise BrowserError(f"nothing matches {selector}")

    def text(self, selector: str) -> str | None:
        return self.js(f"document.querySelector({json.dumps(selector)})?.textContent ?? null")

    def close(self):
        try:
            if getattr(self, "_ws", None) is not None:
                self._ws.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    kill_group(self.proc)
            self.profile.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

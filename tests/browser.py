"""Open a page in headless Chromium and ask it questions, over the Chrome DevTools Protocol on a pipe.

No driver, no extra package: Chromium started with --remote-debugging-pipe reads NUL-terminated JSON commands on
fd 3 and answers on fd 4. Used by the report test; it needs Debian's `chromium` (apt install chromium).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
# offline and quiet: no sync, no component updates, no background fetches (they would be refused here anyway)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--remote-debugging-pipe",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--window-size=1200,900",
]


def inspect_page(url: str, expressions: dict[str, str], screenshot: str | None = None, timeout_s: float | None = None):
    """Load `url`, evaluate each JS expression once the page is complete, optionally save a full-page PNG. No limit on
    how long Chromium takes unless timeout_s (a loaded machine makes it slow, not wrong); its exit ends the wait.

    Returns (values by name, console errors and uncaught exceptions, URLs the page requested over the network)."""
    to_chrome, from_chrome = os.pipe(), os.pipe()

    def as_fds_3_and_4():  # in the child: our pipe ends become the fds Chromium expects
        a, b = os.dup(to_chrome[0]), os.dup(from_chrome[1])
        os.dup2(a, 3)
        os.dup2(b, 4)
        os.set_inheritable(3, True)
        os.set_inheritable(4, True)

    with tempfile.TemporaryDirectory(prefix="t2g-chromium-") as profile:
        proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            preexec_fn=as_fds_3_and_4,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome[0])
        os.close(from_chrome[1])
        events, state = [], {"id": 0, "buf": b""}
        deadline = time.monotonic() + (float("inf") if timeout_s is None else timeout_s)

        def send(method, params=None, session=None):
            state["id"] += 1
            msg = {"id": state["id"], "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            os.write(to_chrome[1], json.dumps(msg).encode() + b"\0")
            while True:
                while b"\0" not in state["buf"]:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"chromium did not answer {method} within {timeout_s} s")
                    chunk = os.read(from_chrome[0], 1 << 16)
                    if not chunk:
                        raise RuntimeError(f"chromium closed the pipe during {method}")
                    state["buf"] += chunk
                raw, state["buf"] = state["buf"].split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == state["id"]:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
                events.append(reply)

        try:
            target = send("Target.createTarget", {"url": "about:blank"})["targetId"]
            sid = send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page", "Network"):
                send(f"{domain}.enable", session=sid)
            send("Page.navigate", {"url": url}, session=sid)
            evaluate = lambda expr: send(  # noqa: E731
                "Runtime.evaluate",
                {"expression": expr, "returnByValue": True, "awaitPromise": True},  # noqa
                session=sid,
            )["result"].get("value")
            while evaluate("document.readyState") != "complete":
                time.sleep(0.05)
            values = {name: evaluate(expr) for name, expr in expressions.items()}
            if screenshot:
                png = send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=sid)
                with open(screenshot, "wb") as f:
                    f.write(base64.b64decode(png["data"]))
            send("Browser.close")
        finally:
            os.close(to_chrome[1])
            os.close(from_chrome[0])
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    errors = [
        e["params"]
        for e in events
        if e.get("method") == "Runtime.exceptionThrown"
        or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") == "error")
        or (e.get("method") == "Log.entryAdded" and e["params"]["entry"].get("level") == "error")
    ]
    requested = [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]
    return values, errors, [u for u in requested if not u.startswith(("data:", "file:", "about:"))]

"""Airflow's UI in headless Chromium, driven through the DevTools protocol, for the tests and the
docs' screenshots: `HeadlessChromium` (one page: go to a URL, run JavaScript, click as a mouse
does, capture a PNG) and the steps both take in the UI (log in with a REST API token, open a
DAG's trigger form, open one of its sections)."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request
from itertools import count
from pathlib import Path
from typing import Any

from tools.airflow_components import wait_for

# The trigger form: the dialog the "Trigger" button opens.
FORM = ".chakra-dialog__content"
# The headless flags: no sandbox (containers run as root), no GPU, /tmp instead of /dev/shm.
HEADLESS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars")


class HeadlessChromium:
    """A headless Chromium (`binary`, its profile in `profile`) with one page of `width` x
    `height` CSS pixels, driven through the DevTools protocol; a context manager that ends the
    browser."""

    def __init__(self, binary: str, profile: Path, width: int = 1400, height: int = 900):
        import websocket

        profile.mkdir(parents=True, exist_ok=True)
        port_file = profile / "DevToolsActivePort"  # a browser's before this one: not ours
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [binary, *HEADLESS, "--remote-debugging-port=0", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for("chromium's DevTools port", port_file.is_file, 60, profile, interval=0.2)
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10) as r:
                page = next(t for t in json.loads(r.read()) if t["type"] == "page")
            self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        except BaseException:
            self.close()
            raise
        self._ids = count(1)
        self.cdp("Network.enable")
        self.cdp("Emulation.setDeviceMetricsOverride", width=width, height=height,
                 deviceScaleFactor=1, mobile=False)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)

    def cdp(self, method: str, **params: Any) -> dict:
        """One DevTools protocol command; its result (the events in between are dropped)."""
        msg_id = next(self._ids)
        self.socket.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.socket.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.cdp("Runtime.evaluate", expression=expression, returnByValue=True,
                          awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def go(self, url: str) -> None:
        self.cdp("Page.navigate", url=url)

    def click(self, label: str | None, selector: str = "button") -> bool:
        """A real mouse click on the visible element matching `selector` whose text is `label`
        (None: the first visible one); False when there is none. Airflow's UI ignores
        element.click()."""
        at = self.js(
            f"(() => {{ const b = [...document.querySelectorAll({json.dumps(selector)})].find("
            f"b => b.getClientRects().length && ({json.dumps(label)} === null || "
            f"b.innerText.trim() === {json.dumps(label)})); if (!b) return null; "
            "b.scrollIntoView({block: 'center'}); const r = b.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased") if at else ():
            self.cdp("Input.dispatchMouseEvent", type=kind, x=at[0], y=at[1], button="left",
                     clickCount=1)
        return bool(at)

    def screenshot(self, clip: dict[str, float] | None = None) -> bytes:
        """The page as a PNG: the viewport, or `clip` ({x, y, width, height} in CSS pixels of
        the page's layout, which may lie beyond the viewport)."""
        params: dict[str, Any] = {"format": "png"}
        if clip is not None:
            params.update(clip={**clip, "scale": 1}, captureBeyondViewport=True)
        return base64.b64decode(self.cdp("Page.captureScreenshot", **params)["data"])


def log_in(browser: HeadlessChromium, url: str, token: str) -> None:
    """Logged in to the Airflow UI at `url`: a REST API token as the UI's `_token` cookie."""
    browser.cdp("Network.setCookie", name="_token", value=token, url=url)


def open_trigger_form(browser: HeadlessChromium, url: str, dag_id: str, logs: Path) -> None:
    """The DAG's page, then its "Trigger" button, until the form shows its sections."""
    browser.go(f"{url}/dags/{dag_id}")
    wait_for("the Trigger button", lambda: browser.click("Trigger"), 90, logs, interval=2)
    wait_for("the trigger form's sections", lambda: browser.js(
        f"document.querySelectorAll('{FORM} [data-scope=accordion][data-part=item]').length")
        > 1, 60, logs, interval=0.5)


def open_form_section(browser: HeadlessChromium, section: str) -> None:
    """Open one section of the trigger form (an accordion: the one open before closes)."""
    browser.click(section)
    time.sleep(0.7)  # the accordion's animation


def open_preset_list(browser: HeadlessChromium) -> list[str]:
    """Open the list of the open section's first select (the Preset section's: the presets);
    the options it shows."""
    browser.click(None, f"{FORM} input[aria-expanded]")
    time.sleep(1)
    return browser.js("[...document.querySelectorAll('[role=option]')]"
                      ".filter(o => o.getClientRects().length).map(o => o.innerText.trim())")

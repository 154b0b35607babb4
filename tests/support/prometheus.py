"""A real Prometheus (Debian's) scraping exporters the tests serve (`start_prometheus`), and an
exporter of text the test chooses (`TextExporter`)."""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from finetune.etcd import free_port
from tests.support.system import system_binary_or_skip


class TextExporter(http.server.ThreadingHTTPServer):
    """Serves `body()` in Prometheus's text format on loopback, counting its scrapes."""

    def __init__(self, body: Callable[[int], str] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.scrapes = 0
        self._body = body
        self.lock = threading.Lock()

    def body(self) -> str:
        with self.lock:
            scrape = self.scrapes
            self.scrapes += 1
        return self._body(scrape) if self._body else ""

    def start(self) -> str:
        """Serve from a thread; the target to scrape (host:port)."""
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return f"127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.body().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def start_prometheus(tmp: Path, targets: list[str]) -> tuple[subprocess.Popen, str]:
    """A real Prometheus on loopback scraping `targets` every second."""
    binary = system_binary_or_skip("prometheus", "prometheus")
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "dcgm", "honor_labels": True,
                            "static_configs": [{"targets": targets}]}],
    }))
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    pytest.fail(f"Prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}")

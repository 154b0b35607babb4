"""The CLI's REST client against a real HTTP server that answers late: a read is asked again,
a write is not (it may have been done), and giving up says why in one line; following a run
prints each task's state change once and gives up after its timeout, saying the run goes on."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from finetune.cli import GET_ATTEMPTS, AirflowClient, CliError, follow


class SlowServer(http.server.ThreadingHTTPServer):
    """Answers each request after the next of `delays` seconds (then at once)."""

    def __init__(self, delays: list[float]):
        self.delays, self.requests = delays, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(handler) -> None:
                self.requests.append((handler.command, handler.path))
                time.sleep(self.delays.pop(0) if self.delays else 0)
                body = json.dumps({"state": "running"}).encode()
                try:
                    handler.send_response(200)
                    handler.send_header("Content-Type", "application/json")
                    handler.send_header("Content-Length", str(len(body)))
                    handler.end_headers()
                    handler.wfile.write(body)
                except OSError:  # the client gave up on this one
                    pass

            do_GET = do_POST = _answer

            def log_message(handler, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server(request):
    s = SlowServer(list(request.param))
    yield s
    s.shutdown()


@pytest.mark.parametrize("server", [[1.0]], indirect=True)
def test_a_read_that_times_out_is_asked_again(server, capsys):
    client = AirflowClient(server.url, token="t", timeout=0.3)
    assert client.call("GET", "/api/v2/dags/x/dagRuns/y") == (200, {"state": "running"})
    assert len(server.requests) == 2
    assert "asking again" in capsys.readouterr().err


@pytest.mark.parametrize("server", [[1.0] * GET_ATTEMPTS], indirect=True)
def test_a_read_that_never_answers_in_time_fails_saying_so(server):
    client = AirflowClient(server.url, token="t", timeout=0.3)
    with pytest.raises(CliError, match=f"did not answer GET /api/v2/x within 0.3 s "
                                       f"\\({GET_ATTEMPTS} tries\\)"):
        client.call("GET", "/api/v2/x")


@pytest.mark.parametrize("server", [[1.0]], indirect=True)
def test_a_write_that_times_out_is_not_sent_twice(server):
    client = AirflowClient(server.url, token="t", timeout=0.3)
    with pytest.raises(CliError, match="did not answer POST"):
        client.call("POST", "/api/v2/dags/x/dagRuns", {"conf": {}})
    time.sleep(0.8)
    assert server.requests == [("POST", "/api/v2/dags/x/dagRuns")]


class RunStates:
    """An AirflowClient stand-in whose run goes through `states`, one per look; its one task
    goes queued -> running -> success alongside."""

    def __init__(self, states: list[str]):
        self.states, self.looks = states, 0

    def call(self, method: str, path: str, body: object = None) -> tuple[int, dict]:
        if path.endswith("/taskInstances?limit=100"):
            state = ("queued", "running", "success")[min(self.looks - 1, 2)]
            return 200, {"task_instances": [{"task_id": "train", "state": state}]}
        state = self.states[min(self.looks, len(self.states) - 1)]
        self.looks += 1
        return 200, {"state": state}


def test_follow_prints_each_task_state_change_once_and_returns_the_runs_end(capsys):
    client = RunStates(["queued", "running", "running", "success"])
    assert follow(client, "dag", "run", poll_s=0.01) == "success"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines] == ["queued", "running", "success"]


def test_follow_prints_each_mapped_task_instance_by_its_index(capsys):
    class Trials(RunStates):
        def call(self, method: str, path: str, body: object = None) -> tuple[int, dict]:
            if path.endswith("/taskInstances?limit=100"):
                return 200, {"task_instances": [
                    {"task_id": "trial.train", "map_index": i, "state": state}
                    for i, state in enumerate(("success", "running"))]}
            return super().call(method, path, body)

    assert follow(Trials(["running", "success"]), "dag", "run", poll_s=0.01) == "success"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1:] for line in lines] == [["trial.train[0]", "success"],
                                                     ["trial.train[1]", "running"]]


def test_follow_gives_up_after_its_timeout_saying_the_run_goes_on():
    with pytest.raises(CliError, match=r"run r still running after 0 s \(it goes on in Airflow"):
        follow(RunStates(["running"]), "dag", "r", poll_s=0.01, timeout_s=0.05)

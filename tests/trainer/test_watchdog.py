"""The hang watchdog alone (trainer/watchdog.py): whom a hang record names, and a watchdog that
fires in a process of its own (it ends that process)."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support import REPO_ROOT
from trainer.errors import read_root_cause
from trainer.watchdog import HANG_EXIT_CODE, Heartbeat, hang_message

NOW = 1_800_000_000.0


def beat(rank: int, step: int, beat_age_s: float) -> Heartbeat:
    return Heartbeat(rank=rank, pid=100 + rank, host="node-a", restart=0, step=step,
                     progress_time=NOW - 60, beat_time=NOW - beat_age_s)


def test_a_peer_that_stopped_beating_is_named_before_one_that_is_behind():
    beats = [beat(0, 5, 1), beat(1, 5, 40), beat(2, 4, 1)]
    message = hang_message(0, 61, 5, beats, NOW, stale_after_s=3)
    assert message.startswith("training hang: rank 0 made no progress for 61 s after step 5")
    assert "rank 1 (pid 101 on node-a) stopped responding: no heartbeat for 40 s" in message
    assert "rank 2" not in message


def test_a_peer_behind_is_named_when_every_rank_still_beats():
    message = hang_message(0, 61, 5, [beat(0, 5, 1), beat(1, 4, 1)], NOW, stale_after_s=3)
    assert "rank 1 (pid 101 on node-a) is behind, at step 4" in message


def test_with_every_visible_rank_waiting_the_record_says_so_and_points_at_the_dumps():
    message = hang_message(1, 61, 5, [beat(0, 5, 1), beat(1, 5, 1)], NOW, stale_after_s=3)
    assert "no rank it can see (ranks 0, 1) stopped or fell behind" in message
    assert "see hangs/" in message


FIRES = """
import sys, time
from trainer.watchdog import HangWatchdog
HangWatchdog(sys.argv[1], sys.argv[1], rank=0, timeout_s=1).start().progress(3)
time.sleep(30)  # stuck: no progress after step 3
"""


@pytest.mark.slow  # a process left without progress until its watchdog ends it
def test_a_watchdog_without_progress_dumps_records_and_ends_its_process(tmp_path):
    (tmp_path / "heartbeats").mkdir()
    peer = Heartbeat(rank=1, pid=4242, host="node-b", restart=0, step=3,
                     progress_time=time.time() - 60, beat_time=time.time() - 60)
    (tmp_path / "heartbeats" / "rank_1.json").write_text(json.dumps(peer.__dict__))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TORCHELASTIC_RESTART_COUNT": "0"}
    started = time.time()
    done = subprocess.run([sys.executable, "-c", FIRES, str(tmp_path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)

    assert done.returncode == HANG_EXIT_CODE, done.stderr
    cause = read_root_cause(str(tmp_path))
    assert cause["type"] == "TrainingHang" and cause["rank"] == 0
    assert "after step 3" in cause["message"]
    assert "rank 1 (pid 4242 on node-b) stopped responding" in cause["message"]
    assert cause["time"] - started < 20
    dump = (tmp_path / "hangs" / "rank_0.txt").read_text()
    assert cause["message"] in dump and '"pid": 4242' in dump
    assert "time.sleep" in dump or 'File "<string>"' in dump  # the main thread's stack
    beat_now = json.loads((tmp_path / "heartbeats" / "rank_0.json").read_text())
    assert beat_now["step"] == 3 and beat_now["pid"] != os.getpid()

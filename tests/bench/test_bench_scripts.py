"""The device-call scripts (bench/*.sh): every run's JSON lines land in the log, and the script
exits 1 when any run failed (bench.train reports a run's exception as an error row and exits 0),
so a device call's exit status says whether all ran. A stub bench.train stands in (no GPU)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

SCRIPTS = {  # script: (a part, its log)
    "float8.sh": ("titan", "float8.jsonl"),
    "long_context.sh": ("short", "long_context.jsonl"),
    "full_8b.sh": ("pick", "full_8b.jsonl"),
    "fa4_packing.sh": ("losses", "fa4_packing.jsonl"),
}


def test_every_device_call_script_is_checked_here():
    """A new bench/*.sh (lib.sh is what they share) joins SCRIPTS, so its exit is tested too."""
    on_disk = {path.name for path in (REPO_ROOT / "bench").glob("*.sh")} - {"lib.sh"}
    assert on_disk == set(SCRIPTS)


def stub(tmp_path: Path, fail_on: str) -> None:
    """A bench/train.py that prints a row (an error row when its arguments hold `fail_on`)
    and appends its arguments to argv.jsonl."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "train.py").write_text(
        "import json, sys\n"
        "with open('argv.jsonl', 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"failed = {fail_on!r} in sys.argv\n"
        "row = {'error': 'OutOfMemoryError'} if failed else {'tokens_per_s': 1}\n"
        "print(json.dumps({'run': 'trainer', 'args': sys.argv[1:], **row}))\n")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("fail_on", ["", "--steps"])
def test_a_bench_script_logs_every_run_and_exits_1_when_one_failed(tmp_path, script, fail_on):
    part, log = SCRIPTS[script]
    stub(tmp_path, fail_on or "no such argument")
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["bash", str(REPO_ROOT / "bench" / script), str(out), part],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = (out / log).read_text().splitlines()
    rows = [line for line in lines if line.startswith("{")]
    assert len(rows) >= 2 and len(rows) == sum(line.startswith("# ") for line in lines)
    assert done.returncode == (1 if fail_on else 0), done.stderr


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_bench_script_refuses_a_part_it_does_not_have_and_runs_nothing(tmp_path, script):
    stub(tmp_path, "no such argument")
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["bash", str(REPO_ROOT / "bench" / script), str(out), "no-such-part"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown PART 'no-such-part'" in done.stderr
    assert not list(out.iterdir())


def script_parts(script: str) -> list[str]:
    """The PARTs a script's `case` takes (each `name)` line)."""
    text = (REPO_ROOT / "bench" / script).read_text()
    return re.findall(r"^([a-z0-9][a-z0-9-]*)\)$", text, flags=re.MULTILINE)


def test_every_run_of_every_part_of_every_script_parses_as_bench_train_reads_it(tmp_path):
    """A mistyped or dropped option would cost a device call; here each run's arguments, as the
    script passes them, go through bench.train's own parser (a stub records them)."""
    from bench.train import parse_args

    stub(tmp_path, "no such argument")
    for script in sorted(SCRIPTS):
        parts = script_parts(script)
        assert SCRIPTS[script][0] in parts
        for part in parts:
            (tmp_path / "argv.jsonl").unlink(missing_ok=True)
            out = tmp_path / f"out-{script}-{part}"
            out.mkdir()
            done = subprocess.run(["bash", str(REPO_ROOT / "bench" / script), str(out), part],
                                  cwd=tmp_path, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (script, part, done.stderr)
            runs = (tmp_path / "argv.jsonl").read_text().splitlines()
            assert runs, f"bench/{script} {part} runs nothing"
            for line in runs:
                try:
                    parse_args(json.loads(line))
                except SystemExit:
                    pytest.fail(f"bench/{script} {part}: bench.train refuses {line}")


@pytest.mark.parametrize("script", ["float8.sh", "long_context.sh", "full_8b.sh"])
def test_attention_in_the_environment_reaches_ours_and_a_peer_only_run_keeps_none(tmp_path,
                                                                                  script):
    from bench.train import parse_args

    stub(tmp_path, "no such argument")
    out = tmp_path / "out"
    out.mkdir()
    part = SCRIPTS[script][0]
    done = subprocess.run(["bash", str(REPO_ROOT / "bench" / script), str(out), part],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ATTENTION": "fa4,sdpa"})
    assert done.returncode == 0, done.stderr
    parsed = [parse_args(json.loads(line))
              for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert [args.attention for args in parsed if args.attention] == (
        [["fa4", "sdpa"]] * sum(bool(args.attention) for args in parsed))
    assert any(args.attention for args in parsed)


def runs_of(tmp_path: Path, script: str, *args: str) -> list[list[str]]:
    """bench/SCRIPT OUT ARGS... with the stub bench.train (stub()): each run's arguments."""
    out = tmp_path / f"out-{'-'.join(args)}"
    out.mkdir()
    (tmp_path / "argv.jsonl").unlink(missing_ok=True)
    done = subprocess.run(["bash", str(REPO_ROOT / "bench" / script), str(out), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("script", "part"), [("full_8b.sh", "float8"), ("float8.sh", "titan"),
                                             ("float8.sh", "3b")])
def test_a_float8_part_with_a_recipe_runs_that_recipe_alone(tmp_path, script, part):
    stub(tmp_path, "no such argument")
    recipes = {}
    for given in ([], ["rowwise"]):
        runs = runs_of(tmp_path, script, part, *given)
        recipes[tuple(given)] = sorted({run[run.index("--float8-recipe") + 1] for run in runs})
    assert recipes == {(): ["rowwise", "tensorwise"], ("rowwise",): ["rowwise"]}


def test_the_float8_loss_part_runs_the_model_given_and_1b_without_one(tmp_path):
    stub(tmp_path, "no such argument")
    models = {}
    for given in ([], ["3b"]):
        runs = runs_of(tmp_path, "float8.sh", "loss", *given)
        assert len(runs) == 4  # bf16, tensorwise, rowwise, bf16 from another seed
        models[tuple(given)] = {run[run.index("--models") + 1] for run in runs}
    assert models == {(): {"1b"}, ("3b",): {"3b"}}

"""The Unsloth peer's pure parts (bench/unsloth.py), without Unsloth installed."""

import subprocess
import sys

import pytest

from bench.train import PEERS, parse_args, peer_child_argv, peer_command, peer_problem


@pytest.mark.parametrize("flags", [[], ["--lora-rank", "16", "--float8"],
                                   ["--lora-rank", "16", "--tp-degree", "2"]])
def test_unsloth_refuses_before_any_cost_what_it_would_not_run_as_ours_does(flags):
    args = parse_args(["--models", "8b", "--peers", "unsloth", *flags])
    assert "Unsloth" in peer_problem("unsloth", "llama-8b", args)


def test_unsloth_runs_lora_and_qlora():
    for flags in (["--lora-rank", "16"], ["--lora-rank", "16", "--quantize-base", "nf4"]):
        args = parse_args(["--models", "8b", "--peers", "unsloth", *flags])
        assert peer_problem("unsloth", "llama-8b", args) is None
    assert PEERS["unsloth"] == "unsloth"


def test_the_unsloth_child_imports_unsloth_before_transformers(tmp_path):
    """Unsloth patches transformers and peft when imported: the child must import it first.
    A stand-in `unsloth` on the path says whether transformers was already loaded."""
    (tmp_path / "unsloth.py").write_text(
        "import sys\n"
        "raise SystemExit('transformers loaded first' if 'transformers' in sys.modules "
        "else 'unsloth first')\n")
    child = peer_child_argv(["--models", "8b", "--lora-rank", "16"], "llama-8b", "unsloth")
    env_path = f"{tmp_path}:{':'.join(sys.path)}"
    done = subprocess.run(peer_command("unsloth", child),
                          capture_output=True, text=True, env={"PYTHONPATH": env_path},
                          timeout=120, check=False)
    assert done.stderr.strip().splitlines()[-1] == "unsloth first", done.stderr

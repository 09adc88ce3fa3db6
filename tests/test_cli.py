"""The command line: one streamed generation, and one-line errors for user mistakes."""

import pytest

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

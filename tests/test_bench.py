"""The benchmark: workloads (built-in sets and a user's JSONL), chat formatting with cutting,
a small sweep against plain decoding, the report rebuilt from results.json, optional peers
skipped with a note, and one-line errors for user mistakes."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdraft.api import build_engine
from specdraft.bench import peers as peers_mod
from specdraft.bench.harness import BenchConfig, MethodSpec, Request, batches, build_requests, rounds, run_bench
from specdraft.bench.report import write_report
from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.sequence import GenerationConfig
from specdraft.workloads import (WORKLOADS, Prompt, data_file, datasets_dir, fit_messages, load_workload, read_jsonl,
                                 workload_label)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"




def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specdraft: error:"), err
    return lines[0]


@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    from specdraft.model.loader import load

    return load(str(tiny_gguf))


# ============================================================================ 1. built-in workloads

# workload -> (prompts in the shipped evaluation sets, user turns per prompt); counts from specdraft/data/README.md
EXPECTED = {
    "summarization": (60, 1), "rag": (60, 1), "translation": (60, 1), "qa": (60, 1), "math": (60, 1),
    "chat": (8 + 7 + 7 + 7 + 8 + 8, 2),  # MT-bench reasoning, math, coding, extraction, stem, humanities
    "creative": (8 + 7, 2),  # MT-bench writing, roleplay
    "code": (164, 1), "editing": (194, 1),
    "repeat": (60, 1),  # one per Spec-Bench summarization article
    "long_summarization": (35, 1),
}


def test_expected_table_covers_every_builtin_workload():
    assert set(EXPECTED) == set(WORKLOADS)
    for spec in WORKLOADS.values():
        assert spec.description


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builtin_workload_loads(name):
    prompts = load_workload(name)
    count, turns = EXPECTED[name]
    assert len(prompts) == count
    assert all(p.workload == name for p in prompts)
    assert all(len(p.turns) == turns for p in prompts)
    assert all(isinstance(t, str) and t.strip() for p in prompts for t in p.turns)
    assert len({p.id for p in prompts}) == len(prompts)  # ids are unique
    assert load_workload(name, limit=3) == prompts[:3]


def test_mixed_workload_takes_every_short_workload_in_turn():
    short = [w for w in WORKLOADS if w != "long_summarization"]
    prompts = load_workload("mixed", 2 * len(short) + 1)
    assert len(prompts) == 2 * len(short) + 1
    assert [p.workload for p in prompts] == [*short, *short, short[0]]
    assert prompts[0] == load_workload(short[0], 1)[0]
    assert workload_label("mixed") == "mixed"


def test_workload_labels(tmp_path):
    assert workload_label("summarization") == "summarization"
    assert workload_label("mine=/some/where/x.jsonl") == "mine"
    assert workload_label("/some/where/x.jsonl") == "x"
    path = write_jsonl(tmp_path / "a=b.jsonl", [{"prompt": "hi"}])
    assert workload_label(str(path)) == "a=b"  # an existing file is a bare path, "=" and all


def test_builtin_prompts_contain_their_source_content():
    root = datasets_dir()
    spec = {r["question_id"]: r for r in read_jsonl(data_file(root / "spec_bench", "question.jsonl"))}
    for p in load_workload("summarization"):
        rec = spec[int(p.id.split("/")[1])]
        assert rec["category"] == "summarization" and p.turns == tuple(rec["turns"])
    for p in load_workload("repeat"):
        article = spec[int(p.id.split("/")[1])]["turns"][0].removeprefix("Summarize:").strip()
        assert p.turns[0].startswith("Repeat the following text exactly")
        assert article[:200] in p.turns[0]
    mt = {r["question_id"]: r for r in read_jsonl(data_file(root / "mt_bench", "question.jsonl"))}
    for name, cats in (("chat", {"reasoning", "math", "coding", "extraction", "stem", "humanities"}),
                       ("creative", {"writing", "roleplay"})):
        for p in load_workload(name):
            rec = mt[int(p.id.split("/")[1])]
            assert rec["category"] in cats and p.turns == tuple(rec["turns"])
    humaneval = {r["task_id"]: r for r in read_jsonl(data_file(root / "humaneval", "HumanEval.jsonl"))}
    for p in load_workload("code"):
        assert humaneval[p.id]["prompt"] in p.turns[0]
    edit = {r["task_id"]: r for r in read_jsonl(data_file(root / "edit_eval", "edit_eval.jsonl"))}
    for p in load_workload("editing"):
        assert edit[p.id]["instruction"].strip() in p.turns[0] and edit[p.id]["input"] in p.turns[0]
    meetings = read_jsonl(data_file(root / "qmsum", "test.jsonl"))
    for p in load_workload("long_summarization"):
        rec = meetings[int(p.id.split("/")[1])]
        first, last = rec["meeting_transcripts"][0], rec["meeting_transcripts"][-1]
        assert f"{first['speaker']}: {first['content']}" in p.turns[0]
        assert f"{last['speaker']}: {last['content']}" in p.turns[0]
        assert len(p.turns[0]) > 10_000  # whole meetings: far longer than the tiny model's context


def test_fit_messages_formats_with_the_chat_template(loaded):
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when nothing is cut
        ids, cut = fit_messages(tok, messages, 200)
    assert cut is False and ids == tok.encode_chat(messages)
    text = tok.decode(ids)
    assert "<|im_start|>user" in text and "Hello there, how are you today?" in text
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_fit_messages_cuts_a_long_prompt_with_a_warning(loaded):
    tok = loaded.tokenizer
    prompt = load_workload("long_summarization", limit=1)[0]
    content = prompt.turns[0]
    messages = [{"role": "user", "content": content}]
    with pytest.warns(UserWarning, match=r"qmsum/0: cut from \d+ tokens to fit 120"):
        ids, cut = fit_messages(tok, messages, 120, prompt.id)
    assert cut is True and 0 < len(ids) <= 120
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\n")
    kept = text.removeprefix("<|im_start|>user\n").split("<|im_end|>")[0]
    assert kept and content.startswith(kept) and len(kept) < len(content)
    assert text.rstrip().endswith("<|im_start|>assistant")  # the template's end survives the cut
    # the longest prefix that fits: one more character does not
    more = [{"role": "user", "content": content[: len(kept) + 1]}]
    assert len(tok.encode_chat(more)) > 120


def test_fit_messages_cuts_only_the_last_message_and_fails_when_nothing_fits(loaded):
    tok = loaded.tokenizer
    history = [{"role": "user", "content": "First question?"}, {"role": "assistant", "content": "An answer."}]
    long_turn = {"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 40}
    base = len(tok.encode_chat([*history, {"role": "user", "content": ""}]))
    with pytest.warns(UserWarning):
        ids, cut = fit_messages(tok, [*history, long_turn], base + 20)
    assert cut and len(ids) <= base + 20
    assert "First question?" in tok.decode(ids) and "An answer." in tok.decode(ids)
    with pytest.raises(SpecdraftError, match="does not fit") as e:
        fit_messages(tok, [*history, long_turn], base - 1, "conv/1")
    assert "conv/1" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecdraftError, match="does not fit"):
        fit_messages(tok, [{"role": "user", "content": "hi"}], 2)


# ============================================================================ 2. a user's own JSONL


def test_user_jsonl_every_record_shape(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(
        "\n".join([
            json.dumps({"id": "a", "turns": ["first turn", "second turn"]}),
            json.dumps({"prompt": "a plain prompt"}),
            "",  # blank lines are skipped
            json.dumps({"id": 7, "text": "some text"}),
            json.dumps({"question_id": 12, "question": "what is 2 + 2?"}),
            json.dumps({"task_id": "T/1", "instruction": "Rename x to y.", "input": "x = 1"}),
            json.dumps({"instruction": "Say hi.", "input": ""}),
        ]) + "\n",
        encoding="utf-8",
    )
    prompts = load_workload(f"mine={path}")
    assert [p.workload for p in prompts] == ["mine"] * 6
    assert [p.id for p in prompts] == ["a", "2", "7", "12", "T/1", "6"]
    assert [p.turns for p in prompts] == [
        ("first turn", "second turn"), ("a plain prompt",), ("some text",), ("what is 2 + 2?",),
        ("Rename x to y.\n\nx = 1",), ("Say hi.",),
    ]
    bare = load_workload(str(path))  # a bare path: named after the file
    assert [p.workload for p in bare] == ["x"] * 6 and [p.turns for p in bare] == [p.turns for p in prompts]
    assert len(load_workload(f"mine={path}", limit=2)) == 2


def test_user_jsonl_path_with_an_equals_sign(tmp_path):
    folder = tmp_path / "run=1"
    folder.mkdir()
    path = write_jsonl(folder / "p.jsonl", [{"prompt": "hello"}])
    assert [(p.workload, p.turns) for p in load_workload(f"mine={path}")] == [("mine", ("hello",))]
    assert [p.workload for p in load_workload(str(path))] == ["p"]


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "not found"),
        ("", "no records"),
        ("\n\n", "no records"),
        ('{"prompt": "ok"}\n{"prompt": oops}\n', ":2: not valid JSON"),
        ('{"prompt": "ok"}\n[1, 2]\n', ":2: each line must be a JSON object"),
        ('{"id": 1, "answer": "no prompt here"}\n', ":1: no prompt found"),
        ('{"prompt": "   "}\n', ":1: no prompt found"),
        ('{"turns": "not a list"}\n', "'turns' must be a non-empty list of strings"),
        ('{"turns": ["ok", 3]}\n', "'turns' must be a non-empty list of strings"),
        ('{"turns": []}\n', "'turns' must be a non-empty list of strings"),
        (b"\xff\xfe not utf-8\n", "UTF-8"),
    ],
)
def test_user_jsonl_bad_input_is_one_line_error(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    for name in (f"mine={path}", str(path)):
        with pytest.raises(SpecdraftError) as e:
            load_workload(name)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_workload_name():
    with pytest.raises(SpecdraftError, match="unknown workload 'nope'") as e:
        load_workload("nope")
    assert "summarization" in str(e.value) and "\n" not in str(e.value)


# ============================================================================ 3. a sweep


@pytest.fixture(scope="module")
def mine_jsonl(tmp_path_factory):
    text = "the cat sat on the mat and the dog sat on the log. "
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "mine.jsonl", [
        {"id": "m1", "prompt": "Repeat this: " + text * 2},
        {"id": "m2", "turns": ["Say hello.", "Now say it again."]},
        {"id": "m3", "text": "Hello, world! How are you today? " * 2},
    ])


def test_repeats_run_in_rotated_rounds():
    a, b, c = (MethodSpec.parse(m) for m in ("plain", "ngram", "suffix"))
    assert rounds([a, b, c], 1) == [[a, b, c]]
    order = rounds([a, b, c], 3)
    assert order == [[a, b, c], [b, c, a], [c, a, b]]
    assert all(sorted(r.label for r in o) == ["ngram", "plain", "suffix"] for o in order)  # each once a round
    assert [o.index(a) for o in order] == [0, 2, 1]  # plain runs first, last and in between


@pytest.fixture(scope="module")
def sweep(tiny_gguf, mine_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    cfg = BenchConfig(methods=(MethodSpec.parse("ngram"), MethodSpec.parse("ngram:k=4,policy=fixed")),
                      workloads=("repeat", f"mine={mine_jsonl}"), batch_sizes=(1, 2), max_new_tokens=8, samples=2,
                      repeats=2, batched_repeats=1, model=str(tiny_gguf), out=str(out))
    logged: list[str] = []
    results = run_bench(cfg, log=logged.append)
    return cfg, results, out, logged


def test_sweep_rows(sweep):
    cfg, results, out, _ = sweep
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    rows = results["rows"]
    methods = ["plain", "ngram", "ngram:k=4,policy=fixed"]
    keys = [(r["method"], r["workload"], r["batch"]) for r in rows]
    assert sorted(keys) == sorted((m, w, b) for m in methods for w in ("repeat", "mine") for b in (1, 2))
    by_key = dict(zip(keys, rows))
    for r in rows:
        assert r["base_method"] == ("plain" if r["method"] == "plain" else "ngram")
        assert r["requests"] == 2  # batch 1: samples requests; batch 2: one full batch
        assert 0 < r["new_tokens"] <= r["requests"] * cfg.max_new_tokens
        assert r["time_s"] > 0 and r["time_s"] == statistics.median(r["times_s"]) and len(r["times_s"]) == cfg.repeats_at(r["batch"])
        assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["time_s"])
        assert 0 <= r["acceptance_rate"] <= 1
        assert all(0 <= a <= 1 for a in r["acceptance_by_position"])
        assert r["tau"] >= 0.5 and sum(r["emitted_hist"]) > 0
        assert min(r["propose_s"], r["verify_s"], r["other_s"], r["prefill_s"]) >= 0
        assert r["peak_rss_bytes"] > 0
        plain = by_key[("plain", r["workload"], r["batch"])]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"], rel=1e-12)
    for r in rows:
        if r["method"] == "plain":
            assert r["speedup"] == 1.0 and r["settings"] == {}
            assert r["acceptance_rate"] == 0 and r["acceptance_by_position"] == []
            assert r["tau"] == pytest.approx(1.0, abs=0.2)  # 1.0 but for a request ending on EOS
    assert {r["method"]: r["settings"] for r in rows if r["method"] != "plain"} == {
        "ngram": {"k": 8, "policy": "adaptive"}, "ngram:k=4,policy=fixed": {"k": 4, "policy": "fixed"}}
    fixed = [r for r in rows if r["method"] == "ngram:k=4,policy=fixed"]
    assert all(len(r["acceptance_by_position"]) <= 4 for r in fixed)


def test_sweep_metadata(sweep, tiny_gguf):
    cfg, results, _, logged = sweep
    machine = results["machine"]
    for key in ("cpu", "cores", "torch_threads", "device", "python", "torch", "specdraft", "platform"):
        assert machine[key] not in (None, ""), key
    assert machine["device"] == "cpu" and machine["torch_threads"] >= 1
    assert list(results["config"]["workloads"]) == list(cfg.workloads)
    assert list(results["config"]["batch_sizes"]) == [1, 2] and results["config"]["model"] == str(tiny_gguf)
    assert [m["label"] for m in results["config"]["methods"]] == ["ngram", "ngram:k=4,policy=fixed"]
    assert results["model"]["source"] == str(tiny_gguf) and results["model"]["context"] == 256
    # the repeat passages are longer than the tiny model's context allows: cut, and said so
    assert results["truncated"] == {"repeat": 2, "mine": 0}
    assert sum("warning: repeat/" in line and "cut from" in line for line in logged) == 2
    assert results["peers"] == [] and results["peer_notes"] == {}
    assert results["cost_model_s"]  # measured


def test_multi_turn_requests_carry_the_plain_answers(loaded):
    prompt = Prompt("p", "w", ("Say hello.", "Now say it again."))
    gen = GenerationConfig(max_new_tokens=5)
    reqs = build_requests(loaded, [prompt], 200, gen, limit=10)
    assert [(r.id, r.workload, r.truncated) for r in reqs] == [("p#1", "w", False), ("p#2", "w", False)]
    first, second = (loaded.tokenizer.decode(r.tokens) for r in reqs)
    answer = build_engine(loaded, "plain").generate([list(reqs[0].tokens)], gen)[0].text
    assert second.startswith(first + answer)  # turn 2 continues turn 1 with the plain greedy answer
    assert second.count("<|im_start|>user") == 2 and second.rstrip().endswith("<|im_start|>assistant")
    assert "Now say it again." in second
    assert len(build_requests(loaded, [prompt, prompt], 200, gen, limit=3)) == 3


def test_batches_are_full_and_limited_by_samples():
    reqs = [Request(str(i), "w", (1, 2), False) for i in range(7)]
    assert [len(g) for g in batches(reqs, 1, "w", samples=3)] == [1, 1, 1]
    assert [len(g) for g in batches(reqs, 2, "w", samples=3)] == [2]  # max(1, 3 // 2) full batches
    assert [len(g) for g in batches(reqs, 2, "w", samples=8)] == [2, 2, 2]  # only 7 requests
    assert batches(reqs, 7, "w", samples=1) == [reqs]
    with pytest.raises(SpecdraftError, match="batch size 8 is larger than the 7 requests available for workload 'w'"):
        batches(reqs, 8, "w", samples=1)


# ============================================================================ 4. the report


def _fresh_copy(out: Path, dest: Path) -> Path:
    shutil.copytree(out, dest)
    for f in [dest / "report.md", *dest.glob("*.png")]:
        f.unlink(missing_ok=True)
    return dest


def test_report_rebuilt_from_results_json_alone(sweep, tmp_path, capsys):
    _, results, out, _ = sweep
    folder = _fresh_copy(out, tmp_path / "run")
    assert sorted(p.name for p in folder.iterdir()) == ["results.json"]
    assert main(["report", str(folder)]) == 0
    stdout = capsys.readouterr().out
    md = (folder / "report.md").read_text()
    assert md in stdout
    m, c = results["machine"], results["config"]
    assert md.startswith("# specdraft benchmark")
    for needle in (results["model"]["name"], Path(results["model"]["source"]).name, m["cpu"],
                   f"{m['torch_threads']} torch threads", c["dtype"], f"python {m['python']}",
                   f"torch {m['torch']}", f"specdraft {m['specdraft']}",
                   "2 timed repeat(s) at batch 1, 1 at larger batches"):
        assert needle in md, needle
    lines = md.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = [line for line in lines[first:] if line.startswith("|")][: 2 + len(results["rows"])]
    assert not lines[first + len(table)].startswith("|")  # header, separator, one line per result
    plain1 = [r for r in results["rows"] if r["base_method"] == "plain" and r["batch"] == 1]
    assert plain1 and all(r["copy_ceiling_tau"] >= 1.0 for r in plain1)
    assert all(1.0 <= r["lookup_ceiling_tau"] <= r["copy_ceiling_tau"] for r in plain1)
    assert "## Headroom for copying" in md
    for r in plain1:
        assert any(line.split("|")[1].strip() == r["workload"] and f"{r['copy_ceiling_tau']:.2f}" in line
                   for line in lines if line.startswith("|") and "ceiling" not in line), r["workload"]
    for r in results["rows"]:
        assert [r["workload"], str(r["batch"]), r["method"]] in [
            [c.strip() for c in line.split("|")[1:4]] for line in table], r
    pngs = {"speedup_vs_batch.png", "acceptance_by_workload.png", "tau_histogram.png", "speedup_by_workload.png",
            "adaptive_vs_fixed.png"}  # the sweep has an adaptive and a fixed method, no tree drafts
    written = {p.name for p in folder.glob("*.png")}
    assert pngs <= written and "tree_vs_chain.png" not in written
    for name in written:
        assert (folder / name).read_bytes()[:8] == PNG_MAGIC, name
        assert f"({name})" in md


def test_report_with_one_batch_size_and_from_the_json_file(sweep, tmp_path, capsys):
    _, results, _, _ = sweep
    folder = tmp_path / "one"
    folder.mkdir()
    one = {**results, "rows": [r for r in results["rows"] if r["batch"] == 1],
           "config": {**results["config"], "batch_sizes": [1]}}
    (folder / "results.json").write_text(json.dumps(one))
    assert main(["report", str(folder / "results.json")]) == 0  # the file itself works too
    capsys.readouterr()
    assert (folder / "report.md").is_file()
    assert (folder / "speedup_by_workload.png").read_bytes()[:8] == PNG_MAGIC
    assert not (folder / "speedup_vs_batch.png").exists()
    assert "speedup_vs_batch" not in (folder / "report.md").read_text()


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "no benchmark results"),
        ("{not json", "not valid JSON"),
        ("[1, 2, 3]", "does not hold specdraft benchmark results"),
        ('{"hello": "world"}', "does not hold specdraft benchmark results"),
        ('{"rows": []}', "does not hold specdraft benchmark results"),
        ('{"rows": 3, "config": {}, "machine": {}}', "does not hold specdraft benchmark results"),
    ],
)
def test_report_bad_input_exits_2(tmp_path, capsys, content, needle):
    if content is not None:
        (tmp_path / "results.json").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    _, err = capsys.readouterr()
    assert needle in one_line(err)
    assert not (tmp_path / "report.md").exists()


def test_report_on_a_missing_folder_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no benchmark results" in one_line(capsys.readouterr().err)


# ============================================================================ 5. peers


def test_missing_peer_is_skipped_with_a_note(tiny_gguf, mine_jsonl, tmp_path, monkeypatch):
    real = peers_mod.importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.split(".")[0] == "llama_cpp" else real(name, *args, **kwargs)

    def failing_bind(self, source):  # never load transformers here: pretend it fails
        raise RuntimeError("no thanks")

    monkeypatch.setattr(peers_mod.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(peers_mod.TransformersPeer, "bind", failing_bind)
    logged: list[str] = []
    cfg = BenchConfig(methods=(MethodSpec.parse("ngram"),), workloads=(f"mine={mine_jsonl}",), max_new_tokens=4,
                      samples=1, model=str(tiny_gguf), out=str(tmp_path), peers=("llamacpp", "transformers"),
                      isolate_peers=False)  # in-process, so that the patches above apply
    results = run_bench(cfg, log=logged.append)
    notes = results["peer_notes"]
    assert notes["llamacpp"].startswith("skipped") and "llama-cpp-python is not installed" in notes["llamacpp"]
    assert notes["transformers"].startswith("skipped")
    if "not installed" not in notes["transformers"]:
        assert "failed to load (RuntimeError: no thanks)" in notes["transformers"]
    assert results["peers"] == []
    assert any("peer llamacpp skipped" in line for line in logged)
    assert len(results["rows"]) == 2  # our own rows are unaffected
    md = write_report(tmp_path).read_text()
    assert f"- peer llamacpp: {notes['llamacpp']}" in md
    assert f"- peer transformers: {notes['transformers']}" in md


def test_isolated_peer_rows_notes_and_crashes():
    got: list[dict] = []
    job = {"peer": "llamacpp", "source": "/nonexistent/model.bin", "workloads": {"w": [[1, 2]]}, "max_new_tokens": 4}
    note = peers_mod.measure_isolated(job, got.append)  # the real child: no GGUF, so a note and no rows
    assert got == [] and note.startswith("skipped") and ("GGUF" in note or "not installed" in note)
    script = ("import json, os, signal; print('chatter'); "
              "print(json.dumps({'peer': 'x', 'workload': 'w', 'speedup': 1.5}), flush=True); "
              "os.kill(os.getpid(), signal.SIGSEGV)")
    note = peers_mod.measure_isolated(job, got.append, argv=[sys.executable, "-c", script])
    assert got == [{"peer": "x", "workload": "w", "speedup": 1.5}]  # rows before the crash are kept
    assert note == "crashed (signal SIGSEGV) after 1 workload(s)"
    note = peers_mod.measure_isolated(job, got.append, argv=[sys.executable, "-c", "raise SystemExit('bad job')"])
    assert note == "crashed (exit code 1) after 0 workload(s): bad job"


def test_transformers_draft_peer_needs_the_runs_draft(tiny_hf):
    assert "needs a draft model" in peers_mod.TransformersDraftPeer().unavailable(tiny_hf)
    peer = peers_mod.TransformersDraftPeer(assistant=str(tiny_hf))
    if peer.unavailable(tiny_hf) is not None:
        pytest.skip("transformers is not installed")
    peer.bind(tiny_hf)  # the tiny model assists itself: assisted generation must still run
    plain = peer.run([[5, 6, 7]], 6, speculative=False)
    spec = peer.run([[5, 6, 7]], 6, speculative=True)
    assert plain.new_tokens == spec.new_tokens == 6


def test_prompt_lookup_peer_ignores_the_runs_draft(tiny_hf):
    """A run with a draft method passes its path to every peer; only transformers-draft may use
    it (once, the prompt-lookup peer silently ran assisted generation instead)."""
    lookup = peers_mod.TransformersPeer(assistant=str(tiny_hf))
    assert lookup.speculative_kwargs() == {"prompt_lookup_num_tokens": peers_mod.PROMPT_LOOKUP_TOKENS}
    draft = peers_mod.TransformersDraftPeer(assistant=str(tiny_hf))
    if draft.unavailable(tiny_hf) is not None:
        pytest.skip("transformers is not installed")
    draft.bind(tiny_hf)
    assert set(draft.speculative_kwargs()) == {"assistant_model"} and draft.speculative_kwargs()["assistant_model"] is not None


def test_peer_availability_checks(tiny_gguf, tiny_hf, monkeypatch):
    monkeypatch.setattr(peers_mod.importlib.util, "find_spec", lambda name, *a, **k: object())  # all "installed"
    assert peers_mod.LlamaCppPeer().unavailable(tiny_gguf) is None
    assert "needs a GGUF" in peers_mod.LlamaCppPeer().unavailable(tiny_hf)
    assert peers_mod.TransformersPeer().unavailable(tiny_hf) is None
    monkeypatch.setattr(peers_mod.importlib.util, "find_spec", lambda name, *a, **k: None)
    assert "transformers is not installed" in peers_mod.TransformersPeer().unavailable(tiny_hf)
    assert "transformers is not installed" in peers_mod.TransformersPeer().unavailable(tiny_gguf)
    assert "llama-cpp-python is not installed" in peers_mod.LlamaCppPeer().unavailable(tiny_gguf)


def test_bad_peer_settings():
    with pytest.raises(SpecdraftError, match="unknown peer 'nope'"):
        BenchConfig(peers=("nope",))
    with pytest.raises(SpecdraftError, match="temperature 0"):
        BenchConfig(peers=("transformers",), temperature=0.5)


# ============================================================================ 6. the bench command


def test_bench_command_writes_results_and_report(tiny_gguf, mine_jsonl, tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["bench", "--model", str(tiny_gguf), "--methods", "ngram:k=4+policy=fixed",
                 "--workloads", f"mine={mine_jsonl},mixed", "--samples", "1", "--max-new-tokens", "4",
                 "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert {(r["method"], r["workload"]) for r in results["rows"]} == {
        (m, w) for m in ("plain", "ngram:k=4,policy=fixed") for w in ("mine", "mixed")}
    assert (out / "report.md").read_text() in stdout and "results:" in stdout
    if any(out.glob("*.png")):  # matplotlib installed: the plots are named
        assert f"plots:   {out}/" in stdout and "tau_histogram.png" in stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--methods", "nope"], "unknown method 'nope'"),
        (["--workloads", "nope"], "unknown workload 'nope'"),
        (["--workloads", "mine=EMPTY"], "no records"),
        (["--workloads", "mine=MALFORMED"], ":2: not valid JSON"),
        (["--workloads", "mine=THREE", "--batch-sizes", "8"], "batch size 8 is larger than the 3 requests"),
        (["--workloads", "mine=THREE,mine=THREE"], "workload 'mine' is given twice"),
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--batch-sizes", "1,x"], "--batch-sizes"),
        (["--methods", "ngram:k=abc"], "k must be an integer"),
        (["--methods", "ngram:k"], "expected key=value"),
        (["--methods", "ngram:bogus=1"], "has no option 'bogus'"),
        (["--methods", "ngram:policy=sometimes"], "policy must be"),
        (["--peers", "nope"], "unknown peer 'nope'"),
        (["--peers", "transformers", "--temperature", "0.5"], "temperature 0"),
        (["--samples", "0"], ">= 1"),
        (["--workloads", "/nonexistent/prompts.jsonl"], "not found"),
    ],
)
def test_bench_bad_input_exits_2_with_one_line(tiny_gguf, tmp_path, capsys, args, needle):
    files = {
        "EMPTY": tmp_path / "empty.jsonl",
        "MALFORMED": tmp_path / "malformed.jsonl",
        "THREE": tmp_path / "three.jsonl",
    }
    files["EMPTY"].write_text("")
    files["MALFORMED"].write_text('{"prompt": "fine"}\n{"prompt": \n')
    write_jsonl(files["THREE"], [{"prompt": f"prompt number {i}"} for i in range(3)])
    for key, path in files.items():
        args = [a.replace(f"={key}", f"={path}") for a in args]
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_gguf), "--max-new-tokens", "4", "--samples", "1", "--out", str(out),
                 *args])
    _, err = capsys.readouterr()
    assert code == 2
    assert needle in one_line(err)
    assert not (out / "results.json").exists()


# ============================================================================ 7. method specs


def test_method_spec_parse():
    m = MethodSpec.parse("ngram")
    assert (m.label, m.method, m.k, m.policy, m.options) == ("ngram", "ngram", 8, "adaptive", ())
    m = MethodSpec.parse(" ngram:k=4,policy=fixed ")
    assert (m.label, m.method, m.k, m.policy, m.options) == ("ngram:k=4,policy=fixed", "ngram", 4, "fixed", ())
    m = MethodSpec.parse("ngram:max_n=3, k=2 ,min_n=1")
    assert (m.method, m.k, m.policy) == ("ngram", 2, "adaptive")
    assert m.options == (("max_n", "3"), ("min_n", "1"))
    assert MethodSpec.parse("ngram:").options == ()
    assert MethodSpec.parse("plain").method == "plain"
    assert MethodSpec.parse("ngram:k=4") != MethodSpec.parse("ngram:k=5")


@pytest.mark.parametrize(
    "text, needle",
    [("nope", "unknown method"), ("nope:k=2", "unknown method"), ("ngram:k=abc", "k must be an integer"),
     ("ngram:k=", "k must be an integer"), ("ngram:max_n", "expected key=value")],
)
def test_method_spec_parse_errors(text, needle):
    with pytest.raises(SpecdraftError, match=needle) as e:
        MethodSpec.parse(text)
    assert "\n" not in str(e.value)


def test_quick_methods_cover_every_method_and_prepare_their_files(tiny_gguf, tmp_path, monkeypatch):
    from specdraft.bench.quick import TRAINED, quick_methods
    from specdraft.corpus import CorpusSpec
    from specdraft.proposers import method_names

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECDRAFT_DATASTORES", str(tmp_path / "stores"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    logged: list[str] = []
    specs = quick_methods(str(tiny_gguf), logged.append, CorpusSpec(paths=(str(corpus),)))
    skipped = {m for m in TRAINED if any(line.startswith(f"quick: {m} skipped") for line in logged)}
    assert skipped == set(TRAINED)  # no heads ship for the tiny model
    assert {s.split(":")[0] for s in specs} == set(method_names()) - {"plain"} - skipped
    logged[:] = [line for line in logged if " skipped" not in line]
    draft = next(s for s in specs if s.startswith("draft:"))
    assert (tmp_path / draft.split("path=")[1] / "config.json").exists()
    assert len(list((tmp_path / "stores").iterdir())) == 1
    assert len(logged) == 2  # one export, one build ...
    quick_methods(str(tiny_gguf), logged.append, CorpusSpec(paths=(str(corpus),)))
    assert len([line for line in logged if " skipped" not in line]) == 2  # ... and both are reused the next time
    specs = [MethodSpec.parse(s) for s in specs]  # every spec parses
    assert all(isinstance(s, MethodSpec) for s in specs)


def test_peers_table_sets_each_peer_beside_our_matching_method():
    from specdraft.bench.report import peers_table

    def ours(method, base, speedup):
        return {"batch": 1, "workload": "code", "method": method, "base_method": base, "speedup": speedup,
                "tokens_per_s": 40.0 * speedup}

    results = {"rows": [ours("ngram:policy=fixed,k=8", "ngram", 1.1), ours("ngram", "ngram", 1.4),
                        ours("draft:path=d", "draft", 1.2)],
               "peers": [{"peer": "llamacpp", "mode": "prompt lookup", "workload": "code", "plain_tokens_per_s": 50.0,
                          "speculative_tokens_per_s": 60.0, "speedup": 1.2},
                         {"peer": "transformers-draft", "mode": "draft model", "workload": "code",
                          "plain_tokens_per_s": 20.0, "speculative_tokens_per_s": 18.0, "speedup": 0.9}]}
    lines = peers_table(results).splitlines()
    assert "1.40x (ngram)" in lines[2] and "prompt lookup" in lines[2]
    assert "1.20x (draft:path=d)" in lines[3] and "0.90x" in lines[3]
    # our fastest method beside each peer's plain decoding: 56 tok/s against 50 and 20
    assert "56.0 (ngram)" in lines[2] and "1.12x" in lines[2]
    assert "56.0 (ngram)" in lines[3] and "2.80x" in lines[3]


def test_copy_ceiling_counts_the_oracle_steps():
    from specdraft.bench.ceiling import copy_ceiling_steps, copy_ceiling_tau

    prompt = [1, 2, 3, 4, 5, 6]
    out = [9, 2, 3, 4, 5, 7, 8]  # 9 comes from the prefill
    assert copy_ceiling_steps(prompt, out, k=4) == 2  # [2 3 4 5] + bonus 7, then 8
    assert copy_ceiling_steps(prompt, out, k=2) == 3  # [2 3] + 4, [5] + 7, then 8
    assert copy_ceiling_steps(prompt, [9, 10, 11, 12], k=4) == 3  # nothing to copy
    # token alignment: 256 = bytes 00 01 00 00 must not match across token boundaries
    assert copy_ceiling_steps([1, 256 * 256], [0, 256, 0], k=4) == 2
    # copying from its own output: a repeated phrase is copied the second time
    assert copy_ceiling_steps([0], [5, 6, 7, 5, 6, 7, 5], k=4) == 3  # 6, 7, then [5 6 7] + bonus 5
    assert copy_ceiling_tau([([0], [1, 2, 3])], k=4) == 1.0


def test_lookup_ceiling_only_copies_what_a_match_of_the_last_token_points_to():
    from specdraft.bench.ceiling import copy_ceiling_steps, lookup_ceiling_steps, lookup_ceiling_tau

    prompt = [1, 2, 3, 4, 5, 6]
    out = [9, 2, 3, 4, 5, 7, 8]  # 9 never occurred before: nothing points at [2 3 4 5]
    assert copy_ceiling_steps(prompt, out, k=4) == 2
    assert lookup_ceiling_steps(prompt, out, k=4) == 3  # 2 alone, then [3 4 5] + bonus 7, then 8
    # every earlier occurrence of the last token is tried, not only the most recent
    assert lookup_ceiling_steps([5, 2, 3, 5, 1], [0, 5, 2, 3, 9], k=4) == 2  # 5, then [2 3] + bonus 9
    assert lookup_ceiling_steps([5, 2, 3, 5, 1], [0, 5, 2, 3, 9], k=1) == 3  # 5, [2] + 3, then 9
    # the output itself is part of the context
    assert lookup_ceiling_steps([0], [5, 6, 7, 5, 6, 7, 5], k=4) == 4  # 6, 7, 5, then [6 7] + bonus 5
    assert lookup_ceiling_tau([([0], [1, 2, 3])], k=4) == 1.0


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), min_size=1, max_size=16),
       st.integers(1, 5))
def test_lookup_ceiling_lies_between_plain_decoding_and_the_copy_ceiling(prompt, out, k):
    from specdraft.bench.ceiling import copy_ceiling_steps, lookup_ceiling_steps

    steps = lookup_ceiling_steps(prompt, out, k)
    assert copy_ceiling_steps(prompt, out, k) <= steps <= len(out) - 1


def test_the_replay_script_prints_ceilings_from_the_committed_plain_outputs():
    import subprocess

    from specdraft.bench.ceiling import copy_ceiling_tau, lookup_ceiling_tau

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "scripts" / "suffix_sim.py"), "ceilings", "code",
                           "--samples", "2", "--tokens", "40"], cwd=root, capture_output=True, text=True, check=True)
    row = next(line for line in done.stdout.splitlines() if line.startswith("| code |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    stored = json.loads((root / "results" / "plain-outputs" / "code.json").read_text())["rows"][:2]
    pairs = [(r["prompt"], r["output"][:40]) for r in stored]
    assert cells[1] == f"{copy_ceiling_tau(pairs, 8):.2f}" and cells[3] == f"{lookup_ceiling_tau(pairs, 8):.2f}"
    assert float(cells[3]) <= float(cells[1]) and float(cells[4].rstrip("x")) <= float(cells[2].rstrip("x"))


def test_profile_categories_name_the_projects_own_kernels() -> None:
    """bench-runtime's profile puts csrc's kernels (recorded under specdraft::) with the ATen
    operators they stand for, not in the time outside operators."""
    from specdraft.bench.profile import category

    assert category("specdraft::quant_mm") == category("aten::_weight_int4pack_mm_for_cpu") == "matrix products"
    assert category("specdraft::attend") == category("aten::scaled_dot_product_attention") == "attention"
    assert category("aten::rms_norm") == "norms and activations"
    assert category("aten::something_else") == "other operators"

"""Training prompts (every source layout, splits, no evaluation set) and self-distillation data
(the target's own answers, sharded, resumable, refused when the settings differ)."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

from specdraft.cli import main
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.model.loader import LoadedModel, load
from specdraft.sampling import Sampling
from specdraft.sequence import GenerationConfig
from specdraft.train.data import DataConfig, generate_data, read_shards, summary
from specdraft.train.prompts import SOURCES, TrainPrompt, load_training_prompts


def write_train_folder(root: Path) -> Path:
    """A small folder in the upstream layouts of every known source (and an evaluation set
    beside them, which must never be read)."""
    (root / "gpteacher").mkdir(parents=True)
    (root / "gpteacher" / "codegen-instruct.json").write_text(json.dumps([
        {"instruction": "Write a function that adds two numbers.", "input": "", "response": "def add(a, b): ..."},
        {"instruction": "Fix the bug.", "input": "def f(x) return x", "response": "def f(x): return x"},
    ]))
    (root / "gpteacher" / "roleplay-simple-deduped-roleplay-instruct.json").write_text(json.dumps([
        {"instruction": "You are a pirate. Greet me.", "input": "", "response": "Ahoy!"},
    ]))
    (root / "alpaca_libre").mkdir()
    (root / "alpaca_libre" / "alpaca_libre_tasks_v1.jsonl").write_text(
        json.dumps({"status": "ok", "instruction": "Name a color.", "input": "", "output": "Blue."}) + "\n"
        + json.dumps({"status": "too similar", "instruction": "Name a colour.", "input": "", "output": "Red."}) + "\n")
    (root / "alpaca_libre" / "alpaca_libre_tasks_v2.jsonl").write_text(  # an upstream line with `""""`
        '{"status": "ok", "instruction": "Say hi.", "input": """", "output": "Hi.", "other": {}}\n')
    (root / "oasst1_en_validation").mkdir()
    msgs = [
        {"message_id": "a", "parent_id": None, "role": "prompter", "text": "How do plants grow?", "deleted": False},
        {"message_id": "b", "parent_id": "a", "role": "assistant", "text": "Slowly.", "rank": 1, "deleted": False},
        {"message_id": "c", "parent_id": "a", "role": "assistant", "text": "With light.", "rank": 0, "deleted": False},
        {"message_id": "d", "parent_id": "c", "role": "prompter", "text": "Why?", "deleted": False},
        {"message_id": "e", "parent_id": None, "role": "prompter", "text": "Deleted one", "deleted": True},
    ]
    (root / "oasst1_en_validation" / "en-validation.jsonl").write_text("".join(json.dumps(m) + "\n" for m in msgs))
    (root / "oasst_prompt_samples").mkdir()
    (root / "oasst_prompt_samples" / "en_100_text.jsonl").write_text(json.dumps("Tell me a joke.") + "\n")
    (root / "self_instruct_seed").mkdir()
    (root / "self_instruct_seed" / "seed_tasks.jsonl").write_text(json.dumps(
        {"id": "seed_task_0", "instruction": "Sort these numbers.", "instances": [{"input": "3 1 2", "output": "1 2 3"}]})
        + "\n")
    (root / "spec_bench").mkdir()  # an evaluation set: never read
    (root / "spec_bench" / "question.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["EVAL PROMPT"]}) + "\n")
    return root


@pytest.fixture()
def train_folder(tmp_path: Path) -> Path:
    return write_train_folder(tmp_path / "train")


def test_every_source_layout_is_read(train_folder: Path) -> None:
    prompts = load_training_prompts(train_folder)
    by_text = {p.text: p for p in prompts}
    assert set(by_text) == {
        "Write a function that adds two numbers.", "Fix the bug.\n\ndef f(x) return x", "You are a pirate. Greet me.",
        "Name a color.", "Say hi.", "How do plants grow?", "Tell me a joke.", "Sort these numbers.\n\n3 1 2"}
    assert by_text["How do plants grow?"].reference == "With light."  # the best-ranked reply
    assert by_text["Tell me a joke."].reference is None
    assert by_text["Say hi."].source == "alpaca-libre"  # the repaired upstream line
    assert {p.source for p in prompts} == set(SOURCES)
    assert len({p.id for p in prompts}) == len(prompts)
    assert all("EVAL" not in p.text for p in prompts)
    assert load_training_prompts(train_folder, ("oasst1",)) == [by_text["How do plants grow?"]]


def test_splits_are_stable_and_hold_out_about_five_percent() -> None:
    prompts = [TrainPrompt(f"s/{i}", "s", f"p{i}", None) for i in range(4000)]
    share = sum(p.split == "validation" for p in prompts) / len(prompts)
    assert 0.035 < share < 0.065
    assert [p.split for p in prompts] == [TrainPrompt(p.id, "other", "x", None).split for p in prompts]  # by id alone


def test_training_on_some_sources_keeps_their_records_in_both_splits(tmp_path: Path) -> None:
    from specdraft.train.common import splits

    rows = [{"id": f"{src}/{i}", "source": src, "split": split, "temperature": 0.0, "prompt": [1, i],
             "response": [i, n]}
            for n, (src, split) in enumerate([("code", "train"), ("chat", "train"), ("chat", "validation"),
                                              ("code", "validation"), ("chat", "train")]) for i in (n,)]
    (tmp_path / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held, records = splits(tmp_path, None, ("chat",))
    assert train == [([1, 1], [1, 1]), ([1, 4], [4, 4])] and held == [([1, 2], [2, 2])]
    assert {r["source"] for r in records} == {"chat"}
    assert len(splits(tmp_path, None)[0]) == 3  # () = every source
    with pytest.raises(SpecdraftError, match="no answers from chats .*its sources: chat, code"):
        splits(tmp_path, None, ("chats",))


def _folder(path: Path, rows: list[dict], tokenizer: str = "t0") -> Path:
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"format": 1, "tokenizer": tokenizer}))
    (path / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(i: int, split: str, temperature: float = 0.0) -> dict:
    return {"id": f"s/{i}", "source": "s", "split": split, "temperature": temperature, "prompt": [1, i],
            "response": [i, 7]}


def test_several_data_folders_train_together_and_keep_the_held_out_apart(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from specdraft.train.common import splits

    first = _folder(tmp_path / "greedy", [_row(0, "train"), _row(1, "validation"), _row(2, "train")])
    second = _folder(tmp_path / "sampled", [_row(0, "train", 0.7), _row(2, "train", 0.7), _row(3, "train", 0.7)])
    train, held, _ = splits(f"{first},{second}", None)
    assert [p for p, _ in train] == [[1, 0], [1, 2], [1, 0], [1, 2], [1, 3]]
    assert held == [([1, 1], [1, 7])]
    assert splits([first, second], 2)[0] == train[:2]
    only, held_too, _ = splits(second, None, held_out=first)  # second answers only, measured on the first folder's
    assert [p for p, _ in only] == [[1, 0], [1, 2], [1, 3]] and held_too == held
    with pytest.raises(SpecdraftError, match="need answers in both splits"):
        splits(second, None)
    other = _folder(tmp_path / "other", [_row(5, "train")], tokenizer="t1")
    with pytest.raises(SpecdraftError, match="different tokenizers"):
        splits(f"{first},{other}", None)
    leak = _folder(tmp_path / "leak", [_row(1, "train", 0.7), _row(4, "train", 0.7)])  # the held-out prompt, as train
    assert [p for p, _ in splits(f"{first},{leak}", None)[0]] == [[1, 0], [1, 2], [1, 4]]
    assert "1 train answers dropped: their prompt is a validation prompt" in capsys.readouterr().err
    with pytest.raises(SpecdraftError, match="no such data folder"):
        splits(f"{first},{tmp_path / 'missing'}", None)


def test_bad_training_folders_are_one_line_errors(tmp_path: Path, train_folder: Path) -> None:
    with pytest.raises(SpecdraftError, match="not found"):
        load_training_prompts(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdraftError, match="no training prompts found"):
        load_training_prompts(tmp_path / "empty")
    with pytest.raises(SpecdraftError, match="unknown training source"):
        load_training_prompts(train_folder, ("spec_bench",))
    (train_folder / "gpteacher" / "codegen-instruct.json").write_text("[{broken")
    with pytest.raises(SpecdraftError, match="cannot read"):
        load_training_prompts(train_folder)


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> LoadedModel:
    return load(tiny_hf)


def test_data_is_the_targets_own_answers_and_resumes(tiny: LoadedModel, train_folder: Path, tmp_path: Path) -> None:
    prompts = load_training_prompts(train_folder)
    out = tmp_path / "data"
    cfg = DataConfig(max_new_tokens=6, batch_size=3, shard_size=3, limit=5)
    first = generate_data(tiny, prompts, out, cfg)
    assert first.answered == 5 and first.done == 5 and first.tokens > 0
    assert sorted(p.name for p in out.glob("shard-*.jsonl")) == ["shard-00000.jsonl", "shard-00001.jsonl"]
    records = read_shards(out)
    engine = Engine(tiny.model, tiny.tokenizer)
    for r in records:  # each answer is what plain decoding gives, greedy or with the recorded seed
        sampling = Sampling(temperature=r["temperature"], seed=r["seed"])
        again = engine.generate([r["prompt"]], GenerationConfig(max_new_tokens=6), sampling)[0]
        assert again.tokens == r["response"] and again.finish_reason == r["finish"]
    assert {r["temperature"] for r in records} == {0.0, 0.7}
    more = generate_data(tiny, prompts, out, DataConfig(max_new_tokens=6, batch_size=3, shard_size=3, limit=8))
    assert more.answered == 3 and more.done == 8  # only the new prompts
    ids = [r["id"] for r in read_shards(out)]
    assert len(ids) == len(set(ids)) == 8
    assert summary(out)["prompts"] == 8


def test_an_interrupted_run_keeps_finished_shards(tiny: LoadedModel, train_folder: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = load_training_prompts(train_folder)
    out = tmp_path / "data"
    import specdraft.train.data as data_module

    calls = 0
    real = data_module._write_shard

    def dies_writing_the_third_shard(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(data_module, "_write_shard", dies_writing_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        generate_data(tiny, prompts, out, DataConfig(max_new_tokens=4, batch_size=2, shard_size=2))
    assert len(read_shards(out)) == 4  # two whole shards; the third was lost, nothing half-written
    assert not list(out.glob("*.tmp"))
    monkeypatch.setattr(data_module, "_write_shard", real)
    report = generate_data(tiny, prompts, out, DataConfig(max_new_tokens=4, batch_size=2, shard_size=2))
    assert report.done == len(prompts) and report.answered == len(prompts) - 4


def test_other_settings_are_refused_and_a_time_budget_stops_between_shards(
        tiny: LoadedModel, train_folder: Path, tmp_path: Path) -> None:
    prompts = load_training_prompts(train_folder)
    out = tmp_path / "data"
    report = generate_data(tiny, prompts, out, DataConfig(max_new_tokens=4, shard_size=2, time_budget_s=0.0))
    assert report.stopped == "time budget" and report.answered == 0
    with pytest.raises(SpecdraftError, match="other settings .*max_new_tokens"):
        generate_data(tiny, prompts, out, DataConfig(max_new_tokens=5, shard_size=2))
    with pytest.raises(SpecdraftError, match="temperature"):
        DataConfig(temperatures=(-1.0,))


def test_the_train_data_command(tiny_gguf: Path, train_folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    code = main(["train", "data", "--prompts", str(train_folder), "--out", str(out), "--model", str(tiny_gguf),
                 "--limit", "3", "--max-new-tokens", "4", "--sources", "gpteacher-codegen,alpaca-libre"])
    assert code == 0
    assert "3 prompts answered" in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["max_new_tokens"] == 4
    assert main(["train", "summary", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == 3
    code = main(["train", "data", "--prompts", str(tmp_path / "nowhere"), "--out", str(out), "--model", str(tiny_gguf)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "not found" in err


# =========================================================================== the reduced draft vocabulary


def test_draft_vocab_maps_follow_eagle3s_layout() -> None:
    import torch

    from specdraft.heads.vocab import DraftVocab
    from specdraft.train.vocab import coverage, most_frequent, token_counts

    counts = token_counts([[5, 5, 5, 1, 1, 9], [1, 7, 5], []], vocab_size=12)
    assert counts.tolist() == [0, 3, 0, 0, 0, 4, 0, 1, 0, 1, 0, 0]
    vocab = most_frequent(counts, 3)
    assert vocab.target_ids.tolist() == [1, 5, 7]  # 5 (4) and 1 (3), then the tie 7/9 goes to the lower id
    assert vocab.d2t.tolist() == [1, 4, 5]  # draft id i -> target id i + d2t[i]
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 5, 7] and vocab.t2d.numel() == 12
    assert DraftVocab.from_maps(vocab.d2t, vocab.t2d).target_ids.tolist() == [1, 5, 7]
    assert vocab.to_target(torch.tensor([[2, 0]])).tolist() == [[7, 1]]
    assert vocab.to_draft(torch.tensor([7, 2, 1])).tolist() == [2, -1, 0]
    assert coverage(counts, vocab) == 8 / 9
    assert most_frequent(counts, 2, always=(11,)).target_ids.tolist() == [5, 11]
    with pytest.raises(SpecdraftError, match="different draft vocabularies"):
        DraftVocab.from_maps(vocab.d2t, torch.zeros(12, dtype=torch.bool))
    with pytest.raises(SpecdraftError, match="strictly ascending"):
        DraftVocab(torch.tensor([3, 3]), 12)
    with pytest.raises(SpecdraftError, match="size"):
        most_frequent(counts, 0)


def test_the_train_vocab_command(tiny: LoadedModel, train_folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "data"
    generate_data(tiny, load_training_prompts(train_folder), out, DataConfig(max_new_tokens=8))
    assert main(["train", "vocab", str(out), "--sizes", "8,320", "--vocab-size", "320"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("| 320 | 100.00% |")  # the whole vocabulary covers everything
    assert main(["train", "vocab", str(tmp_path / "nowhere")]) == 2


# =========================================================================== teacher forcing


def test_teacher_batches_equal_a_plain_forward_per_sequence(tiny: LoadedModel) -> None:
    import torch

    from specdraft.train.teacher import TeacherConfig, length_batches, teacher_batches

    g = torch.Generator().manual_seed(4)
    pairs = [(torch.randint(3, 300, (n,), generator=g).tolist(), torch.randint(3, 300, (m,), generator=g).tolist())
             for n, m in ((5, 7), (12, 3), (3, 20), (9, 9), (30, 40))]
    cfg = TeacherConfig(taps=(0, 1, 2), top_k=5, batch_tokens=40, max_len=64)
    seen = []
    for group, batch in teacher_batches(tiny.model, pairs, cfg):
        seen += group
        assert batch.tokens.shape[0] * batch.tokens.shape[1] <= max(40, max(batch.lengths))
        for b, i in enumerate(group):
            prompt, answer = pairs[i]
            seq = (prompt + answer)[:64]
            n = len(seq)
            with torch.inference_mode():
                cache = tiny.model.new_cache(1, n)
                out = tiny.model(torch.tensor([seq]), torch.arange(n)[None], cache, return_hidden=(0, 1, 2))
            assert batch.tokens[b, :n].tolist() == seq and batch.lengths[b] == n
            torch.testing.assert_close(batch.last_hidden[b, :n], out.last_hidden[0], atol=1e-5, rtol=1e-4)
            for layer in (0, 1, 2):
                torch.testing.assert_close(batch.taps[layer][b, :n], out.hidden[layer][0], atol=1e-5, rtol=1e-4)
            top = out.logits[0].softmax(-1).topk(5, dim=-1)
            assert torch.equal(batch.top_ids[b, :n], top.indices)
            torch.testing.assert_close(batch.top_probs[b, :n], top.values, atol=1e-5, rtol=1e-4)
            # positions whose next token is an answer token: the prompt's last through the answer's last but one
            assert batch.answer[b].nonzero().flatten().tolist() == list(range(len(prompt) - 1, n - 1))
    assert sorted(seen) == list(range(len(pairs)))
    assert length_batches([5, 50, 6, 7], 20) == [[0, 2], [3], [1]]


# =========================================================================== training Medusa heads


def test_medusa_training_learns_saves_resumes_and_refuses_other_settings(
        tiny: LoadedModel, train_folder: Path, tmp_path: Path, capsys) -> None:
    import torch

    from specdraft.proposers import make_proposer
    from specdraft.proposers.base import ProposerContext
    from specdraft.train.common import CHECKPOINT
    from specdraft.train.medusa import MedusaTrainConfig, evaluate, train_medusa
    from specdraft.train.teacher import TeacherConfig, teacher_batches

    data = tmp_path / "data"
    prompts = [TrainPrompt(f"p/{i}", "p", f"Say {i} twice. " * (1 + i % 3), None) for i in range(80)]
    generate_data(tiny, prompts, data, DataConfig(max_new_tokens=24, temperatures=(0.0,), batch_size=8))
    out = tmp_path / "heads"
    cfg = MedusaTrainConfig(heads=2, draft_vocab=64, epochs=3, lr=3e-3, batch_tokens=512, checkpoint_every=2)
    stopped = train_medusa(tiny, data, out, MedusaTrainConfig(**{**cfg.key(), "time_budget_s": 0.0}))
    assert stopped.positions == 0 and (out / CHECKPOINT).is_file()  # interrupted at once, with a checkpoint
    result = train_medusa(tiny, data, out, cfg)  # resumes and finishes
    assert result.positions > 0 and len(result.head_accuracy) == 2 and result.tau >= 1.0
    curve = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()]
    assert curve[-1] == {"epochs": 3.0, **result.row()} and curve[-1]["tau"] == round(result.tau, 4)
    heads = make_proposer("medusa", {"path": str(out)}, ProposerContext(tiny.model, tiny.tokenizer)).heads
    # the trained heads beat their untrained start (the target's LM head) on the training answers
    from specdraft.heads.medusa import MedusaConfig, MedusaHeads
    from specdraft.train.data import read_shards

    records = [r for r in read_shards(data) if r["split"] == "train"]
    batches = [b for _, b in teacher_batches(tiny.model, [(r["prompt"], r["response"]) for r in records],
                                             TeacherConfig(top_k=8, batch_tokens=512))]
    start = MedusaHeads.from_target(MedusaConfig(2, tiny.config.hidden_size, 64, tiny.config.vocab_size), heads.vocab,
                                    tiny.model.lm_head.weight.detach())
    assert evaluate(heads, batches).tau > evaluate(start, batches).tau
    with pytest.raises(SpecdraftError, match="other settings"):
        train_medusa(tiny, data, out, MedusaTrainConfig(heads=3, draft_vocab=64, epochs=3))
    # --init: a run that starts from the trained heads (and barely moves) measures what they measured
    again = train_medusa(tiny, data, tmp_path / "again", MedusaTrainConfig(**{**cfg.key(), "epochs": 1, "lr": 1e-12,
                                                                             "init": str(out)}))
    assert abs(again.tau - result.tau) < 0.05 and again.tau > 1.0
    with pytest.raises(SpecdraftError, match="3 heads|2 heads"):  # the settings must match the heads they start from
        train_medusa(tiny, data, tmp_path / "m3", MedusaTrainConfig(heads=3, draft_vocab=64, init=str(out)))
    assert main(["train", "medusa", "--data", str(data), "--out", str(tmp_path / "m4"), "--init", str(tmp_path / "nowhere"),
                 "--heads", "2", "--draft-vocab", "64", "--model", str(tiny.source)]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["train", "medusa", "--data", str(tmp_path / "nowhere"), "--out", str(out)]) == 2


# =========================================================================== training an EAGLE-3 head


def test_eagle_training_learns_saves_resumes_and_refuses_other_settings(
        tiny: LoadedModel, train_folder: Path, tmp_path: Path) -> None:
    import torch

    from specdraft.heads.eagle import EagleHead
    from specdraft.proposers import make_proposer
    from specdraft.proposers.base import ProposerContext
    from specdraft.train.common import CHECKPOINT, TeacherCache
    from specdraft.train.eagle import EagleTrainConfig, evaluate, train_eagle
    from specdraft.train.teacher import TeacherConfig, length_batches

    data = tmp_path / "data"
    prompts = [TrainPrompt(f"p/{i}", "p", f"Say {i} twice. " * (1 + i % 3), None) for i in range(80)]
    generate_data(tiny, prompts, data, DataConfig(max_new_tokens=24, temperatures=(0.0,), batch_size=8))
    out = tmp_path / "eagle"
    cfg = EagleTrainConfig(draft_vocab=64, steps=3, epochs=6, lr=5e-3, batch_tokens=512, checkpoint_every=2,
                           eval_steps=3)
    stopped = train_eagle(tiny, data, out, EagleTrainConfig(**{**cfg.key(), "time_budget_s": 0.0}))
    assert stopped.positions == 0 and (out / CHECKPOINT).is_file()  # interrupted at once, with a checkpoint
    result = train_eagle(tiny, data, out, cfg)  # resumes and finishes
    assert result.positions > 0 and len(result.accept) == 3 and result.tau >= 1.0
    head = make_proposer("eagle", {"path": str(out)}, ProposerContext(tiny.model, tiny.tokenizer)).head.float()
    # the trained head beats an untrained one (same vocabulary) on the training answers
    from specdraft.train.common import splits

    pairs, _, _ = splits(data, None)
    teacher = TeacherConfig(taps=head.config.taps, top_k=8, batch_tokens=512)
    batches = list(TeacherCache(tiny, pairs, teacher).all(length_batches([len(p) + len(a) for p, a in pairs], 512)))
    torch.manual_seed(0)
    start = EagleHead.for_target(tiny.config, head.vocab)
    with torch.no_grad():
        start.lm_head.weight.copy_(tiny.model.lm_head.weight[head.target_ids])
    trained = evaluate(head, tiny, batches, 3)
    assert trained.tau > evaluate(start, tiny, batches, 3).tau + 0.1
    with pytest.raises(SpecdraftError, match="other settings"):
        train_eagle(tiny, data, out, EagleTrainConfig(draft_vocab=64, steps=2, epochs=6))
    other = tmp_path / "other-data"  # the same settings over other answers: not resumed from this checkpoint
    generate_data(tiny, prompts[:40], other, DataConfig(max_new_tokens=12, temperatures=(0.0,), batch_size=8))
    with pytest.raises(SpecdraftError, match="other settings, data"):
        train_eagle(tiny, other, out, cfg)
    assert main(["train", "eagle", "--data", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert main(["train", "eagle", "--data", str(data), "--out", str(out), "--taps", "a,b"]) == 2


def test_training_is_deterministic_with_a_seed(tiny: LoadedModel, tmp_path: Path) -> None:
    """The same data, settings and seed give the same weights, byte for byte (on one machine and
    thread count); another seed (another start and another batch order) gives other weights."""
    from specdraft.train.eagle import EagleTrainConfig, train_eagle

    data = tmp_path / "data"
    prompts = [TrainPrompt(f"p/{i}", "p", f"Count to {i}. " * (1 + i % 2), None) for i in range(24)]
    generate_data(tiny, prompts, data, DataConfig(max_new_tokens=16, temperatures=(0.0,), batch_size=8))
    cfg = EagleTrainConfig(draft_vocab=64, steps=2, epochs=2, lr=3e-3, batch_tokens=256, eval_steps=2)
    weights = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train_eagle(tiny, data, tmp_path / name, dataclasses.replace(cfg, seed=seed), kind="mtp")
        weights.append((tmp_path / name / "model.safetensors").read_bytes())
    assert weights[0] == weights[1] and weights[0] != weights[2]


def test_mtp_training_learns_and_saves_a_loadable_module(tiny: LoadedModel, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    from specdraft.proposers import make_proposer
    from specdraft.proposers.base import ProposerContext
    from specdraft.train.eagle import EagleTrainConfig, train_eagle

    data = tmp_path / "data"
    prompts = [TrainPrompt(f"p/{i}", "p", f"Say {i} twice. " * (1 + i % 3), None) for i in range(80)]
    generate_data(tiny, prompts, data, DataConfig(max_new_tokens=24, temperatures=(0.0,), batch_size=8))
    cfg = EagleTrainConfig(draft_vocab=64, steps=2, epochs=2, lr=3e-3, batch_tokens=512, eval_steps=2, eval_every=2)
    result = train_eagle(tiny, data, tmp_path / "mtp", cfg, kind="mtp")
    curve = [json.loads(line) for line in (tmp_path / "mtp" / "curve.jsonl").read_text().splitlines()]
    assert result.positions > 0 and curve[-1]["tau"] == round(result.tau, 4)
    assert len(curve) > 2 and [r["epochs"] for r in curve] == sorted(r["epochs"] for r in curve)  # every 2 batches
    assert "held tau=" in capsys.readouterr().err  # the held-out measure shown on the progress bar
    proposer = make_proposer("mtp", {"path": str(tmp_path / "mtp")}, ProposerContext(tiny.model, tiny.tokenizer))
    assert proposer.head.config.taps == (tiny.config.num_layers,)
    # --init: a run that starts from the trained module (and barely moves) measures what it measured
    again = train_eagle(tiny, data, tmp_path / "mtp-again", dataclasses.replace(cfg, epochs=1, lr=1e-12,
                                                                                 init=str(tmp_path / "mtp")), kind="mtp")
    assert abs(again.tau - result.tau) < 0.05 and again.tau > 1.0
    with pytest.raises(SpecdraftError, match="no|not"):
        train_eagle(tiny, data, tmp_path / "m3", dataclasses.replace(cfg, init=str(tmp_path / "nowhere")), kind="mtp")
    assert main(["train", "mtp", "--data", str(data), "--out", str(tmp_path / "m2"), "--limit", "8", "--steps", "1",
                 "--draft-vocab", "64", "--batch-tokens", "256", "--model", str(tiny.source), "--held-out", str(data)]) == 0
    # the default model refuses the tiny model's answers (another tokenizer) in one line
    assert main(["train", "mtp", "--data", str(data), "--out", str(tmp_path / "m4"), "--limit", "8"]) == 2
    assert "holds answers of a model with another tokenizer" in capsys.readouterr().err
    # `train eval` measures the saved module as training did at its end (bfloat16 weights saved)
    capsys.readouterr()
    assert main(["train", "eval", str(tmp_path / "mtp"), "--data", str(data), "--steps", "2", "--batch-tokens", "512",
                 "--model", str(tiny.source)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("eval mtp ") and f"over {result.positions} positions" in line
    assert abs(float(line.split("held-out tau ")[1].split()[0]) - result.tau) < 0.05
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    for folder, needle in ((tmp_path / "nowhere", "config.json missing"), (tmp_path / "odd", "not a head")):
        assert main(["train", "eval", str(folder), "--data", str(data), "--model", str(tiny.source)]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1


def test_references_keep_to_the_chosen_sets_and_enter_the_draft_vocabulary(
        tiny: LoadedModel, train_folder: Path, tmp_path: Path) -> None:
    from specdraft.heads.mtp_checkpoint import load_mtp
    from specdraft.train.common import reference_pairs
    from specdraft.train.eagle import EagleTrainConfig, train_eagle

    tok = tiny.tokenizer
    every = reference_pairs(tiny, train_folder, 100)
    roleplay = reference_pairs(tiny, train_folder, 100, sources=("gpteacher-roleplay",))
    expected = [p for p in load_training_prompts(train_folder, ("gpteacher-roleplay",)) if p.split == "train"]
    assert len(roleplay) == len(expected) < len(every)
    assert [a for _, a in roleplay] == [tok.encode(p.reference, add_bos=False, add_eos=False, parse_special=False)
                                        + [tok.eos_id] for p in expected]
    # a run on one own answer and the references: its draft vocabulary is built from both
    data = tmp_path / "data"
    prompts = [TrainPrompt(f"p/{i}", "p", f"Say {i} twice.", None) for i in range(40)]
    generate_data(tiny, prompts, data, DataConfig(max_new_tokens=8, temperatures=(0.0,), batch_size=8))
    cfg = EagleTrainConfig(draft_vocab=64, steps=1, epochs=1, batch_tokens=256, eval_steps=1, limit=1,
                           references=100)
    train_eagle(tiny, data, tmp_path / "mtp", cfg, prompts_root=train_folder, kind="mtp")
    vocab = set(load_mtp(tmp_path / "mtp", tiny.config).target_ids.tolist())
    reference_tokens = {t for _, a in every for t in a}
    assert len(reference_tokens) < 64 and reference_tokens <= vocab  # every token the references use


def test_answers_of_another_model_are_refused_before_training(tmp_path: Path, tiny: LoadedModel) -> None:
    from specdraft.datastore import tokenizer_fingerprint
    from specdraft.train.common import splits

    rows = [_row(0, "train"), _row(1, "validation")]
    ours = _folder(tmp_path / "ours", rows, tokenizer=tokenizer_fingerprint(tiny.tokenizer))
    assert len(splits(ours, None, model=tiny)[0]) == 1
    theirs = _folder(tmp_path / "theirs", rows, tokenizer="another")
    with pytest.raises(SpecdraftError, match="theirs holds answers of a model with another tokenizer"):
        splits(theirs, None, model=tiny)

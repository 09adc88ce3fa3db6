"""The evaluation sets shipped inside the package: found without the repository around them,
intact (the digests in their README), and overridable with $SPECDRAFT_DATASETS."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest

from specdraft.errors import SpecdraftError
from specdraft.workloads import WORKLOADS, data_file, datasets_dir, load_workload, read_jsonl


def test_the_evaluation_sets_ship_inside_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDRAFT_DATASETS", raising=False)
    root = datasets_dir()
    assert root.parts[-2:] == ("specdraft", "data")
    for folder in ("spec_bench", "mt_bench", "humaneval", "qmsum", "edit_eval"):
        assert (root / folder / "LICENSE").is_file(), folder
    for name in WORKLOADS:
        assert load_workload(name, limit=1), name


def test_shipped_files_match_the_digests_in_their_readme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDRAFT_DATASETS", raising=False)
    root = datasets_dir()
    rows = re.findall(r"^\| `(\w+)/` \| `([\w.]+)` \|.*`([0-9a-f]{64})` \|$", (root / "README.md").read_text(), re.M)
    assert len(rows) == 5
    for folder, name, digest in rows:
        raw = (root / folder / name).read_bytes()
        # the digest is of the uncompressed data, except for HumanEval's upstream gzip file
        data = raw if folder == "humaneval" else (gzip.decompress(raw) if name.endswith(".gz") else raw)
        assert hashlib.sha256(data).hexdigest() == digest, f"{folder}/{name}"


def test_specdraft_datasets_points_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "spec_bench").mkdir()
    record = {"question_id": 7, "category": "qa", "turns": ["Why is the sky blue?"]}
    (tmp_path / "spec_bench" / "question.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    monkeypatch.setenv("SPECDRAFT_DATASETS", str(tmp_path))
    prompts = load_workload("qa")
    assert [(p.id, p.turns) for p in prompts] == [("spec_bench/7", ("Why is the sky blue?",))]
    monkeypatch.setenv("SPECDRAFT_DATASETS", str(tmp_path / "nowhere"))
    with pytest.raises(SpecdraftError, match="is not a folder"):
        load_workload("qa")


def test_gzipped_sets_are_read_and_a_corrupt_one_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n\n{"prompt": "b"}\n'))
    assert data_file(tmp_path, "set.jsonl") == path
    assert read_jsonl(path) == [{"prompt": "a"}, {"prompt": "b"}]
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n' * 100)[:40])  # truncated
    with pytest.raises(SpecdraftError, match="cannot read") as e:
        read_jsonl(path)
    assert "\n" not in str(e.value)

"""data/docs_eval.jsonl, the questions over real manuals in data/docs/: every gold phrase stands, byte for byte, on
the line it names, every context is the document's own lines, and eval.py reads the file."""
import json
from collections import Counter

import pytest

from conftest import ROOT

DATA = ROOT / "data"
EVAL = DATA / "docs_eval.jsonl"


def records() -> list[dict]:
    return [json.loads(line) for line in EVAL.read_text(encoding="utf-8").splitlines() if line.strip()]


def doc_lines(name: str) -> list[str]:
    return (DATA / "docs" / name).read_text(encoding="utf-8").split("\n")


def test_size_documents_and_splits():
    rs = records()
    ids = [r["id"] for r in rs]
    assert len(ids) == len(set(ids)), [i for i, n in Counter(ids).items() if n > 1]
    assert len(rs) >= 80
    docs = {r["doc"] for r in rs}
    assert len(docs) >= 6 and all((DATA / "docs" / d).is_file() for d in docs)
    assert sum(not r["answerable"] for r in rs) >= 15
    assert {r["split"] for r in rs} == {"dev", "test"}
    for split in ("dev", "test"):
        part = [r for r in rs if r["split"] == split]
        assert part and sum(not r["answerable"] for r in part) * 6 >= len(part), split
    sources = (DATA / "docs" / "SOURCES.md").read_text(encoding="utf-8")
    assert all(f"`{d}`" in sources for d in docs)  # each document's origin and licence noted


@pytest.mark.parametrize("r", records(), ids=lambda r: r["id"])
def test_gold_on_its_line_and_in_its_contexts(r):
    lines = doc_lines(r["doc"])
    first, last = r["context_lines"]
    assert 1 <= first <= last <= len(lines)
    assert r["contexts"] == ["\n".join(lines[first - 1:last])]  # the document's own lines, unchanged
    if r["answerable"]:
        (gold,) = r["short_answers"]
        assert gold and gold == gold.strip()
        assert gold in lines[r["line"] - 1], (r["line"], lines[r["line"] - 1])
        assert first <= r["line"] <= last
        assert f"[{gold}]" in r["answer"] and r["answer"].count("[") == 1
        assert all(gold in c for c in r["contexts"])
    else:
        assert r["answer"] == "No answer" and r["line"] is None
        assert not any(s in c for s in r.get("short_answers") or [] for c in r["contexts"])


def test_eval_reads_the_file():
    from eval import read_dataset

    rs = read_dataset(str(EVAL))
    assert len(rs) == len(records())
    assert all(r["contexts"] and isinstance(r["answerable"], bool) for r in rs)

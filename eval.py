"""Span parsing and the metrics of semi-extractive QA (EFA, EM, F1, ALR, answerability), and a dataset runner.

    python eval.py --data data/sample_eval.jsonl --model smollm2 --method chyd --out preds.jsonl
    python eval.py --score preds.jsonl
"""
from __future__ import annotations

import re
import string
from collections import Counter

SPAN_RE = re.compile(r"\[([^\[\]]*)\]")
NUMBER_RE = re.compile(r"^\s*\d+\s+")  # QuoteSum's source index: "[1 text]"


def extract_spans(answer: str, numbered: bool = False) -> list[str]:
    """The non-empty bracketed spans of an answer, outer whitespace stripped; with numbered, QuoteSum's `[N text]`."""
    spans = []
    for m in SPAN_RE.finditer(answer):
        s = NUMBER_RE.sub("", m.group(1), count=1) if numbered else m.group(1)
        if s.strip():
            spans.append(s.strip())
    return spans


def efa_counts(spans: list[str], contexts: list[str]) -> tuple[int, int]:
    """(spans, violations): a violation is a span found verbatim in no context."""
    return len(spans), sum(not any(s in c for c in contexts) for s in spans)


def efa(spans: list[str], contexts: list[str]) -> float:
    """Extraction Faithfulness Accuracy: the share of spans found verbatim in some context (1.0 with no spans)."""
    n, bad = efa_counts(spans, contexts)
    return 1.0 if n == 0 else (n - bad) / n


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles a/an/the, whitespace collapsed."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(pred: str, gold: str | list[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer (the best of several)."""
    golds = [gold] if isinstance(gold, str) else gold
    return max((float(normalize_answer(pred) == normalize_answer(g)) for g in golds), default=0.0)


def f1(pred: str, gold: str | list[str]) -> float:
    """Token F1 between normalised prediction and gold (the best of several); 1.0 when both are empty."""
    golds = [gold] if isinstance(gold, str) else gold
    best = 0.0
    for g in golds:
        p, t = normalize_answer(pred).split(), normalize_answer(g).split()
        if not p or not t:
            best = max(best, float(p == t))
            continue
        common = sum((Counter(p) & Counter(t)).values())
        if common:
            precision, recall = common / len(p), common / len(t)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best

"""The metrics of semi-extractive QA (EFA, EM, F1, ALR, answerability, retrieval recall), and a dataset runner.

    python eval.py --data data/sample_eval.jsonl --model smollm2 --method chyd --out preds.jsonl
    python eval.py --data data/sample_eval.jsonl --distractors 4 --out preds-4.jsonl    # the paper's multi-context setting
    python eval.py --data data/sample_eval.jsonl --retrieve --top-k 5 --out preds-rag.jsonl
    python eval.py --score preds.jsonl
"""
from __future__ import annotations

import json
import random
import re
import string
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, replace
from functools import cache
from pathlib import Path

from chyd import NO_ANSWER, PROMPTS, DecodeOptions, generate_stream, load_scorer, with_model_defaults
from cli import (RERANKER, CliError, Parser, add_batch_args, add_decoding_args, add_model_args, add_retrieval_args,
                 add_server_args, batch_size, check_at_least_one, check_output_file, check_retrieval_args, check_server_args,
                 decode_options, engine, load_model, run_cli)
from constraint import extract_spans, holds_word
from encoder import Encoder
from retrieve import RERANK_POOL, RERANK_WORDS, Document, Index


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


def is_no_answer(answer: str) -> bool:
    return normalize_answer(answer) == "no answer"


def answer_level_recall(pred_quoted: str, short_answers: list[str]) -> float:
    """ALR of one example: 1.0 when some normalised gold short answer is contained in the normalised quoted text."""
    quoted = normalize_answer(pred_quoted)
    return float(any(normalize_answer(a) and normalize_answer(a) in quoted for a in short_answers))


def degenerate(span: str) -> bool:
    """A quote that is no evidence, one that whole-word quotes may not close ([1], [,], [12]; not the term [zR])."""
    return not holds_word(span.encode())


def loops(answer: str, n: int = 4, times: int = 3) -> bool:
    """Whether some n words in a row occur `times` times or more in the answer: a decoding loop."""
    words = answer.split()
    return max(Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1)).values(), default=0) >= times


def rouge_l(pred: str, gold: str) -> float:
    """ROUGE-L F-measure between prediction and gold, brackets removed (rouge-score's implementation)."""
    from rouge_score import rouge_scorer

    strip = lambda s: s.replace("[", " ").replace("]", " ")
    return rouge_scorer.RougeScorer(["rougeL"]).score(strip(gold), strip(pred))["rougeL"].fmeasure


def harmonic_mean(a: float, b: float) -> float:
    return 2 * a * b / (a + b) if a + b else 0.0


def binary_scores(pred: list[bool], gold: list[bool]) -> dict:
    """Precision, recall, accuracy and F1 with True as the positive class."""
    tp = sum(p and g for p, g in zip(pred, gold))
    precision = tp / sum(pred) if sum(pred) else 0.0
    recall = tp / sum(gold) if sum(gold) else 0.0
    accuracy = sum(p == g for p, g in zip(pred, gold)) / len(gold) if gold else 0.0
    return {"precision": precision, "recall": recall, "accuracy": accuracy, "f1": harmonic_mean(precision, recall)}


def example_scores(p: dict) -> dict:
    """The per-example figures of one prediction record (prediction, answer, answerable, contexts, ...)."""
    spans = extract_spans(p["prediction"])
    golds = p["answer"] if isinstance(p["answer"], list) else [p["answer"]]
    gold_quoted = [" ".join(extract_spans(g)) for g in golds]
    quoted = " ".join(spans)
    n_spans, violations = efa_counts(spans, p["contexts"])
    short = p.get("short_answers") or [s for g in golds for s in extract_spans(g)]
    # EM and F1 as the paper's Table 4 and SQuAD: the quoted text against each gold short answer, the best;
    # f1_quotes against the gold answer's quotes joined (SEMQA's), which a one-phrase answer seldom matches
    return {"em": exact_match(quoted, short), "f1": f1(quoted, short), "f1_quotes": f1(quoted, gold_quoted),
            "alr": answer_level_recall(quoted, short), "spans": n_spans, "violations": violations,
            "degenerate": sum(map(degenerate, spans)), "loops": loops(p["prediction"]),
            "rouge_l": max(rouge_l(p["prediction"], g) for g in golds)}


def score(preds: list[dict]) -> dict:
    """The table's figures. EM, F1 (both against the gold short answers), F1 against the gold quotes, ALR and
    ROUGE-L average over answerable examples; EFA over every span; SEMQA is the harmonic mean of ROUGE-L and
    the quotes' F1."""
    per = [example_scores(p) for p in preds]
    answerable = [s for s, p in zip(per, preds) if p["answerable"]]
    mean = lambda key: sum(s[key] for s in answerable) / len(answerable) if answerable else 0.0
    n_spans, violations = sum(s["spans"] for s in per), sum(s["violations"] for s in per)
    decode_s = sum(p.get("decode_s", 0.0) for p in preds)
    out = {"n": len(preds), "em": mean("em"), "f1": mean("f1"), "f1_quotes": mean("f1_quotes"), "alr": mean("alr"),
           "efa": 1.0 if n_spans == 0 else (n_spans - violations) / n_spans, "spans": n_spans, "violations": violations,
           "quotes_per_answer": n_spans / len(preds) if preds else 0.0, "rouge_l": mean("rouge_l"),
           "degenerate": sum(s["degenerate"] for s in per), "looping": sum(s["loops"] for s in per),
           "latency_s": sum(p.get("latency_s", 0.0) for p in preds) / len(preds) if preds else 0.0,
           "tokens_per_s": sum(p.get("tokens", 0) for p in preds) / decode_s if decode_s else 0.0}
    out["semqa"] = harmonic_mean(out["rouge_l"], out["f1_quotes"])
    out["engines"] = sorted({p["engine"] for p in preds if p.get("engine")})
    hits = [p["gold_shown"] for p in preds if p["answerable"] and "gold_shown" in p]
    if hits:  # the passages were retrieved: how often a gold context was among them
        out["recall_at_k"], out["k"] = sum(hits) / len(hits), max(p["shown"] for p in preds)
    ans = binary_scores([not is_no_answer(p["prediction"]) for p in preds], [bool(p["answerable"]) for p in preds])
    out.update({f"answerable_{k}": v for k, v in ans.items()})
    return out


def format_table(s: dict) -> str:
    rows = [("n", f"{s['n']}"), ("EM", f"{s['em']:.3f} (quoted text against the short answers)"),
            ("F1", f"{s['f1']:.3f} (the same)"), ("F1, gold quotes", f"{s['f1_quotes']:.3f} (against the gold quotes joined)"),
            ("ALR", f"{s['alr']:.3f}"),
            ("EFA", f"{s['efa']:.3f} ({s['violations']} of {s['spans']} spans not verbatim)"),
            ("quotes/answer", f"{s['quotes_per_answer']:.2f}"),
            ("degenerate quotes", f"{s['degenerate']} (no word and no term: [1], [,])"),
            ("looping answers", f"{s['looping']} (four words in a row three times)"),
            ("answerability P/R/Acc/F1", "/".join(f"{s['answerable_' + k]:.3f}" for k in ("precision", "recall", "accuracy", "f1"))),
            ("ROUGE-L", f"{s['rouge_l']:.3f}"), ("SEMQA", f"{s['semqa']:.3f}"),
            ("latency s/answer", f"{s['latency_s']:.2f}"), ("tokens/s", f"{s['tokens_per_s']:.1f}")]
    if s.get("engines"):
        rows.insert(1, ("engine", ", ".join(s["engines"])))
    if "recall_at_k" in s:
        rows.insert(1, (f"retrieval recall@{s['k']}", f"{s['recall_at_k']:.3f} (a gold context shown)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def mcnemar_exact(a: list[bool], b: list[bool]) -> float:
    """Two-sided exact McNemar p-value: a binomial test on the discordant pairs."""
    from math import comb

    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n, k = only_a + only_b, min(only_a, only_b)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def wilcoxon_p(a: list[float], b: list[float]) -> float:
    """Two-sided Wilcoxon signed-rank p-value of paired scores (scipy); 1.0 when they never differ."""
    from scipy.stats import wilcoxon

    return 1.0 if all(x == y for x, y in zip(a, b)) else float(wilcoxon(a, b).pvalue)


class DataError(ValueError):
    pass


REQUIRED = {"id": str, "question": str, "contexts": list, "answer": (str, list), "answerable": bool}


def data_text(path: str) -> str:
    """A data file's text; a missing file, a folder or text that is not UTF-8 is a DataError naming the path."""
    if Path(path).is_dir():
        raise DataError(f"{path} is a folder, not a data file")
    if not Path(path).is_file():
        raise DataError(f"{path} does not exist")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None


def records_to_resume(path: str, required: dict, kind: str) -> list[dict]:
    """The records an --out file already holds (none if it is not there); another JSONL (the dataset itself) is
    refused as not `kind`, not appended to."""
    if not Path(path).is_file():
        return []
    try:
        return read_jsonl(path, required)
    except DataError as e:
        raise DataError(f"--out {path} is not {kind} to resume: {e}") from None


def say_read_back(prog: str, n: int, total: int, path, what: str = "answers") -> None:
    """One line on stderr when a run resumes: what it prints next counts an earlier run's answers too, which a
    change to the code since then did not make."""
    if n:
        print(f"{prog}: {n} of {total} {what} read back from {path}, not made again (another --out makes them)",
              file=sys.stderr)


def predictions_to_resume(path: str) -> dict[str, dict]:
    """The predictions an --out file already holds, by id."""
    return {p["id"]: p for p in records_to_resume(path, PRED_FIELDS, "a predictions file")}


def read_jsonl(path: str, required: dict = REQUIRED) -> list[dict]:
    """Records of a JSONL file; a bad line is named by file, line and field."""
    records = []
    for n, line in enumerate(data_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(r, dict):
            raise DataError(f"{path}:{n}: not a JSON object")
        for name, kind in required.items():
            if name not in r:
                raise DataError(f"{path}:{n}: missing field '{name}'")
            if not isinstance(r[name], kind):
                raise DataError(f"{path}:{n}: field '{name}' has the wrong type ({type(r[name]).__name__})")
        if "contexts" in required and (not r["contexts"] or not all(isinstance(c, str) and c.strip() for c in r["contexts"])):
            raise DataError(f"{path}:{n}: field 'contexts' must be a list of non-empty strings")
        records.append(r)
    return records


PRED_FIELDS = dict(REQUIRED, prediction=str)
QUOTESUM_FIELDS = {"qid": str, "unique_id": str, "question": str, "summary": str, "source1": str}
NUMBERED_QUOTE_RE = re.compile(r"\[\s*\d+\s+([^\[\]]*?)\s*\]")  # QuoteSum's "[ 2 quoted text ]": the source, then the quote
FORMATS = ("auto", "chyd", "quotesum", "squad2")


def read_dataset(path: str, fmt: str = "auto") -> list[dict]:
    """The examples of a dataset file, in this project's format, from this project's JSONL, QuoteSum's JSONL
    (one example a unique_id) or SQuAD 2.0's JSON, told apart by their fields unless fmt names one."""
    text = data_text(path)
    if fmt in ("auto", "squad2"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            if fmt == "squad2":
                raise DataError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
            whole = None  # JSON lines, not one JSON document
        if isinstance(whole, dict) and isinstance(whole.get("data"), list):
            return from_squad2(whole, path)
        if fmt == "squad2":
            raise DataError(f"{path}: not SQuAD 2.0 JSON (no 'data' list of articles)")
    if fmt == "auto":
        line = next((l for l in text.splitlines() if l.strip()), "")
        try:
            first = json.loads(line)
        except json.JSONDecodeError:
            return read_jsonl(path)  # which names the line
        fmt = "chyd" if "contexts" in first else "quotesum" if "unique_id" in first and "summary" in first else None
        if fmt is None:
            raise DataError(f"{path}: in none of the formats; expected the fields id, question, contexts, answer, "
                            f"answerable (chyd), or qid, unique_id, question, summary, source1..source8 (QuoteSum), "
                            f"or SQuAD 2.0's data -> paragraphs -> qas")
    if fmt == "quotesum":
        return [from_quotesum(r) for r in read_jsonl(path, QUOTESUM_FIELDS)]
    return read_jsonl(path)


def from_quotesum(r: dict) -> dict:
    """A QuoteSum row: its non-empty sources are the contexts; `[ 2 text ]` quotes become `[text]`; the short
    answers are those the summary covers and each source's own (`short_ans_N`), which EM and F1 are taken against."""
    covered = NUMBERED_QUOTE_RE.sub(r"[\1]", r.get("covered_short_answers") or "")
    own = [a.strip() for i in range(1, 9) if (a := r.get(f"short_ans_{i}") or "").strip()]
    return {"id": r["unique_id"], "qid": r["qid"], "question": r["question"],
            "contexts": [r[f"source{i}"] for i in range(1, 9) if (r.get(f"source{i}") or "").strip()],
            "answer": NUMBERED_QUOTE_RE.sub(r"[\1]", r["summary"]), "answerable": True,
            "short_answers": list(dict.fromkeys(extract_spans(covered) + own))}


def from_squad2(doc: dict, path: str) -> list[dict]:
    """SQuAD 2.0's questions: the paragraph is the context, each distinct gold answer a quote, "No answer"
    for the unanswerable ones."""
    out = []
    try:
        for article in doc["data"]:
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    texts = [] if qa.get("is_impossible") else list(dict.fromkeys(a["text"] for a in qa["answers"]))
                    answer = [f"[{t}]" for t in texts] if len(texts) > 1 else f"[{texts[0]}]" if texts else NO_ANSWER
                    out.append({"id": qa["id"], "question": qa["question"], "contexts": [paragraph["context"]],
                                "answer": answer, "answerable": bool(texts), "short_answers": texts})
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: not SQuAD 2.0 (data -> paragraphs -> qas: {type(e).__name__} {e})") from None
    return out


def with_distractors(data: list[dict], corpus: list[dict], n: int) -> list[dict]:
    """The paper's multi-context setting: each example's contexts and the n passages of the other examples of
    the corpus closest to its question (all-MiniLM-L6-v2, cosine), in an order shuffled per example id."""
    pool = list(dict.fromkeys(c for ex in corpus for c in ex["contexts"]))
    encoder = Encoder.load()
    vectors = encoder.embed(pool)
    out = []
    for ex, q in zip(data, encoder.embed([ex["question"] for ex in data])):
        own = set(ex["contexts"])
        ranked = [pool[i] for i in (vectors @ q).argsort(descending=True).tolist() if pool[i] not in own]
        shown = ex["contexts"] + ranked[:n]
        random.Random(ex["id"]).shuffle(shown)
        out.append(dict(ex, contexts=shown, gold_contexts=ex["contexts"], gold_shown=True, shown=len(shown)))
    return out


def with_retrieval(data: list[dict], corpus: list[dict], args, answering: tuple | None = None) -> list[dict]:
    """Every example's contexts pooled into one corpus, chunked and indexed; each question shown its top k (--rerank's
    order where given, scored by the answering model (its name, model, tokenizer) where --rerank names it), the best
    last."""
    pool = list(dict.fromkeys(c for ex in corpus for c in ex["contexts"]))
    names = {c: f"context {i + 1}" for i, c in enumerate(pool)}
    index = Index([Document(name, None, c) for c, name in names.items()], args.chunk_tokens, args.chunk_overlap)
    rerank = load_scorer(args.rerank, args.device, answering) if args.rerank else None
    out = []
    for ex in data:
        hits = index.search(ex["question"], args.top_k, args.retriever, rerank)[::-1]  # the best last, as chyd.py shows them
        gold = {names[c] for c in ex["contexts"]}
        out.append(dict(ex, contexts=[h.text for h in hits], gold_contexts=ex["contexts"],
                        gold_shown=any(h.file in gold for h in hits), shown=len(hits)))
    return out


def answers(args, options: DecodeOptions, questions: list[str], contexts: list[list[str]], local: tuple | None):
    """(i, Result) as each answer ends: our decoder (local: load_model's model and tokenizer), or with --server a
    serving engine, --concurrency requests at once."""
    if not args.server:
        return generate_stream(*local, questions, contexts, options=options)
    from server import open_served, server_stream, unsupported

    srv, tok, cfg = open_served(args.server, args.model, args.served_model)
    print(f"eval.py: {args.concurrency} requests at a time", file=sys.stderr)
    if ignored := unsupported(options):
        print(f"eval.py: the engine does not apply {', '.join(ignored)}", file=sys.stderr)
    return server_stream(srv, tok, questions, contexts, with_model_defaults(options, cfg, served=True),
                         concurrency=args.concurrency)


def gold_span(doc: Document, line: int, phrase: str) -> tuple[int, int]:
    """The character range of phrase where it stands on the document's line (from 1)."""
    start = doc.newlines[line - 2] + 1 if line > 1 else 0
    end = doc.newlines[line - 1] if line - 1 < len(doc.newlines) else len(doc.text)
    at = doc.text.find(phrase, start, end)
    if at < 0:
        raise DataError(f"{phrase!r} is not on line {line} of {doc.file}")
    return at, at + len(phrase)


def line_recall(index: Index, records: list[dict], k: int, retriever: str, rerank=None) -> float:
    """Retrieval recall@k of the gold line: the share of answerable records (fields doc, line, short_answers, as in
    data/docs_eval.jsonl) whose gold phrase, where it stands on its line, lies whole inside one of the top k chunks
    of the index (its documents named by file, `doc` the file's name); rerank: Index.search's."""
    docs = {Path(d.file).name: d for d in index.docs}
    hits = [holds_gold(index.search(r["question"], k, retriever, rerank), docs[r["doc"]], r)
            for r in records if r["answerable"]]
    return sum(hits) / len(hits) if hits else 0.0


def holds_gold(passages: list, doc: Document, r: dict) -> bool:
    """Whether one of the passages holds r's gold phrase whole, where it stands on its line of doc."""
    start, end = gold_span(doc, r["line"], r["short_answers"][0])
    return any(p.file == doc.file and p.start <= start and end <= p.end for p in passages)


def differing(records, setting: dict) -> dict:
    """The fields of setting that some record holds another value of, with that value (a record without the field
    was written before it was kept: taken as this run's)."""
    return {k: r[k] for r in records for k, v in setting.items() if r.get(k, v) != v}


def weights_named(weights: str | None) -> str:
    return f"{weights} weights" if weights else "a served engine"


def decoding(o: DecodeOptions) -> dict:
    """The options that decide an answer, as given (None: the model's default), for a resumed run to match."""
    return {k: v for k, v in asdict(o).items() if k not in ("on_token", "batch_size")}


def run(args, options: DecodeOptions) -> list[dict]:
    """Decode every example not yet in --out, appending one prediction a line; returns all predictions."""
    corpus = read_dataset(args.data, args.format)
    if not corpus:
        raise DataError(f"{args.data} has no examples")
    data = corpus[: args.limit]
    done = predictions_to_resume(args.out)
    # a resumed prediction is this run's: the default --out is the same file whatever the model
    kept = [done[ex["id"]] for ex in data if ex["id"] in done]
    if other := differing(kept, {"method": args.method, "model": args.model}):
        raise CliError(f"--out {args.out} holds {other.get('method', args.method)} answers of {other.get('model', args.model)}, "
                       f"not {args.method} answers of {args.model}: give another --out (a rerun resumes its own)")
    if other := differing([p.get("decoding", {}) for p in kept], decoding(options)):
        raise CliError(f"--out {args.out} holds answers decoded with other options "
                       f"({', '.join(f'{k}={v!r}' for k, v in other.items())}): give another --out")
    todo = [ex for ex in data if ex["id"] not in done]
    local = load_model(args) if todo and not args.server else None  # loaded first: it may rerank too
    weights = engine(local[0], args)["weights"] if local else None  # None: a served engine's
    if todo and (other := differing(kept, {"weights": weights})):
        raise CliError(f"--out {args.out} holds answers of {args.model} from {weights_named(other['weights'])}, "
                       f"not {weights_named(weights)}: give another --out")
    if todo and args.distractors:  # the passages come from every example of the file, --limit or not
        todo = with_distractors(todo, corpus, args.distractors)
    elif todo and args.retrieve:
        todo = with_retrieval(todo, corpus, args, None if local is None else (args.model, *local))
    with open(args.out, "a", encoding="utf-8") as out:
        stream = answers(args, options, [ex["question"] for ex in todo], [ex["contexts"] for ex in todo], local) if todo else []
        t0 = time.perf_counter()
        ended, written = {}, 0  # answers end out of order; they are written in the order of the data
        for i, r in stream:
            now, ex = time.perf_counter(), todo[i]
            # latency: the wall time since the previous answer ended, so that the mean is seconds an answer
            ended[i] = dict(ex, prediction=r.text, method=args.method, model=args.model, weights=weights,
                            decoding=decoding(options), latency_s=now - t0,
                            batch_size=options.batch_size, tokens=len(r.tokens), decode_s=r.decode_s,
                            forward_passes=r.forward_passes, quotes_opened=r.quotes_opened, quotes_forced=r.quotes_forced,
                            engine=getattr(r, "engine", "chyd"), not_verbatim=getattr(r, "not_verbatim", []))
            t0 = now
            while written in ended:
                record = ended.pop(written)
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                done[record["id"]], written = record, written + 1
            out.flush()  # an interrupted run resumes after the last answer written
            print(f"\r{args.method} {written}/{len(todo)}", end="", file=sys.stderr, flush=True)
    if todo:
        print(file=sys.stderr)
    say_read_back("eval.py", len(kept), len(data), args.out)
    return [done[ex["id"]] for ex in data]


def compare(path_a: str, path_b: str) -> str:
    """Paired differences between two prediction files over their shared answerable examples."""
    a = {p["id"]: p for p in read_jsonl(path_a, PRED_FIELDS)}
    b = {p["id"]: p for p in read_jsonl(path_b, PRED_FIELDS)}
    ids = [i for i in a if i in b and a[i]["answerable"]]
    if not ids:
        raise DataError(f"{path_a} and {path_b} share no answerable example")
    sa, sb = [example_scores(a[i]) for i in ids], [example_scores(b[i]) for i in ids]
    lines = [f"paired over {len(ids)} answerable examples: A = {path_a}, B = {path_b}"]
    for key, test in (("em", "McNemar exact"), ("alr", "McNemar exact"), ("f1", "Wilcoxon signed-rank")):
        x, y = [s[key] for s in sa], [s[key] for s in sb]
        p = mcnemar_exact([v == 1 for v in x], [v == 1 for v in y]) if test.startswith("McNemar") else wilcoxon_p(x, y)
        lines.append(f"{key.upper():<4} A {sum(x) / len(x):.3f}  B {sum(y) / len(y):.3f}  "
                     f"B-A {(sum(y) - sum(x)) / len(x):+.3f}  p = {p:.4f} ({test})")
    return "\n".join(lines)


DOCS_EVAL = Path(__file__).resolve().parent / "data" / "docs_eval.jsonl"  # questions over the manuals in data/docs/


def split_of(split: str) -> list[dict]:
    """The records of data/docs_eval.jsonl in one split (dev: tune; test: report)."""
    return [r for r in read_jsonl(str(DOCS_EVAL)) if r["split"] == split]


def lines_command(argv: list[str]) -> int:
    """eval.py lines: retrieval recall@k of the gold line over data/docs/, for each retriever."""
    p = Parser(prog="eval.py lines", description="Recall@k of the gold line of data/docs_eval.jsonl over data/docs/.")
    p.add_argument("--split", choices=["dev", "test"], default="dev")
    add_retrieval_args(p, retriever=False)
    p.add_argument("--rerank", metavar="MODEL", help=f"also each retriever's top {RERANK_POOL} (and BM25's top {RERANK_WORDS}) "
                                                     "reordered by MODEL (chyd.py --rerank)")
    p.add_argument("--device", default="cpu", help="the reranker's device")
    args = p.parse_args(argv)
    check_retrieval_args(args)
    check_at_least_one(args, "top_k")
    from retrieve import read_documents

    index = Index(read_documents([str(DOCS_EVAL.parent / "docs")]), args.chunk_tokens, args.chunk_overlap)
    records = split_of(args.split)
    print(f"{args.split}: {sum(r['answerable'] for r in records)} answerable questions, {len(index.chunks)} chunks of "
          f"{args.chunk_tokens} tokens ({args.chunk_overlap} overlap)")
    rerank = load_scorer(args.rerank, args.device) if args.rerank else None
    for retriever in ("bm25", "dense", "hybrid"):
        print(f"{retriever:>6}  recall@{args.top_k} of the gold line {line_recall(index, records, args.top_k, retriever):.3f}")
        if rerank:
            print(f"{retriever:>6}  reranked by {args.rerank}: {line_recall(index, records, args.top_k, retriever, rerank):.3f}",
                  flush=True)
    return 0


def gold_quoted(p: dict) -> bool:
    """Whether the gold phrase (the first short answer) stands, as written, inside a quote that is verbatim in the
    passages shown."""
    gold = (p.get("short_answers") or [""])[0]
    return bool(gold) and any(gold in s and any(s in c for c in p["contexts"]) for s in extract_spans(p["prediction"]))


def shown_docs(records: list[dict], index: Index, k: int, retriever: str, best_last: bool = False,
               rerank=None) -> list[dict]:
    """Each record with its top k chunks of data/docs/ as contexts instead of its own lines (best first, or with
    best_last the best next to the question; rerank: Index.search's), and whether the gold phrase at its line was
    among them."""
    docs = {Path(d.file).name: d for d in index.docs}
    out = []
    for r in records:
        hits = index.search(r["question"], k, retriever, rerank)
        contexts = [h.text for h in (reversed(hits) if best_last else hits)]
        out.append(dict(r, contexts=contexts, gold_shown=r["answerable"] and holds_gold(hits, docs[r["doc"]], r),
                        shown=len(hits)))
    return out


def quality_rows(retriever: str, width: int, reranker: str = RERANKER) -> dict[str, tuple[str, dict | None, dict]]:
    """eval.py quality's rows: key -> (label, shown_docs' arguments or None for the question's own lines (a
    "rerank" entry: the reranker's name), DecodeOptions fields)."""
    search, ref, shown = {"quote_search": width}, {"prompt": "reference"}, {"retriever": retriever}
    default = {"retriever": "hybrid", "best_last": True, "rerank": reranker}
    return {
        "own": ("the question's own lines (today)", None, {}),
        "sentence": ("own lines, a sentence then its quote (no quote-first)", None, {"quote_first": False}),
        "reference": ("own lines, reference prompt", None, ref),
        "search": (f"own lines, quote search {width}", None, search),
        "own-all": (f"own lines, reference prompt + quote search {width}", None, {**ref, **search}),
        "hybrid": ("retrieved (hybrid, the default before reranking)", {"retriever": "hybrid"}, {}),
        "default": (f"retrieved as chyd.py does by default (hybrid, its top {RERANK_POOL} and BM25's top {RERANK_WORDS} "
                    f"reranked by {reranker}, the best chunk last)",
                    default, {}),
        "default-search": (f"the default + quote search {width}", default, search),
        "default-reference": ("the default + reference prompt", default, ref),
        "default-all": (f"the default + reference prompt + quote search {width}", default, {**ref, **search}),
        "retrieved": (f"retrieved ({retriever})", shown, {}),
        "retrieved-last": (f"retrieved ({retriever}), the best chunk last", {**shown, "best_last": True}, {}),
        "retrieved-rerank": (f"retrieved ({retriever}), the top {RERANK_POOL} (and BM25's top {RERANK_WORDS}) reranked by "
                             f"{reranker}, the best chunk last",
                             {**shown, "best_last": True, "rerank": reranker}, {}),
        "retrieved-reference": (f"retrieved ({retriever}), reference prompt", shown, ref),
        "retrieved-all": (f"retrieved ({retriever}), reference prompt + quote search {width}", shown, {**ref, **search}),
    }


def quality_row(model, tok, data: list[dict], options: DecodeOptions, out: Path | None, setting: str) -> list[dict]:
    """One row's predictions; with out, each written as it ends and the ones already there kept (resume), when they
    were decoded in the same setting (the model and its weights)."""
    done = predictions_to_resume(str(out)) if out else {}
    if other := {p.get("setting") for p in done.values()} - {setting}:
        raise CliError(f"{out} holds answers of another setting ({', '.join(map(str, other))}, not {setting}): "
                       "give another --out")
    todo = [ex for ex in data if ex["id"] not in done]
    say_read_back("eval.py quality", len(data) - len(todo), len(data), out)
    t0 = time.perf_counter()
    with open(out, "a", encoding="utf-8") if out else nullcontext() as f:
        for i, r in generate_stream(model, tok, [ex["question"] for ex in todo], [ex["contexts"] for ex in todo],
                                    options=options):
            now = time.perf_counter()  # latency: the wall time since the previous answer ended (batched answers)
            done[todo[i]["id"]] = p = dict(todo[i], prediction=r.text, latency_s=now - t0, setting=setting)
            t0 = now
            if f:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
                f.flush()
    return [done[ex["id"]] for ex in data]


def quality_command(argv: list[str]) -> int:
    """eval.py quality: the levers of issue 31 alone and together on a split of data/docs_eval.jsonl, one row each."""
    p = Parser(prog="eval.py quality", description="The answer-quality levers on data/docs_eval.jsonl, one row each.")
    p.add_argument("--split", choices=["dev", "test"], default="test")
    p.add_argument("--width", type=int, default=8,
                   help="quote search's beam width in the rows that use it (8, as SmolLM2's default)")
    p.add_argument("--rows", help=f"comma-separated rows to run (default: all): {', '.join(quality_rows('bm25', 4))}")
    p.add_argument("--out", metavar="DIR", help="keep each row's predictions in DIR/ROW.jsonl; a rerun resumes them")
    p.add_argument("--limit", type=int)
    add_model_args(p)
    add_batch_args(p)
    add_decoding_args(p, DecodeOptions(temperature=0.0), PROMPTS)
    add_retrieval_args(p)  # --retriever, --rerank: the retrieval levers' rows' (the default row's retriever is hybrid)
    args = p.parse_args(argv + ["--greedy"])
    check_retrieval_args(args)
    check_at_least_one(args, "top_k", "limit", "width")  # --top-k 0 would show the retrieved rows no chunk
    table = quality_rows(args.retriever, args.width, args.rerank or RERANKER)
    keys = args.rows.split(",") if args.rows else list(table)
    if unknown := [k for k in keys if k not in table]:
        raise CliError(f"--rows: no row {', '.join(map(repr, unknown))} (rows: {', '.join(table)})")
    out = Path(args.out) if args.out else None
    if out and out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file, not a folder")
    base = decode_options(args, DecodeOptions(batch_size=batch_size(args)))
    records = split_of(args.split)[:args.limit]
    from retrieve import read_documents

    index = Index(read_documents([str(DOCS_EVAL.parent / "docs")]), args.chunk_tokens, args.chunk_overlap)
    model, tok = load_model(args)
    weights, chunks = engine(model, args)["weights"], f"{args.chunk_tokens}/{args.chunk_overlap}"
    if out:
        out.mkdir(parents=True, exist_ok=True)
    print(f"{args.split} split of {DOCS_EVAL.name}: {len(records)} questions, {sum(r['answerable'] for r in records)} "
          f"answerable; {args.model}; retrieved: top {args.top_k} of data/docs/ in chunks of {args.chunk_tokens} tokens")
    print("| setting | gold phrase quoted | EM | F1 | ALR | EFA | degenerate | looping | answerability F1 | recall | s/answer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    scorer = cache(lambda name: load_scorer(name, args.device, (args.model, model, tok)))  # each reranker loaded once
    shown_by = {}  # a row's retrieval -> the chunks it shows, retrieved once for every row that shows them
    for key in keys:
        name, shown, fields = table[key]
        retrieval = tuple(sorted(shown.items())) if shown else None
        if shown and retrieval not in shown_by:
            how = dict(shown, rerank=scorer(shown["rerank"])) if "rerank" in shown else shown
            shown_by[retrieval] = shown_docs(records, index, args.top_k, **how)
        data = shown_by[retrieval] if shown else records
        options = replace(base, **fields)
        # a row's setting, for a resumed row to match: the chunks it shows and what decides its answers (flags, levers)
        given = {k: v for k, v in decoding(options).items() if v != getattr(DecodeOptions(temperature=0.0), k)}
        shows = dict(retrieval, top_k=args.top_k, chunks=chunks) if shown else {}
        setting = ", ".join([args.model, weights] + [f"{k}={v}" for k, v in {**shows, **given}.items()])
        preds = quality_row(model, tok, data, options, out / f"{key}.jsonl" if out else None, setting)
        s = score(preds)
        quoted = [gold_quoted(q) for q in preds if q["answerable"]]
        recall = f"{s['recall_at_k']:.3f}" if "recall_at_k" in s else "-"
        print(f"| {name} | {sum(quoted) / len(quoted):.3f} | {s['em']:.3f} | {s['f1']:.3f} | {s['alr']:.3f} | "
              f"{s['efa']:.3f} ({s['violations']}/{s['spans']}) | {s['degenerate']} | {s['looping']} | "
              f"{s['answerable_f1']:.3f} | {recall} | {s['latency_s']:.2f} |", flush=True)
    return 0


def command(argv) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quality"]:
        return quality_command(argv[1:])
    if argv[:1] == ["compare"]:
        if len(argv) != 3:
            raise CliError("usage: eval.py compare A.jsonl B.jsonl")
        print(compare(argv[1], argv[2]))
        return 0
    if argv[:1] == ["lines"]:
        return lines_command(argv[1:])
    p = Parser(prog="eval.py", description="Score CHyD or free decoding on a JSONL QA set.")
    p.add_argument("--data", help="dataset: this project's JSONL, QuoteSum's JSONL or SQuAD 2.0's JSON")
    p.add_argument("--format", choices=FORMATS, default="auto", help="the dataset's format (default: told by its fields)")
    p.add_argument("--score", metavar="PREDS", help="score saved predictions, without a model")
    p.add_argument("--method", choices=["chyd", "free"], default="chyd",
                   help="chyd: quotes verbatim by construction; free: the same prompt decoded freely")
    p.add_argument("--out", help="predictions JSONL; examples already in it are skipped (resume)")
    p.add_argument("--limit", type=int)
    p.add_argument("--distractors", type=int, default=0, metavar="N",
                   help="add N passages of the other examples, the closest to the question (the paper's setting: 4)")
    p.add_argument("--retrieve", action="store_true",
                   help="pool every example's contexts and show each question its --top-k retrieved chunks")
    add_batch_args(p)
    add_model_args(p)
    add_server_args(p)
    add_decoding_args(p, DecodeOptions(), PROMPTS)
    add_retrieval_args(p)
    args = p.parse_args(argv)
    if args.score:
        print(format_table(score(read_jsonl(args.score, PRED_FIELDS))))
        return 0
    if not args.data:
        raise CliError("give --data FILE (and --out FILE), or --score PREDS")
    check_at_least_one(args, "limit")
    if args.distractors < 0:
        raise CliError(f"--distractors must be >= 0, got {args.distractors}")
    if args.distractors and args.retrieve:
        raise CliError("--distractors and --retrieve are two settings: give one")
    check_retrieval_args(args)
    check_server_args(args)
    if args.retrieve and args.top_k < 1:
        raise CliError(f"--retrieve needs --top-k >= 1, got {args.top_k}")
    options = decode_options(args, DecodeOptions(constrained=args.method == "chyd", batch_size=batch_size(args)))
    args.out = args.out or f"preds-{args.method}.jsonl"
    check_output_file("--out", args.out)
    print(format_table(score(run(args, options))))
    return 0


def main(argv=None) -> int:
    return run_cli("eval.py", command, argv)


if __name__ == "__main__":
    sys.exit(main())

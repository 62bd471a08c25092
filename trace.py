"""Facet-level tracing of how an answer uses its evidence (Elchafei et al., "Facet-Level Tracing of Evidence
Uncertainty and Hallucination in RAG"), with CHyD's verbatim quotes in the modes that see evidence.

    python trace.py --data data/facets_sample.jsonl --docs data/manual.txt --docs data/leaflet.txt \
        --out trace.jsonl --report report.html

A question is split into facets (the data's, or the model's list); each facet gets its own chunks (cosine,
all-MiniLM-L6-v2) and three answers: Strict RAG, Soft RAG (both CHyD over the facet's chunks) and LLM-only.
Every answer is scored against every chunk (faith, quoted_share), each facet gets one label of the evidence
taxonomy (label()), and each mode's facet answers are merged into one answer to the question.
"""
from __future__ import annotations

import html
import io
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

from checkpoints import ALIASES
from chyd import DecodeOptions, decode_stream, ensure_cache, prefill, with_model_defaults
from cli import (CliError, Parser, add_batch_args, add_decoding_args, add_model_args, add_retrieval_args, add_server_args,
                 batch_size, check_at_least_one, check_output_file, check_retrieval_args, check_server_args, decode_options,
                 engine, load_model, run_cli)
from constraint import extract_spans
from eval import DataError, decoding, differing, f1, normalize_answer, read_jsonl, records_to_resume, say_read_back
from retrieve import Index, read_documents

MODES = ("strict", "soft", "llm_only")
LABELS = ("failure", "misalignment", "overridden", "helpful", "robust")  # also the order of precedence
NO_ANSWER = "NO_ANSWER"  # Strict RAG's abstention
JUDGE_WORDS = ("yes", "no", "maybe")  # the judge's words for entails, contradicts, neither
SILENT_JUDGE = "smollm2-135m"  # measured to say "no" to every pair (README): its faith tells nothing
FIGURE_WIDTH = 10.5  # inches at most, 1,008 px: the three heat maps fit the report's 1,100 px column

# the paper's prompts as the issue gives them; Strict and Soft add how CHyD quotes
DECOMPOSE_PROMPT = (
    "Task: Given the following question, decompose it into a list of atomic sub-questions, where each sub-question "
    "addresses a single fact or reasoning step required to answer the original question. Each sub-question should be "
    "answerable independently.\nQuestion: {question}\nOutput format: Numbered list of sub-questions.")
QUOTE_RULE = "Copy the words you take from the evidence exactly as they stand, between [ and ]."
# the evidence opens the message, so that a facet's Strict and Soft prompts share its keys and values (decode)
PROMPTS = {
    "strict": "{evidence}\n\nUse ONLY the evidence above. If the evidence does not clearly support an answer, respond "
              "exactly with NO_ANSWER. Answer in one or two sentences. " + QUOTE_RULE + "\n\nQuestion: {question}",
    "soft": "{evidence}\n\nYou may use the evidence above and your general knowledge. Answer in one or two sentences. "
            + QUOTE_RULE + "\n\nQuestion: {question}",
    "llm_only": "Answer the question in one or two sentences.\n\nQuestion: {question}",
}
AGGREGATE_PROMPT = (
    "Task: Given a question and the answers to its sub-questions, combine them into one answer to the question, in one "
    "or two sentences. Keep the words between [ and ] as they are.\nQuestion: {question}\nSub-questions and answers:\n"
    "{facets}")
JUDGE_PROMPT = (  # what depends on the answer comes last: the rest is computed once a chunk (ModelJudge)
    "Passage:\n{chunk}\n\nDoes the passage support the proposed answer to the question below? Reply with one word: "
    "yes if the passage supports it, no if the passage contradicts it, maybe if the passage does not say.\n\n"
    "Question: {facet}\nProposed answer: {answer}")


def words(text: str) -> list[str]:
    return normalize_answer(text.replace("_", " ")).split()


def contains(text: str, phrase: str) -> bool:
    """Whether the phrase's normalised words stand in a row among the text's ("n2" is not in "nitrogen")."""
    t, p = words(text), words(phrase)
    return bool(p) and any(t[i:i + len(p)] == p for i in range(len(t) - len(p) + 1))


def abstains(answer: str) -> bool:
    """NO_ANSWER, or the decoder's "No answer", whatever the case and punctuation."""
    return words(answer) == ["no", "answer"]


def is_correct(answer: str, gold: str | None, threshold: float) -> bool | None:
    """The gold phrase contained, or token F1 >= threshold with every number of the gold in the answer (F1 alone
    gives 0.5 to "45 lbf.ft" for "30 lbf.ft"); an abstention never is. None without a gold answer."""
    if gold is None:
        return None
    if abstains(answer):
        return False
    numbers = {w for w in words(gold) if any(ch.isdigit() for ch in w)}
    return contains(answer, gold) or (f1(answer, gold) >= threshold and numbers <= set(words(answer)))


def quoted_share(answer: str, chunk: str) -> float:
    """The share of the answer's quoted characters that stand verbatim in the chunk (0 without quotes)."""
    spans = extract_spans(answer)
    total = sum(map(len, spans))
    return sum(len(s) for s in spans if s in chunk) / total if total else 0.0


def label(r: dict) -> str | None:
    """The facet's evidence label: the first of LABELS whose condition holds, from the record's gold, chunks,
    answers, correct and faith alone; None without a gold answer. A chunk is relevant when it contains the gold.

    failure: no retrieved chunk is relevant, or Strict RAG abstained;
    misalignment: Strict is wrong and either no chunk supports its answer (faith <= 0 with each) or no mode is right;
    overridden: Strict is wrong, Soft RAG or LLM-only is right;
    helpful: Strict is right, LLM-only wrong;
    robust: Strict and LLM-only are right (whatever Soft says).
    """
    if r["gold"] is None:
        return None
    strict, soft, llm_only = (r["correct"][m] for m in MODES)
    if not any(contains(c["text"], r["gold"]) for c in r["chunks"]) or abstains(r["answers"]["strict"]):
        return "failure"
    if not strict and (max(r["faith"]["strict"], default=0.0) <= 0 or not (soft or llm_only)):
        return "misalignment"
    if not strict:
        return "overridden"
    return "robust" if llm_only else "helpful"


def u_ret(cosines: torch.Tensor) -> float | None:
    """Retrieval uncertainty: the best chunk's cosine minus the second best's (None with one chunk).
    Small: the facet's evidence is not told apart from its neighbours."""
    if len(cosines) < 2:
        return None
    top = cosines.topk(2).values
    return round(float(top[0] - top[1]), 6)


def retrieve(index: Index, facet: str, k: int) -> tuple[list[dict], float | None]:
    """The facet's top k chunks by cosine, best first, and its U_ret."""
    cosines = index.dense_scores(facet)
    top = cosines.topk(min(k, len(cosines)))
    chunks = [{"file": c.file, "page": c.page, "page_label": c.page_label, "line": c.line, "text": c.text,
               "score": round(float(s), 6)}
              for s, c in zip(top.values, (index.chunks[i] for i in top.indices.tolist()))]
    return chunks, u_ret(cosines)


def evidence(chunks: list[dict]) -> str:
    """The chunks in reading order: facets that retrieved the same chunks get the same prompt opening."""
    ordered = sorted(chunks, key=lambda c: (c["file"], c["page"] or 0, c["line"]))
    return "\n\n".join(f"Evidence {i + 1}:\n{c['text'].strip()}" for i, c in enumerate(ordered))


def mode_prompt(mode: str, facet: str, chunks: list[dict]) -> str:
    """The user message of a mode: Strict and Soft show the chunks, LLM-only the question alone."""
    return PROMPTS[mode].format(evidence=evidence(chunks), question=facet.strip())


def parse_facets(text: str) -> list[str]:
    """The items of a numbered list ("1. ...", "2) ...")."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*\d+\s*[.)]\s*(\S.*)$", text, re.M)]


class Tracer:
    """The model (or with server, a serving engine and the model's config), the index and the flags; trace() does
    one question."""

    def __init__(self, model, tok, index: Index, args, judge=None, server=None, cfg=None):
        self.model, self.tok, self.index, self.args, self.server = model, tok, index, args, server
        self.options = decode_options(args, DecodeOptions(batch_size=batch_size(args), no_answer=NO_ANSWER))
        if server is not None:
            self.options = with_model_defaults(self.options, cfg, served=True)
        self.judge = judge or ModelJudge(model, tok, server, getattr(args, "concurrency", 1))
        # what decides the answers, kept in each question record for a resumed --out to match (None: a served engine's)
        self.setting = {"model": args.model, "weights": engine(model, args)["weights"] if model is not None else None,
                        "decoding": decoding(self.options)}

    def decode(self, messages: list[str], contexts: list[list[str]], without_question: list[str] | None = None) -> list[str]:
        """The answer to each user message, its quotes drawn from contexts[i] (none when empty). What messages
        share at their start (a facet's evidence) is prefilled once (chyd.reuse_prefix; an engine's prefix cache).
        without_question[i]: messages[i] with its question left out, what quote search weighs spans against.
        A served answer whose quote is in no passage (an engine that ignored the grammar) is an error."""
        tok = self.tok

        def prompt(message: str) -> list[int]:
            return tok.encode(tok.apply_chat_template([{"role": "user", "content": message}]))

        prompts = [prompt(m) for m in messages]
        if self.server is None:
            contrasts = [prompt(m) for m in without_question] if without_question and self.options.quote_search else None
            done = dict(decode_stream(self.model, tok, prompts, contexts, self.options, contrasts))
        else:
            from server import ServerError, prompt_stream

            done = dict(prompt_stream(self.server, tok, prompts, contexts, self.options, self.args.concurrency))
            if bad := [q for r in done.values() for q in r.not_verbatim]:
                raise ServerError(f"{self.server.url}: {len(bad)} quote(s) that came back are in no passage (was the "
                                  f"server started with the guidance backend?): {bad[0]!r}")
        return [done[i].text.strip() for i in range(len(prompts))]

    def facets(self, ex: dict) -> tuple[list[dict], str]:
        """The question's facets [{question, answer}] and where they came from ("data" or "model")."""
        if ex.get("facets"):
            return [{"question": f["question"], "answer": f.get("answer")} for f in ex["facets"]], "data"
        listed = parse_facets(self.decode([DECOMPOSE_PROMPT.format(question=ex["question"].strip())], [[]])[0])
        if not listed:
            raise DataError(f"question {ex['id']}: no facets in the data, and the model listed none")
        return [{"question": q, "answer": None} for q in listed], "model"

    def trace(self, ex: dict) -> list[dict]:
        """The facet records of one question, then its question record."""
        t0 = time.perf_counter()
        facets, source = self.facets(ex)
        found = [retrieve(self.index, f["question"], self.args.top_k) for f in facets]
        answers = [{} for _ in facets]
        # decoded apart: a facet's Strict and Soft prompts open with the same evidence, LLM-only's with none
        for modes in (("strict", "soft"), ("llm_only",)):
            rows = [(i, m) for i in range(len(facets)) for m in modes]
            texts = self.decode([mode_prompt(m, facets[i]["question"], found[i][0]) for i, m in rows],
                                [[c["text"] for c in found[i][0]] if m != "llm_only" else [] for i, m in rows],
                                [mode_prompt(m, "", found[i][0]) for i, m in rows])
            for (i, m), text in zip(rows, texts):
                answers[i][m] = text
        faith = self.faith(facets, found, answers)
        records = []
        for i, (f, (chunks, uncertainty)) in enumerate(zip(facets, found)):
            a = answers[i]
            r = {"id": ex["id"], "level": "facet", "facet": f["question"], "gold": f["answer"], "chunks": chunks,
                 "u_ret": uncertainty, "answers": a,
                 "correct": {m: is_correct(a[m], f["answer"], self.args.f1_threshold) for m in MODES},
                 "faith": faith[i],
                 "quoted_share": {m: [round(quoted_share(a[m], c["text"]), 4) for c in chunks] for m in ("strict", "soft")}}
            r["label"] = label(r)
            records.append(r)
        merged = self.aggregate(ex["question"], facets, found, answers)
        records.append({"id": ex["id"], "level": "question", "question": ex["question"], "gold": ex.get("answer"),
                        "facets_from": source, "answers": merged, **self.setting,
                        "f1": {m: round(f1(merged[m], ex["answer"]), 4) if ex.get("answer") else None for m in MODES},
                        "seconds": round(time.perf_counter() - t0, 2)})
        return records

    def faith(self, facets: list[dict], found: list, answers: list[dict]) -> list[dict]:
        """faith[i][mode]: one value in [-1, 1] a chunk of facet i; 0 for an abstention, which claims nothing."""
        asks = [(i, m, j) for i in range(len(facets)) for m in MODES for j in range(len(found[i][0]))
                if not abstains(answers[i][m]) and answers[i][m]]
        values = self.judge([(found[i][0][j]["text"], facets[i]["question"], answers[i][m]) for i, m, j in asks])
        out = [{m: [0.0] * len(found[i][0]) for m in MODES} for i in range(len(facets))]
        for (i, m, j), v in zip(asks, values):
            out[i][m][j] = round(v, 4)
        return out

    def aggregate(self, question: str, facets: list[dict], found: list, answers: list[dict]) -> dict:
        """Each mode's facet answers merged into one answer; Strict and Soft quote from their facets' chunks."""
        pooled = list(dict.fromkeys(c["text"] for chunks, _ in found for c in chunks))

        def message(q: str, m: str) -> str:
            return AGGREGATE_PROMPT.format(question=q, facets="\n".join(
                f"{i + 1}. {f['question']} {a[m]}" for i, (f, a) in enumerate(zip(facets, answers))))

        return dict(zip(MODES, self.decode([message(question.strip(), m) for m in MODES], [pooled, pooled, []],
                                           [message("", m) for m in MODES])))


def faith_of(scores) -> float:
    """P(yes) - P(no) from the scores (logits or log-probabilities) of the judge's three words, renormalised."""
    p = torch.softmax(torch.as_tensor(scores, dtype=torch.float32), -1)
    return float(p[0] - p[1])


class ModelJudge:
    """faith(a, c) = P(entail) - P(contradict), the answering model as the judge: one pass over JUDGE_PROMPT, the
    probabilities of its three answer words renormalised. Asks about one chunk share that chunk's keys and values.
    With server, the engine gives the three words' log-probabilities (server.token_logprobs), concurrency at once."""

    def __init__(self, model, tok, server=None, concurrency: int = 1):
        self.model, self.tok, self.server, self.concurrency = model, tok, server, concurrency
        self.word_ids = [tok.encode(w)[0] for w in JUDGE_WORDS]
        if len(set(self.word_ids)) < 3:
            raise CliError(f"the model's tokenizer starts {', '.join(JUDGE_WORDS)} with the same token: it cannot judge; give --nli")

    def prompt(self, chunk: str, facet: str, answer: str) -> list[int]:
        text = JUDGE_PROMPT.format(chunk=chunk.strip(), facet=facet.strip(), answer=answer.strip())
        return self.tok.encode(self.tok.apply_chat_template([{"role": "user", "content": text}]))

    @torch.inference_mode()
    def __call__(self, asks: list[tuple[str, str, str]]) -> list[float]:
        if self.server is not None:
            from concurrent.futures import ThreadPoolExecutor

            from server import token_logprobs

            with ThreadPoolExecutor(self.concurrency) as pool:
                return list(pool.map(lambda ask: faith_of(token_logprobs(self.server, self.prompt(*ask), self.word_ids)), asks))
        out = [0.0] * len(asks)
        by_chunk: dict[str, list[int]] = {}
        for n, (chunk, _, _) in enumerate(asks):
            by_chunk.setdefault(chunk, []).append(n)
        for ns in by_chunk.values():  # one after another, so that the chunk's keys and values are kept
            for n in ns:
                prompt = self.prompt(*asks[n])
                ensure_cache(self.model, 1, len(prompt) + 1)
                out[n] = faith_of(self.model.logits(prefill(self.model, prompt)[0])[self.word_ids])
        return out


class NLIJudge:
    """faith(a, c) = P(entailment) - P(contradiction) from a local Hugging Face sequence-classification folder
    (RoBERTa-large-MNLI in the paper): premise the chunk, hypothesis the facet and its answer, brackets removed."""

    def __init__(self, path: str):
        if not Path(path).is_dir():
            raise CliError(f"--nli {path}: not a folder")
        try:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError:
            raise CliError("--nli needs transformers: pip install transformers") from None
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise CliError(f"--nli {path}: not a sequence-classification model ({str(e).splitlines()[0]})") from None
        names = {v.lower(): int(k) for k, v in self.model.config.id2label.items()}
        find = lambda stem: next((i for name, i in names.items() if name.startswith(stem)), None)
        self.entail, self.contradict = find("entail"), find("contradict")
        if self.entail is None or self.contradict is None:
            raise CliError(f"--nli {path}: its labels {sorted(names)} name no entailment and contradiction")

    @torch.inference_mode()
    def __call__(self, asks: list[tuple[str, str, str]]) -> list[float]:
        out = []
        for s in range(0, len(asks), 16):
            part = asks[s:s + 16]
            enc = self.tokenizer([c for c, _, _ in part],
                                 [f"{f.strip()} {a.replace('[', '').replace(']', '').strip()}" for _, f, a in part],
                                 return_tensors="pt", padding=True, truncation=True)
            p = torch.softmax(self.model(**enc).logits.float(), -1)
            out += (p[:, self.entail] - p[:, self.contradict]).tolist()
        return out


def read_data(path: str) -> list[dict]:
    """The questions: id, question, answer, and optional facets [{question, answer}]."""
    data = read_jsonl(path, {"id": str, "question": str, "answer": str})
    for n, ex in enumerate(data, 1):
        facets = ex.get("facets")
        if facets is not None and not (isinstance(facets, list) and all(
                isinstance(f, dict) and isinstance(f.get("question"), str) and f["question"].strip()
                and isinstance(f.get("answer"), (str, type(None))) for f in facets)):
            raise DataError(f"{path}: question {ex['id']}: 'facets' must be a list of {{question, answer}}")
    return data


def read_done(path: str) -> dict[str, list[dict]]:
    """The records of each question that --out already finished (its question record written)."""
    records = records_to_resume(path, {"id": str, "level": str}, "a trace")
    finished = {r["id"] for r in records if r["level"] == "question"}
    done: dict[str, list[dict]] = {}
    for r in records:
        if r["id"] in finished:
            done.setdefault(r["id"], []).append(r)
    return done


def tables(records: list[dict]) -> str:
    """The taxonomy's distribution over facets, and each mode's facet accuracy and question F1."""
    facets = [r for r in records if r["level"] == "facet"]
    questions = [r for r in records if r["level"] == "question"]
    labelled = [r for r in facets if r["label"] is not None]
    lines = [f"{'label':<14}{'facets':>7}{'share':>8}{'mean U_ret':>12}"]
    for name in LABELS:
        u = [r["u_ret"] for r in labelled if r["label"] == name and r["u_ret"] is not None]
        n = sum(r["label"] == name for r in labelled)
        lines.append(f"{name:<14}{n:>7}{100 * n / len(labelled) if labelled else 0:>7.1f}%"
                     + (f"{sum(u) / len(u):>12.3f}" if u else f"{'-':>12}"))
    lines.append(f"{'(no gold)':<14}{len(facets) - len(labelled):>7}")
    lines += ["", f"{'mode':<10}{'question F1':>12}{'facets right':>14}{'quoted':>8}"]
    for m in MODES:
        scores = [q["f1"][m] for q in questions if q["f1"][m] is not None]
        right = [r["correct"][m] for r in facets if r["correct"][m] is not None]
        quoting = [bool(extract_spans(r["answers"][m])) for r in facets]
        lines.append(f"{m:<10}{sum(scores) / len(scores) if scores else 0:>12.3f}"
                     f"{sum(right) / len(right) if right else 0:>14.3f}{sum(quoting) / len(quoting) if quoting else 0:>8.3f}")
    return "\n".join(lines)


def highlight(answer: str) -> str:
    return re.sub(r"\[([^\[\]]*)\]", r"<mark>[\1]</mark>", html.escape(answer))


def column(chunk: dict) -> tuple:
    """A chunk as a heat map's column: (file, page, page label, line, text); traces written before labels have none."""
    return chunk["file"], chunk["page"], chunk.get("page_label"), chunk["line"], chunk["text"]


def heat_map(facets: list[dict]) -> tuple[str, list[tuple]]:
    """The facet x chunk faith matrix of one question as inline SVG, a panel a mode stacked one under the other,
    at most FIGURE_WIDTH wide, and its columns. A cell is grey where the chunk was not retrieved for the facet;
    "q" gives the share of the answer's quotes found verbatim in the chunk."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(dict.fromkeys(column(c) for r in facets for c in r["chunks"]))
    fig, axes = plt.subplots(3, 1, figsize=(min(FIGURE_WIDTH, 1.2 + 0.8 * len(columns)), 3 * (0.7 + 0.4 * len(facets))),
                             squeeze=False, layout="constrained")
    for ax, m in zip(axes[:, 0], MODES):
        grid = torch.full((len(facets), len(columns)), math.nan)
        for i, r in enumerate(facets):
            for j, c in enumerate(r["chunks"]):
                col = columns.index(column(c))
                grid[i, col] = r["faith"][m][j]
                note = f"{r['faith'][m][j]:+.2f}"
                if m in r["quoted_share"] and r["quoted_share"][m][j]:
                    note += f"\nq {r['quoted_share'][m][j]:.0%}"
                ax.text(col, i, note, ha="center", va="center", fontsize=7)
        ax.imshow(grid.numpy(), cmap=plt.get_cmap("RdYlGn").with_extremes(bad="#dddddd"), vmin=-1, vmax=1, aspect="auto")
        ax.set_title(m, fontsize=9)
        ax.set_xticks(range(len(columns)), [f"C{j + 1}" for j in range(len(columns))], fontsize=7)
        ax.set_yticks(range(len(facets)), [f"F{i + 1}" for i in range(len(facets))], fontsize=7)
    buf = io.StringIO()
    plt.rcParams["svg.fonttype"] = "none"
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):].replace("<svg", '<svg style="max-width:100%;height:auto"', 1), columns


def no_signal(facets: list[dict], judge: str) -> str | None:
    """The sentence that says a question's heat map means nothing, when it does not: every faith value on one side
    of 0, or a judge that says "no" to everything whatever it reads."""
    values = [v for r in facets for m in MODES for v in r["faith"][m]]
    if values and (all(v <= 0 for v in values) or all(v > 0 for v in values)):
        why = f"every faith value is {'<= 0' if values[0] <= 0 else '> 0'}"
    elif SILENT_JUDGE in ALIASES.get(judge, judge).lower():
        why = "SmolLM2-135M says \"no\" to nearly every pair, whatever the chunk says (--nli gives another judge)"
    else:
        return None
    return f"The judge gave no signal: {why}; the colours say nothing here."


def page_name(page: int | None, label: str | None) -> str:
    """", page 4", or ", p. iv (sheet 2)" where the printed label differs from the sheet, as chyd.py's source lines."""
    if label not in (None, str(page)):
        return f", p. {label} (sheet {page})"
    return "" if page is None else f", page {page}"


def write_report(records: list[dict], path: str, judge: str) -> None:
    """One self-contained HTML page: per question its facets, the three answers with quotes marked, the heat map,
    and a sentence where the judge (--nli, else --model) gave the map no signal."""
    by_id: dict[str, list[dict]] = {}
    for r in records:
        by_id.setdefault(r["id"], []).append(r)
    parts = ["<!doctype html><meta charset='utf-8'><title>chyd trace</title><style>body{font:14px sans-serif;"
             "max-width:1100px;margin:auto}mark{background:#c8f0c8}td,th{border:1px solid #ccc;padding:4px;"
             "vertical-align:top}table{border-collapse:collapse}small{color:#666}.nosignal{color:#a00}</style>",
             "<h1>Facet-level trace</h1><pre>" + html.escape(tables(records)) + "</pre>"]
    for qid, rs in by_id.items():
        facets = [r for r in rs if r["level"] == "facet"]
        q = next(r for r in rs if r["level"] == "question")
        svg, columns = heat_map(facets)
        parts.append(f"<h2>{html.escape(qid)}: {html.escape(q['question'])}</h2><p>gold: {html.escape(q['gold'] or '')}</p>")
        parts.append("<table><tr><th>mode</th><th>answer</th><th>F1</th></tr>" + "".join(
            f"<tr><td>{m}</td><td>{highlight(q['answers'][m])}</td><td>{q['f1'][m]}</td></tr>" for m in MODES) + "</table>")
        parts.append("<table><tr><th></th><th>facet</th><th>gold</th><th>label</th><th>U_ret</th>"
                     + "".join(f"<th>{m}</th>" for m in MODES) + "</tr>" + "".join(
            f"<tr><td>F{i + 1}</td><td>{html.escape(r['facet'])}</td><td>{html.escape(r['gold'] or '')}</td>"
            f"<td>{r['label']}</td><td>{r['u_ret']}</td>" + "".join(
                f"<td>{highlight(r['answers'][m])} <small>{'right' if r['correct'][m] else 'wrong' if r['correct'][m] is not None else ''}</small></td>"
                for m in MODES) + "</tr>" for i, r in enumerate(facets)) + "</table>")
        if why := no_signal(facets, judge):
            parts.append(f"<p class='nosignal'>{html.escape(why)}</p>")
        parts.append(svg)
        parts.append("<p><small>" + "<br>".join(
            f"C{j + 1}: {html.escape(f + page_name(p, label))}, line {line}: {html.escape(t[:120])}..."
            for j, (f, p, label, line, t) in enumerate(columns)) + "</small></p>")
    Path(path).write_text("\n".join(parts), encoding="utf-8")


def build_parser() -> Parser:
    p = Parser(prog="trace.py", description="Facet-level tracing of how answers use their evidence.")
    p.add_argument("--data", required=True, help="JSONL: id, question, answer, optional facets [{question, answer}]")
    p.add_argument("--docs", action="append", required=True, metavar="PATH", help="a file or folder to retrieve from (repeatable)")
    p.add_argument("--out", default="trace.jsonl", help="one JSON object a facet and a question; resumed, never overwritten")
    p.add_argument("--report", metavar="HTML", help="write a self-contained HTML report")
    p.add_argument("--nli", metavar="PATH", help="a local Hugging Face sequence-classification folder to score "
                                                  "faithfulness (default: the answering model judges)")
    p.add_argument("--f1-threshold", type=float, default=0.5, help="a facet answer is right at this token F1 or above")
    p.add_argument("--limit", type=int, help="trace the first N questions")
    add_batch_args(p)
    add_retrieval_args(p, retriever=False)
    add_model_args(p)
    add_server_args(p)
    add_decoding_args(p, DecodeOptions())  # its own prompts: no --prompt
    return p


def command(argv) -> int:
    args = build_parser().parse_args(argv)
    check_retrieval_args(args)
    check_server_args(args)
    check_output_file("--out", args.out)
    check_output_file("--report", args.report)
    check_at_least_one(args, "top_k", "limit")
    if not 0 < args.f1_threshold <= 1:
        raise CliError(f"--f1-threshold must be in (0, 1], got {args.f1_threshold}")
    decode_options(args, DecodeOptions(batch_size=batch_size(args)))  # its flags checked before anything is loaded
    data = read_data(args.data)[:args.limit]
    if not data:
        raise DataError(f"{args.data} has no questions")
    docs = read_documents(args.docs)
    done = read_done(args.out)
    todo = [ex for ex in data if ex["id"] not in done]
    if todo:
        judge = NLIJudge(args.nli) if args.nli else None
        index = Index(docs, args.chunk_tokens, args.chunk_overlap)
        if args.server:
            from server import open_served

            server, tok, cfg = open_served(args.server, args.model, args.served_model)
            tracer = Tracer(None, tok, index, args, judge, server, cfg)
        else:
            tracer = Tracer(*load_model(args), index, args, judge)
        traced = [r for rs in done.values() for r in rs if r["level"] == "question"]
        if other := differing(traced, tracer.setting):
            raise CliError(f"--out {args.out} holds traces of another setting ({', '.join(f'{k}={v!r}' for k, v in other.items())}):"
                           " give another --out")
        for n, ex in enumerate(todo, 1):
            done[ex["id"]] = tracer.trace(ex)
            with open(args.out, "a", encoding="utf-8") as out:  # a question's records together, appended
                out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done[ex["id"]]))
            print(f"\rtrace {n}/{len(todo)}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    say_read_back("trace.py", len(data) - len(todo), len(data), args.out, "questions' traces")
    records = [r for ex in data for r in done[ex["id"]]]
    print(tables(records))
    if args.report:
        write_report(records, args.report, args.nli or args.model)
        print(f"report: {args.report}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_cli("trace.py", command, argv)


if __name__ == "__main__":
    sys.exit(main())

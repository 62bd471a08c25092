import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trace as tracing  # noqa: E402  (ours, not the standard library's)
from constraint import extract_spans  # noqa: E402
from trace import (LABELS, MODES, ModelJudge, NLIJudge, contains, is_correct, label, main, mode_prompt,  # noqa: E402
                   parse_facets, quoted_share, u_ret)

DOCS = ["--docs", str(ROOT / "data" / "manual.txt"), "--docs", str(ROOT / "data" / "leaflet.txt")]
SAMPLE = ROOT / "data" / "facets_sample.jsonl"
FACET_KEYS = {"id", "level", "facet", "gold", "chunks", "u_ret", "answers", "correct", "faith", "quoted_share", "label"}


def test_is_ours():
    assert Path(tracing.__file__).resolve() == ROOT / "trace.py"


def record(strict, soft, llm_only, relevant=True, abstain=False, faith=0.5, gold="185 psi"):
    """A facet record made by hand: which modes are right, whether a chunk holds the gold, Strict's faith."""
    text = "The nominal pressure is 185 psi." if relevant else "Torque the axle nut to 45 lbf.ft."
    return {"gold": gold, "chunks": [{"file": "m.txt", "page": None, "line": 1, "text": text, "score": 0.8},
                                     {"file": "m.txt", "page": None, "line": 3, "text": "Inflate with nitrogen.", "score": 0.5}],
            "answers": {"strict": "NO_ANSWER" if abstain else "It is [185 psi].", "soft": "185 psi", "llm_only": "200 psi"},
            "correct": {"strict": strict, "soft": soft, "llm_only": llm_only},
            "faith": {"strict": [faith, -0.9], "soft": [0.1, 0.0], "llm_only": [0.0, 0.0]}}


@pytest.mark.parametrize("case,expected", [
    (record(True, True, True, relevant=False), "failure"),  # no relevant chunk: failure before robust
    (record(False, False, False, relevant=False, faith=-0.5), "failure"),  # ... and before misalignment
    (record(False, True, True, abstain=True), "failure"),  # Strict abstained: failure before overridden
    (record(False, True, True, faith=-0.2), "misalignment"),  # unsupported: misalignment before overridden
    (record(False, True, False, faith=0.0), "misalignment"),  # faith 0 supports nothing
    (record(False, False, False, faith=0.7), "misalignment"),  # supported yet wrong, and no mode right
    (record(False, True, False, faith=0.7), "overridden"),
    (record(False, False, True, faith=0.7), "overridden"),
    (record(True, True, False), "helpful"),
    (record(True, False, False, faith=-0.4), "helpful"),  # a right Strict answer needs no support to be helpful
    (record(True, True, True), "robust"),
    (record(True, False, True), "robust"),  # Soft's answer does not move robust
    (record(None, None, None, gold=None), None),
])
def test_taxonomy_by_hand(case, expected):
    before = json.dumps(case)
    assert label(case) == expected
    assert json.dumps(case) == before and label(json.loads(before)) == expected  # pure: the record alone decides


def test_correctness_rule():
    assert is_correct("[185 psi]", "185 psi", 0.5) and is_correct("The tyres take 185 psi of dry nitrogen", "185 psi", 0.5)
    assert not is_correct("NO_ANSWER", "185 psi", 0.5) and not is_correct("No answer.", "no answer", 0.5)
    assert is_correct("pressure 185", "185 psi", 0.5) and not is_correct("pressure 185", "185 psi", 0.8)  # F1 2/3
    assert not is_correct("[45 lbf.ft]", "30 lbf.ft", 0.5) and is_correct("[30 lbf.ft.]", "30 lbf.ft", 0.5)  # numbers count
    assert is_correct("anything", None, 0.5) is None
    assert not contains("Inflate with dry nitrogen", "N2") and contains("Inflate with dry nitrogen.", "DRY nitrogen")
    assert not contains("nitrogen", "n")  # words, not characters


def test_quoted_share_u_ret_and_facet_lists():
    assert quoted_share("It is [185 psi] with [dry nitrogen].", "Use dry nitrogen.") == pytest.approx(12 / 19)
    assert quoted_share("It is 185 psi.", "185 psi") == 0.0
    assert u_ret(torch.tensor([0.2, 0.9, 0.5])) == pytest.approx(0.4)
    assert u_ret(torch.tensor([0.3])) is None
    assert parse_facets("Sub-questions:\n1. What gas?\n2) What pressure?\n  3.  Why?\nThat is all.") == [
        "What gas?", "What pressure?", "Why?"]
    assert parse_facets("What gas? What pressure?") == []


def test_the_three_prompts_show_evidence_as_stated():
    chunks = [{"file": "b.txt", "page": None, "line": 1, "text": "Second file text.", "score": 0.9},
              {"file": "a.txt", "page": None, "line": 7, "text": "Inflate with dry nitrogen.", "score": 0.4}]
    strict, soft, llm_only = (mode_prompt(m, "What gas?", chunks) for m in MODES)
    for p in (strict, soft):
        assert "Question: What gas?" in p and p.index("Inflate with dry nitrogen.") < p.index("Second file text.")
    assert "Use ONLY the evidence" in strict and "respond exactly with NO_ANSWER" in strict and "general knowledge" not in strict
    assert "general knowledge" in soft and "NO_ANSWER" not in soft
    assert "Question: What gas?" in llm_only and "nitrogen" not in llm_only and "evidence" not in llm_only.lower()


def test_model_judge_shares_a_chunk_and_scores_each_ask_as_alone(tiny_folder):
    from checkpoints import load

    model, tok = load(str(tiny_folder))
    judge = ModelJudge(model, tok)
    chunk = (ROOT / "data" / "manual.txt").read_text()[:400]
    asks = [(chunk, "What gas?", "dry nitrogen"), (chunk, "What pressure?", "It is [185 psi]."),
            ("Torque the axle nut.", "What torque?", "45"), (chunk, "Why?", "no reason at all")]
    together = judge(asks)
    for ask, value in zip(asks, together):
        ids = judge.prompt(*ask)
        model.setup_cache(1, len(ids) + 8)
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))[0, -1, judge.word_ids].float()
        p = torch.softmax(logits, -1)
        assert value == pytest.approx(float(p[0] - p[1]), abs=1e-4) and -1 <= value <= 1


def nli_folder(tmp_path, toy_hf_tokenizer, labels):
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=600, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                     num_labels=3, id2label=dict(enumerate(labels)), label2id={l: i for i, l in enumerate(labels)})
    BertForSequenceClassification(cfg).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=toy_hf_tokenizer, pad_token="<|endoftext|>").save_pretrained(tmp_path)
    return tmp_path


def test_nli_judge_is_entailment_minus_contradiction(tmp_path, toy_hf_tokenizer):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = nli_folder(tmp_path, toy_hf_tokenizer, ["CONTRADICTION", "NEUTRAL", "ENTAILMENT"])
    asks = [("Inflate with dry nitrogen.", "What gas?", "[dry nitrogen]"), ("Torque to 45.", "What torque?", "45 lbf.ft")]
    values = NLIJudge(str(folder))(asks)
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    for (chunk, facet, answer), value in zip(asks, values):
        with torch.no_grad():
            p = torch.softmax(model(**tokenizer(chunk, f"{facet} {answer.strip('[]')}", return_tensors="pt")).logits, -1)[0]
        assert value == pytest.approx(float(p[2] - p[0]), abs=1e-5)
    with pytest.raises(Exception, match="name no entailment"):
        NLIJudge(str(nli_folder(tmp_path / "other", toy_hf_tokenizer, ["A", "B", "C"])))


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_end_to_end_on_a_toy_model_writes_every_field_and_resumes(tmp_path, tiny_folder, capsys, monkeypatch):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "q.jsonl"
    data.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:3]))
    out, report = tmp_path / "trace.jsonl", tmp_path / "report.html"
    args = ("--data", data, *DOCS, "--out", out, "--model", tiny_folder, "--greedy", "--max-new-tokens", "12",
            "--top-k", "2", "--report", report)
    code, stdout, stderr = run(capsys, *args)
    assert code == 0, stderr
    records = [json.loads(l) for l in out.read_text().splitlines()]
    facets = [r for r in records if r["level"] == "facet"]
    questions = [r for r in records if r["level"] == "question"]
    assert [q["id"] for q in questions] == ["f01", "f02", "f03"] and len(facets) == 6
    for r in facets:
        assert set(r) == FACET_KEYS
        assert len(r["chunks"]) == 2 and all(set(c) == {"file", "page", "page_label", "line", "text", "score"} for c in r["chunks"])
        assert r["chunks"][0]["score"] >= r["chunks"][1]["score"]
        assert r["u_ret"] == pytest.approx(r["chunks"][0]["score"] - r["chunks"][1]["score"], abs=1e-5)
        assert set(r["answers"]) == set(r["correct"]) == set(r["faith"]) == set(MODES)
        assert all(len(r["faith"][m]) == 2 and all(-1 <= v <= 1 for v in r["faith"][m]) for m in MODES)
        assert set(r["quoted_share"]) == {"strict", "soft"} and all(len(v) == 2 for v in r["quoted_share"].values())
        assert r["correct"] == {m: is_correct(r["answers"][m], r["gold"], 0.5) for m in MODES}
        assert r["label"] in LABELS and r["label"] == label(r)
        for m in ("strict", "soft"):  # CHyD: every quote stands in a chunk of the facet
            assert all(any(s in c["text"] for c in r["chunks"]) for s in extract_spans(r["answers"][m]))
        assert "[" not in r["answers"]["llm_only"]  # no evidence, no quote
    for q in questions:
        assert set(q["answers"]) == set(q["f1"]) == set(MODES) and q["facets_from"] == "data"
    assert "misalignment" in stdout and "question F1" in stdout
    page = report.read_text()
    assert page.count("<svg") == 3 and all(f">{i}: " in page for i in ("f01", "f02", "f03"))
    assert page.count("<mark>") == sum(len(extract_spans(r["answers"][m])) for r in records for m in MODES)

    written = out.read_bytes()
    assert "read back" not in stderr
    code, again, err = run(capsys, *args)
    assert (code, again) == (0, stdout) and out.read_bytes() == written  # resumed: nothing redone, and said so
    assert f"trace.py: 3 of 3 questions' traces read back from {out}, not made again (another --out makes them)" in err
    lines = written.decode().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]))  # the last question's record lost: that question is traced again
    code, again, err = run(capsys, *args)
    assert code == 0 and again == stdout and f"trace.py: 2 of 3 questions' traces read back from {out}" in err
    redone = out.read_text().splitlines(keepends=True)
    assert redone[:len(lines) - 1] == lines[:-1] and len(redone) == len(lines) - 1 + 3
    # traced with other options, where there is a question to add: refused, the file as it was
    assert all(q["model"] == str(tiny_folder) and q["weights"] and q["decoding"]["speculate"] is True for q in questions)
    out.write_text("".join(lines[:-1]))
    code, _, err = run(capsys, *args, "--no-speculate")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"trace.py: error: --out {out} holds traces of another setting (decoding={questions[0]['decoding']!r}): "
        "give another --out"), err
    assert out.read_text() == "".join(lines[:-1])


def test_quote_search_weighs_spans_against_each_prompt_without_its_question(tmp_path, tiny_folder, capsys, monkeypatch):
    import chyd

    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "q.jsonl"
    data.write_text(SAMPLE.read_text().splitlines(keepends=True)[0])
    ex = json.loads(data.read_text())
    seen, search = [], chyd.quote_candidates

    def recording(model, answer, row, width, contrast=None):
        seen.append((answer.tok.decode(answer.prompt), None if contrast is None else answer.tok.decode(contrast)))
        return search(model, answer, row, width, contrast)

    monkeypatch.setattr(chyd, "quote_candidates", recording)
    code, _, stderr = run(capsys, "--data", data, *DOCS, "--out", tmp_path / "t.jsonl", "--model", tiny_folder, "--greedy",
                          "--quote-first", "--quote-search", "2", "--max-new-tokens", "12", "--top-k", "2")
    assert code == 0, stderr
    questions = [ex["question"]] + [f["question"] for f in ex["facets"]]
    assert any(ex["question"] in p for p, _ in seen)  # the merged answer's quotes were searched
    assert all(any(f["question"] in p for p, _ in seen) for f in ex["facets"])  # and each facet's
    for prompt, contrast in seen:  # the same message, its question (the facet's, or the merged answer's) left out
        assert contrast is not None and any(prompt.replace(q.strip(), "", 1) == contrast for q in questions if q in prompt)


@pytest.mark.parametrize("args,message", [
    (["--data", SAMPLE, "--out", "{tmp}/t.jsonl"], "the following arguments are required: --docs"),
    (["--data", "{tmp}/missing.jsonl", *DOCS, "--out", "{tmp}/t.jsonl"], "missing.jsonl does not exist"),
    (["--data", "{tmp}/bad.jsonl", *DOCS, "--out", "{tmp}/t.jsonl"], "bad.jsonl:1: missing field 'question'"),
    (["--data", "{tmp}/facets.jsonl", *DOCS, "--out", "{tmp}/t.jsonl"], "'facets' must be a list of {question, answer}"),
    (["--data", SAMPLE, "--docs", "{tmp}/nowhere", "--out", "{tmp}/t.jsonl"], "nowhere"),
    (["--data", SAMPLE, *DOCS, "--out", "{tmp}/t.jsonl", "--f1-threshold", "0"], "--f1-threshold must be in (0, 1]"),
    (["--data", SAMPLE, *DOCS, "--out", "{tmp}/t.jsonl", "--top-k", "0"], "--top-k must be >= 1"),
    (["--data", SAMPLE, *DOCS, "--out", "{tmp}/t.jsonl", "--nli", "{tmp}/no-nli"], "--nli {tmp}/no-nli: not a folder"),
    (["--data", SAMPLE, *DOCS, "--out", "{tmp}/t.jsonl", "--report", "{tmp}"], "--report {tmp} is a folder"),
    (["--data", SAMPLE, *DOCS, "--out", "{tmp}/t.jsonl", "--report", "{tmp}/no/r.html"], "the folder {tmp}/no does not exist"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "answer": "x"}\n')
    (tmp_path / "facets.jsonl").write_text('{"id": "a", "question": "q?", "answer": "x", "facets": [{"answer": "x"}]}\n')
    code, _, err = run(capsys, *(str(a).replace("{tmp}", str(tmp_path)) for a in args))
    assert code == 2 and message.replace("{tmp}", str(tmp_path)) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.jsonl").exists()


def test_an_out_file_that_is_not_a_trace_is_refused_and_left_as_it_was(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "mine.jsonl"  # the dataset itself given as --out: appending would change the user's file
    mine.write_bytes(SAMPLE.read_bytes())
    code, _, err = run(capsys, "--data", str(mine), *DOCS, "--out", str(mine))
    assert code == 2 and f"--out {mine} is not a trace to resume" in err and len(err.strip().splitlines()) == 1
    assert mine.read_bytes() == SAMPLE.read_bytes()


def test_no_facets_from_the_model_is_one_line(tmp_path, tiny_folder, capsys, monkeypatch):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "q.jsonl"
    data.write_text('{"id": "x1", "question": "What gas and what pressure?", "answer": "dry nitrogen at 185 psi"}\n')
    # one token cannot hold "1. " and a sub-question: the model lists none
    code, _, err = run(capsys, "--data", data, *DOCS, "--out", tmp_path / "t.jsonl", "--model", tiny_folder,
                       "--max-new-tokens", "1")
    assert code == 2 and "question x1: no facets in the data, and the model listed none" in err
    assert len([line for line in err.strip().splitlines() if not line.startswith("chyd: weights")]) == 1  # beside the banner
    assert not (tmp_path / "t.jsonl").exists()


def test_sample_set_runs_end_to_end_on_smollm2(tmp_path, smollm2, capsys):
    out = tmp_path / "trace.jsonl"
    # the facets' labels and quotes, not quote search (its own test above, and test_chyd's): it doubles the time
    code, stdout, stderr = run(capsys, "--data", SAMPLE, *DOCS, "--out", out, "--greedy", "--max-new-tokens", "16",
                               "--quote-search", "0")
    assert code == 0, stderr
    records = [json.loads(l) for l in out.read_text().splitlines()]
    sample = [json.loads(l) for l in SAMPLE.read_text().splitlines()]
    facets = [r for r in records if r["level"] == "facet"]
    assert len(facets) == sum(len(ex["facets"]) for ex in sample) and len(records) == len(facets) + len(sample)
    assert all(r["label"] in LABELS for r in facets)
    for r in facets:
        for m in ("strict", "soft"):
            assert all(any(s in c["text"] for c in r["chunks"]) for s in extract_spans(r["answers"][m]))
        if not any(contains(c["text"], r["gold"]) for c in r["chunks"]):
            assert r["label"] == "failure"  # the facets that the documents cannot answer
    outside = [r for r in facets if not any(contains(c["text"], r["gold"]) for c in r["chunks"])]
    assert len(outside) >= 5
    shares = [float(line.split()[2].rstrip("%")) for line in stdout.splitlines()[1:6]]
    assert sum(shares) == pytest.approx(100, abs=0.2)


def traced_question(faith: list[list[float]], chunks_each: int = 5) -> list[dict]:
    """One question's records made by hand: a facet a row of faith values (each mode the same), each facet with its
    own chunks, from a PDF whose sheet 2 is printed "ii"."""
    facets = []
    for i, row in enumerate(faith):
        chunks = [{"file": "m.pdf", "page": 2, "page_label": "ii", "line": 1 + 10 * i + j,
                   "text": f"Chunk {i}.{j}: inflate the tyres.", "score": 0.5} for j in range(chunks_each)]
        r = {"id": "q1", "level": "facet", "facet": f"Facet {i}?", "gold": "185 psi", "chunks": chunks, "u_ret": 0.1,
             "answers": {m: "It is [185 psi]." for m in MODES}, "correct": {m: True for m in MODES},
             "faith": {m: row for m in MODES}, "quoted_share": {m: [1.0] * chunks_each for m in ("strict", "soft")}}
        r["label"] = label(r)
        facets.append(r)
    return facets + [{"id": "q1", "level": "question", "question": "What pressure?", "gold": "185 psi",
                      "facets_from": "data", "answers": {m: "[185 psi]" for m in MODES}, "f1": {m: 1.0 for m in MODES}}]


def svg_width_px(page: str) -> float:
    (width,) = re.findall(r'<svg style="max-width:100%;height:auto"[^>]* width="([\d.]+)pt"', page)
    return float(width) * 96 / 72  # a CSS pixel is 3/4 of a point


def test_the_three_heat_maps_fit_a_1280_px_page(tmp_path):
    # three facets of five chunks each: 15 columns, which side by side took 36 inches (3,456 px)
    tracing.write_report(traced_question([[0.5, -0.5, 0.1, 0.2, -0.3]] * 3), str(tmp_path / "r.html"), "some/nli-folder")
    page = (tmp_path / "r.html").read_text()
    assert page.count("<svg") == 1 and 600 < svg_width_px(page) <= 1280
    assert [m.group(1) for m in re.finditer(r">(strict|soft|llm_only)</text>", page)] == list(MODES)
    titles = [float(y) for y in re.findall(r'<text [^>]*y="([\d.]+)"[^>]*>(?:strict|soft|llm_only)<', page)]
    assert titles == sorted(titles) and len(set(titles)) == 3  # stacked: each panel under the one before
    assert "C15: m.pdf, p. ii (sheet 2), line 25" in page


@pytest.mark.parametrize("faith,judge,sentence", [
    ([[-0.5, -0.2, 0.0, -0.9, -0.1]], "some/nli-folder", "every faith value is &lt;= 0"),
    ([[0.5, 0.2, 0.3, 0.9, 0.1]], "some/nli-folder", "every faith value is &gt; 0"),
    ([[0.5, -0.2, 0.0, 0.9, -0.1]], "some/nli-folder", None),  # mixed: the colours mean something
    ([[0.5, -0.2, 0.0, 0.9, -0.1]], "smollm2", "SmolLM2-135M says"),
    ([[0.5, -0.2, 0.0, 0.9, -0.1]], "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M says"),
])
def test_a_judge_without_signal_is_said_beside_the_maps(tmp_path, faith, judge, sentence):
    tracing.write_report(traced_question(faith), str(tmp_path / "r.html"), judge)
    page = (tmp_path / "r.html").read_text()
    notes = re.findall(r"<p class='nosignal'>([^<]*)</p>\s*<svg", page)  # right above the maps
    if sentence is None:
        assert notes == [] and "no signal" not in page
    else:
        assert len(notes) == 1 and notes[0].startswith("The judge gave no signal: ") and sentence in notes[0]

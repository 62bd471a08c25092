"""eval.py: each metric against values worked out by hand, EFA against brute force, and the runner end to end."""
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from conftest import ROOT
from eval import (answer_level_recall, binary_scores, degenerate, efa, efa_counts, exact_match, extract_spans, f1,
                  mcnemar_exact, normalize_answer, read_jsonl, rouge_l, score, wilcoxon_p)


def test_extract_spans_our_format_and_quotesum_numbers():
    assert extract_spans("It is [ 185 psi ] and [dry nitrogen].") == ["185 psi", "dry nitrogen"]
    assert extract_spans("No answer") == [] and extract_spans("") == []
    assert extract_spans("empty [] and blank [  ] and open [ not closed") == []
    assert extract_spans("[ 25 psi ]") == ["25 psi"]  # a leading number is text


def test_normalisation_em_and_f1_by_hand():
    assert normalize_answer("The  Pressure, is: 185 PSI!") == "pressure is 185 psi"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("Café — déjà vu") == "café — déjà vu"  # the em dash is not ASCII punctuation
    assert exact_match("the 185 psi.", "185 PSI") == 1.0 and exact_match("185", "185 psi") == 0.0
    assert f1("the cat sat", "cat sat down") == pytest.approx(0.8)  # P = 1, R = 2/3
    assert f1("cat cat", "cat") == pytest.approx(2 / 3)  # P = 1/2, R = 1
    assert f1("", "something") == 0.0 and f1("", "") == 1.0 and f1("the", "a") == 1.0
    assert f1("dry nitrogen", ["compressed air", "nitrogen"]) == pytest.approx(2 / 3)  # best of several golds
    assert exact_match("x", ["y", "X."]) == 1.0


def test_efa_counts_and_alr_by_hand():
    contexts = ["Inflate to 185 psi with dry nitrogen.", "Torque to 45 lbf.ft."]
    assert efa_counts(["185 psi", "45 lbf.ft", "150 psi"], contexts) == (3, 1)
    assert efa(["185 psi", "45 lbf.ft", "150 psi"], contexts) == pytest.approx(2 / 3)
    assert efa([], contexts) == 1.0
    assert efa(["185 psi with dry"], contexts) == 1.0 and efa(["185 PSI"], contexts) == 0.0
    assert answer_level_recall("Inflate to 185 psi", ["185 PSI."]) == 1.0
    assert answer_level_recall("Inflate to 18", ["185 psi"]) == 0.0
    assert answer_level_recall("", ["x"]) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abc é", max_size=12), min_size=1, max_size=3),
       st.lists(st.text(alphabet="abc é", min_size=1, max_size=4), max_size=8))
def test_efa_against_brute_force(contexts, spans):
    brute = [any(c[i:i + len(s)] == s for c in contexts for i in range(len(c) - len(s) + 1)) for s in spans]
    assert efa_counts(spans, contexts) == (len(spans), brute.count(False))


def test_answerability_rouge_and_significance_by_hand():
    s = binary_scores([True, True, False, False], [True, False, True, False])
    assert s == {"precision": 0.5, "recall": 0.5, "accuracy": 0.5, "f1": 0.5}
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)  # LCS a c d: P = R = 3/4
    assert rouge_l("[185 psi]", "185 psi") == pytest.approx(1.0)
    # textbook exact McNemar: 3 and 11 discordant pairs, p = 2 * P(X <= 3 | n = 14, 1/2) = 2 * 470 / 16384
    a = [True] * 3 + [False] * 11 + [True] * 5
    b = [False] * 3 + [True] * 11 + [True] * 5
    assert mcnemar_exact(a, b) == pytest.approx(940 / 16384)
    assert mcnemar_exact(a, a) == 1.0
    assert wilcoxon_p([0.1, 0.2], [0.1, 0.2]) == 1.0
    assert wilcoxon_p([0.0] * 10, [1.0] * 10) < 0.01


def test_score_table_figures():
    preds = [
        {"prediction": "It is [185 psi].", "answer": "[185 psi]", "answerable": True, "contexts": ["185 psi"]},
        {"prediction": "It is [150 psi].", "answer": "[185 psi]", "answerable": True, "contexts": ["185 psi"]},
        {"prediction": "No answer", "answer": "No answer", "answerable": False, "contexts": ["x"]},
        {"prediction": "[x]", "answer": "No answer", "answerable": False, "contexts": ["x"]},
    ]
    s = score(preds)
    # F1: 1 for the first, 1/2 for "150 psi" against "185 psi" (psi in common): mean 3/4
    assert s["n"] == 4 and s["em"] == 0.5 and s["f1"] == pytest.approx(0.75) and s["alr"] == 0.5
    assert (s["spans"], s["violations"], s["efa"]) == (3, 1, pytest.approx(2 / 3))
    assert s["answerable_recall"] == 1.0 and s["answerable_precision"] == pytest.approx(2 / 3)
    assert s["answerable_accuracy"] == 0.75
    assert s["degenerate"] == 1  # [x]
    # degenerate: what whole-word quotes may not close; a manual's term ([zR], [-y]) is evidence
    assert [degenerate(q) for q in ["1", ",", "12", "x", "zR", "-y", "C-b", "psi", "2004"]] == [True] * 4 + [False] * 5


def test_em_and_f1_are_taken_against_the_short_answers_as_in_the_papers_table():
    # a QuoteSum summary quotes more than the answer: one span that is a gold short answer is EM 1 (Table 4's
    # definition), while against the summary's quotes joined it is not, and only partly in F1
    row = {**{f"{k}{i}": "" for i in range(1, 9) for k in ("title", "source", "short_ans_")},
           "qid": "q", "unique_id": "u", "question": "What pressure and what gas?",
           "summary": "Use [ 1 150 psi ] of [ 2 dry nitrogen ].", "covered_short_answers": "[ 1 150 psi ]",
           "source1": "Inflate to 150 psi.", "short_ans_1": "150 psi", "source2": "Use dry nitrogen.", "short_ans_2": "nitrogen"}
    from eval import from_quotesum, example_scores
    ex = from_quotesum(row)
    assert ex["short_answers"] == ["150 psi", "nitrogen"]  # covered first, then each source's own, once
    one = example_scores(dict(ex, prediction="It is [150 psi]."))
    assert one["em"] == 1.0 and one["f1"] == 1.0
    assert one["f1_quotes"] == pytest.approx(2 / 3)  # P = 2/2, R = 2/4
    other = example_scores(dict(ex, prediction="[dry nitrogen]"))  # the best short answer: nitrogen, P = 1/2, R = 1
    assert other["em"] == 0.0 and other["f1"] == pytest.approx(2 / 3)
    # SQuAD's several gold answers: the best of them
    squad = {"answer": ["[45 lbf.ft]", "[45 lbf.ft, then to 30]"], "short_answers": ["45 lbf.ft", "45 lbf.ft, then to 30"],
             "answerable": True, "contexts": ["Torque to 45 lbf.ft, then to 30."]}
    s = example_scores(dict(squad, prediction="[45 lbf.ft, then to 30]"))
    assert s["em"] == 1.0 and s["f1"] == 1.0
    s = example_scores(dict(squad, prediction="[then to 30]"))
    assert s["em"] == 0.0 and s["f1"] == pytest.approx(2 * (3 / 3) * (3 / 5) / (1 + 3 / 5))  # "then to 30": P 1, R 3/5
    table = score([dict(ex, prediction="It is [150 psi]."), dict(ex, prediction="No answer")])
    assert table["em"] == 0.5 and table["f1_quotes"] == pytest.approx(1 / 3)
    assert table["semqa"] == pytest.approx(2 * table["rouge_l"] * (1 / 3) / (table["rouge_l"] + 1 / 3))


def eval_cli(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.mark.parametrize("line,message", [
    ("not json", "bad.jsonl:2: not JSON"),
    ('{"id": "a", "question": "q", "contexts": ["c"], "answerable": true}', "bad.jsonl:2: missing field 'answer'"),
    ('{"id": "a", "question": "q", "contexts": [], "answer": "x", "answerable": true}', "bad.jsonl:2: field 'contexts'"),
    ('{"id": "a", "question": "q", "contexts": [""], "answer": "x", "answerable": true}', "bad.jsonl:2: field 'contexts'"),
    ('{"id": "a", "question": 3, "contexts": ["c"], "answer": "x", "answerable": true}', "bad.jsonl:2: field 'question'"),
])
def test_bad_data_names_file_line_and_field(tmp_path, line, message):
    good = '{"id": "a", "question": "q", "contexts": ["c"], "answer": "x", "answerable": true}'
    (tmp_path / "bad.jsonl").write_text(good + "\n" + line + "\n")
    r = eval_cli("--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "p.jsonl"))
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.jsonl").exists()


def test_sample_set_is_well_formed():
    data = read_jsonl(str(ROOT / "data" / "sample_eval.jsonl"))
    assert len(data) >= 40 and len({d["id"] for d in data}) == len(data)
    assert sum(not d["answerable"] for d in data) >= len(data) / 4
    assert sum(len(d["contexts"]) > 1 for d in data) >= 10 and sum(len(d["contexts"]) == 1 for d in data) >= 10
    for d in data:
        spans = extract_spans(d["answer"])
        assert (d["answer"] == "No answer") == (not d["answerable"])
        assert not d["answerable"] or (spans and efa(spans, d["contexts"]) == 1.0)


def test_runner_end_to_end_resume_and_score(tmp_path, smollm2):
    out = tmp_path / "preds.jsonl"
    r = eval_cli("--data", "data/sample_eval.jsonl", "--method", "chyd", "--greedy", "--limit", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    preds = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(preds) == 3 and all(p["method"] == "chyd" for p in preds)
    assert "EFA                       1.000" in r.stdout
    again = eval_cli("--data", "data/sample_eval.jsonl", "--method", "chyd", "--greedy", "--limit", "3", "--out", str(out))
    assert again.returncode == 0 and again.stdout == r.stdout and len(out.read_text().splitlines()) == 3
    # the scores count answers of an earlier run, which a change to the code since did not make: said
    assert "read back" not in r.stderr
    assert f"eval.py: 3 of 3 answers read back from {out}, not made again (another --out makes them)" in again.stderr
    scored = eval_cli("--score", str(out))
    assert scored.returncode == 0 and scored.stdout == r.stdout
    compared = eval_cli("compare", str(out), str(out))
    assert compared.returncode == 0 and "McNemar" in compared.stdout and "Wilcoxon" in compared.stdout


def test_runner_lookup_keeps_predictions_in_fewer_passes(tmp_path, smollm2):
    # fp32: in bf16 a pass of several tokens rounds differently from one token at a time
    args = ("--data", "data/sample_eval.jsonl", "--method", "free", "--greedy", "--limit", "3", "--dtype", "float32")
    plain = eval_cli(*args, "--out", str(tmp_path / "plain.jsonl"))
    fast = eval_cli(*args, "--lookup", "--out", str(tmp_path / "fast.jsonl"))
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    plain, fast = ([json.loads(l) for l in (tmp_path / f).read_text().splitlines()] for f in ("plain.jsonl", "fast.jsonl"))
    assert [p["prediction"] for p in fast] == [p["prediction"] for p in plain]
    assert sum(p["forward_passes"] for p in fast) < sum(p["forward_passes"] for p in plain)


def test_runner_compile_keeps_the_predictions(tmp_path, tiny_folder):
    args = ("--data", "data/sample_eval.jsonl", "--model", str(tiny_folder), "--greedy", "--limit", "2",
            "--max-new-tokens", "16")
    eager = eval_cli(*args, "--out", str(tmp_path / "eager.jsonl"))
    compiled = eval_cli(*args, "--compile", "--out", str(tmp_path / "compiled.jsonl"), env=dict(os.environ, TORCH_LOGS="guards"))
    assert eager.returncode == 0 and compiled.returncode == 0, eager.stderr + compiled.stderr
    assert "[__guards]" in compiled.stderr  # dynamo compiled the step
    eager, compiled = ([json.loads(l) for l in (tmp_path / f).read_text().splitlines()] for f in ("eager.jsonl", "compiled.jsonl"))
    assert [p["tokens"] for p in compiled] == [p["tokens"] for p in eager] == [16, 16]
    assert [p["prediction"] for p in compiled] == [p["prediction"] for p in eager]


@pytest.mark.parametrize("setting", [("--distractors", "2"), ("--retrieve", "--top-k", "2")])
def test_runner_in_the_papers_retrieval_settings(tmp_path, smollm2_gguf_path, setting):
    cache = tmp_path / "cache"  # a fresh index cache, with the model of the real one
    cache.mkdir()
    (cache / smollm2_gguf_path.parent.name).symlink_to(smollm2_gguf_path.parent)
    out = tmp_path / "preds.jsonl"
    r = eval_cli("--data", "data/sample_eval.jsonl", "--greedy", "--limit", "4", "--max-new-tokens", "16",
                 "--out", str(out), *setting, env=dict(os.environ, CHYD_CACHE=str(cache)))
    assert r.returncode == 0, r.stderr
    # the default reranker, which is the answering model: it scores, no second copy is loaded
    assert ("reranking with smollm2 (the answering model)" in r.stderr) == (setting[0] == "--retrieve")
    assert "int8 weights" not in r.stderr
    data = {d["id"]: d for d in read_jsonl(str(ROOT / "data" / "sample_eval.jsonl"))}
    preds = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(preds) == 4
    for p in preds:
        gold = data[p["id"]]["contexts"]
        assert p["gold_contexts"] == gold
        others = {c for d in data.values() if d["id"] != p["id"] for c in d["contexts"]} - set(gold)
        if setting[0] == "--distractors":  # its own contexts, and two of the other examples'
            assert sorted(p["contexts"]) == sorted(gold + [c for c in p["contexts"] if c in others])
            assert len(p["contexts"]) == len(gold) + 2 and p["gold_shown"]
        else:  # two chunks of the pooled contexts; gold_shown says whether one lies in a gold context
            assert len(p["contexts"]) == 2
            assert p["gold_shown"] == any(c in g for c in p["contexts"] for g in gold)
    k = max(p["shown"] for p in preds)
    recall = sum(p["gold_shown"] for p in preds if p["answerable"]) / sum(p["answerable"] for p in preds)
    assert re.search(rf"retrieval recall@{k} +{recall:.3f} \(a gold context shown\)", r.stdout), r.stdout
    assert "EFA                       1.000" in r.stdout


def test_a_resumed_out_file_must_hold_this_models_and_methods_answers(tmp_path, tiny_folder):
    out = tmp_path / "p.jsonl"
    args = ("--data", "data/sample_eval.jsonl", "--greedy", "--limit", "2", "--max-new-tokens", "8", "--out", str(out),
            "--dtype", "float32")  # pinned: load's measured choice on a tiny model flips with the machine's load
    assert eval_cli(*args, "--model", str(tiny_folder)).returncode == 0
    written = out.read_bytes()
    for other, said in [(("--model", "smollm2"), f"holds chyd answers of {tiny_folder}, not chyd answers of smollm2"),
                        (("--model", str(tiny_folder), "--method", "free"), "not free answers of"),
                        # other decoding flags: the answers of before are no answers of this run
                        (("--model", str(tiny_folder), "--quote-search", "2"), "other options (quote_search=None)"),
                        (("--model", str(tiny_folder), "--prompt", "reference"), "other options (prompt='maintenance')")]:
        r = eval_cli(*args, *other)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # other weights, where there is an answer to add (known once the model is loaded): no evaluation of mixed weights
    r = eval_cli(*args, "--model", str(tiny_folder), "--quantize", "int8", "--limit", "3")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"eval.py: error: --out {out} holds answers of {tiny_folder} from float32 weights, not int8 + float32 weights: give another --out")
    assert out.read_bytes() == written
    again = eval_cli(*args, "--model", str(tiny_folder), "--limit", "3")  # the same run resumes: one more answer
    assert again.returncode == 0 and out.read_bytes().startswith(written) and len(out.read_text().splitlines()) == 3


def test_an_out_file_that_holds_no_predictions_is_refused_and_left_as_it_is(tmp_path, tiny_folder):
    data = tmp_path / "mine.jsonl"  # --out given the dataset itself, a slip of the shell's completion
    data.write_bytes((ROOT / "data" / "sample_eval.jsonl").read_bytes())
    before = data.read_bytes()
    r = eval_cli("--data", str(data), "--out", str(data), "--model", str(tiny_folder), "--limit", "1")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"eval.py: error: --out {data} is not a predictions file to resume: {data}:1: missing field 'prediction'")
    assert data.read_bytes() == before


def test_runner_batches_keep_the_predictions(tmp_path, tiny_folder):
    args = ("--data", "data/sample_eval.jsonl", "--model", str(tiny_folder), "--greedy", "--limit", "5",
            "--max-new-tokens", "12", "--quote-first")
    runs = {b: eval_cli(*args, "--batch-size", b, "--out", str(tmp_path / f"b{b}.jsonl")) for b in ("1", "3")}
    assert all(r.returncode == 0 for r in runs.values()), runs["1"].stderr + runs["3"].stderr
    one, three = ([json.loads(l) for l in (tmp_path / f"b{b}.jsonl").read_text().splitlines()] for b in ("1", "3"))
    assert [p["prediction"] for p in three] == [p["prediction"] for p in one]
    assert [p["batch_size"] for p in three] == [3] * 5 and [p["id"] for p in three] == [p["id"] for p in one]  # data order


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--distractors", "-1"], "--distractors must be >= 0"),
    (["--distractors", "2", "--retrieve"], "--distractors and --retrieve are two settings"),
    (["--retrieve", "--top-k", "0"], "--retrieve needs --top-k >= 1"),
    (["--served-model", "m"], "--served-model names the model a server serves: give --server"),
    (["--out", "{tmp}"], "is a folder; give a file name"),
    (["--out", "{tmp}/nowhere/p.jsonl"], "nowhere does not exist"),
])
def test_bad_setting_flags_are_one_line(tmp_path, flags, message):
    r = eval_cli("--data", "data/sample_eval.jsonl", "--out", str(tmp_path / "p.jsonl"),
                 *(f.replace("{tmp}", str(tmp_path)) for f in flags))
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.jsonl").exists()


# One made-up set of examples, written in each format as it is published
PASSAGES = ["Inflate the nose wheel tyres to 150 psi with dry nitrogen.", "Torque the axle nut to 45 lbf.ft, then to 30."]
OURS = [
    {"id": "t1", "question": "What pressure for the nose tyres?", "contexts": PASSAGES, "answer": "Use [150 psi] of [dry nitrogen].",
     "answerable": True, "short_answers": ["150 psi"]},
    {"id": "t2", "question": "What torque first?", "contexts": PASSAGES[1:], "answer": "[45 lbf.ft]", "answerable": True,
     "short_answers": ["45 lbf.ft"]},
]
QUOTESUM = [
    {"qid": "q1", "unique_id": "t1", "question": "What pressure for the nose tyres?",
     "summary": "Use [ 1 150 psi ] of [ 1 dry nitrogen ].", "covered_short_answers": "[ 1 150 psi ]",
     **{f"{k}{i}": "" for i in range(1, 9) for k in ("title", "source", "short_ans_")},
     "title1": "Tyres", "source1": PASSAGES[0], "short_ans_1": "150 psi", "title2": "Axle", "source2": PASSAGES[1]},
    {"qid": "q2", "unique_id": "t2", "question": "What torque first?", "summary": "[ 1 45 lbf.ft ]",
     "covered_short_answers": "[ 1 45 lbf.ft ]", **{f"{k}{i}": "" for i in range(1, 9) for k in ("title", "source", "short_ans_")},
     "title1": "Axle", "source1": PASSAGES[1], "short_ans_1": "45 lbf.ft"},
]
SQUAD2 = {"version": "v2.0", "data": [{"title": "Servicing", "paragraphs": [
    {"context": PASSAGES[1], "qas": [
        {"id": "t2", "question": "What torque first?", "answers": [{"text": "45 lbf.ft", "answer_start": 22},
                                                                    {"text": "45 lbf.ft", "answer_start": 22}], "is_impossible": False},
        {"id": "t3", "question": "What colour is the nut?", "answers": [], "plausible_answers": [{"text": "axle", "answer_start": 11}],
         "is_impossible": True}]}]}]}


def test_each_dataset_format_is_read_into_the_same_examples(tmp_path):
    from eval import read_dataset

    (tmp_path / "ours.jsonl").write_text("\n".join(json.dumps(r) for r in OURS) + "\n")
    (tmp_path / "quotesum.jsonl").write_text("\n".join(json.dumps(r) for r in QUOTESUM) + "\n")
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD2, indent=1))
    ours = read_dataset(str(tmp_path / "ours.jsonl"))
    assert ours == OURS
    quotesum = read_dataset(str(tmp_path / "quotesum.jsonl"))
    assert [{k: v for k, v in r.items() if k != "qid"} for r in quotesum] == OURS  # keyed by unique_id
    assert [r["qid"] for r in quotesum] == ["q1", "q2"]
    squad = read_dataset(str(tmp_path / "squad.json"))
    assert squad[0] == OURS[1]  # one answer, though listed twice
    assert squad[1] == {"id": "t3", "question": "What colour is the nut?", "contexts": PASSAGES[1:], "answer": "No answer",
                        "answerable": False, "short_answers": []}
    assert read_dataset(str(tmp_path / "quotesum.jsonl"), "quotesum") == quotesum
    for r in quotesum + squad:  # the gold quotes stand in the contexts, as in our own sample set
        assert all(s in " ".join(r["contexts"]) for s in extract_spans(r["answer"] if isinstance(r["answer"], str) else r["answer"][0]))


@pytest.mark.parametrize("name,content,message", [
    ("other.jsonl", '{"query": "q", "passages": ["p"]}\n', "in none of the formats; expected the fields id, question, contexts"),
    ("broken.json", '{"data": [{"paragraphs": [{"qas": [{"id": "x"}]}]}]}', "not SQuAD 2.0"),
    ("quotesum.jsonl", '{"qid": "q", "unique_id": "u", "question": "q", "summary": "s", "source1": "p"}\n{"qid": "q", "unique_id"',
     "quotesum.jsonl:2: not JSON"),
    ("empty.jsonl", "\n", "has no examples"),
])
def test_a_dataset_in_no_format_is_one_line(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    r = eval_cli("--data", str(tmp_path / name), "--out", str(tmp_path / "p.jsonl"))
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "p.jsonl").exists()


def test_a_folder_or_a_file_not_in_utf8_as_data_is_one_line_naming_it(tmp_path):
    (tmp_path / "latin.jsonl").write_bytes(b'{"id": "caf\xe9"}\n')
    for data, message in [(tmp_path, f"{tmp_path} is a folder, not a data file"),
                          (tmp_path / "latin.jsonl", "latin.jsonl: not UTF-8 text (byte 11)")]:
        for flag in ("--data", "--score"):
            r = eval_cli(flag, str(data), "--out", str(tmp_path / "p.jsonl"))
            assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "p.jsonl").exists()


def test_line_recall_at_k_on_a_hand_made_case(tmp_path, monkeypatch):
    from eval import line_recall, shown_docs
    from retrieve import Index, read_documents

    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "docs"
    folder.mkdir()
    filler = "\n".join(f"Line {i} speaks of nothing in particular at all." for i in range(40))
    # the gold phrase of q1 stands on line 42 of a.txt, after 40 lines of filler; q2's on line 1 of b.txt
    (folder / "a.txt").write_text(filler + "\n\nzR opens all folds in the window.\nzM closes all folds.\n")
    (folder / "b.txt").write_text("The gzip level nine is the slowest.\n" + filler + "\n")
    records = [
        {"question": "Which command opens all folds?", "answerable": True, "doc": "a.txt", "line": 42, "short_answers": ["zR"]},
        {"question": "Which gzip level is the slowest?", "answerable": True, "doc": "b.txt", "line": 1,
         "short_answers": ["level nine"]},
        {"question": "What colour is the sky?", "answerable": False, "doc": "a.txt", "line": None, "short_answers": []},
        {"question": "Which line speaks of nothing?", "answerable": True, "doc": "a.txt", "line": 43,  # zM's line
         "short_answers": ["zM"]}]
    index = Index(read_documents([str(folder)]), size=40, overlap=5)
    assert len(index.chunks) >= 6
    top = {r["doc"] + str(r["line"]): index.search(r["question"], 1, "bm25")[0] for r in records if r["answerable"]}
    assert "zR opens" in top["a.txt42"].text and "level nine" in top["b.txt1"].text
    assert "zM" not in top["a.txt43"].text  # the filler lines' own words win for the third question
    assert line_recall(index, records, 1, "bm25") == pytest.approx(2 / 3)  # the unanswerable one does not count
    assert line_recall(index, records, len(index.chunks), "bm25") == 1.0  # every chunk shown: every line found
    shown = shown_docs(records, index, 1, "bm25")  # quality's retrieved rows: the chunks become the contexts
    assert [r["gold_shown"] for r in shown] == [True, True, False, False]
    assert shown[0]["contexts"] == [top["a.txt42"].text] and shown[0]["shown"] == 1
    best_first, best_last = (shown_docs(records, index, 3, "bm25", best_last=b)[0]["contexts"] for b in (False, True))
    assert best_first[0] == top["a.txt42"].text and best_last == best_first[::-1] and len(set(best_last)) == 3
    no_zr = lambda q, texts: [-float("zR" in t) for t in texts]  # a reranker that puts zR's chunk last
    assert line_recall(index, records, 1, "bm25", no_zr) == pytest.approx(1 / 3)  # the gzip question alone
    gzip_first = lambda q, texts: [float("level nine" in t) for t in texts]
    moved = shown_docs(records, index, 1, "bm25", rerank=gzip_first)
    assert "level nine" in moved[3]["contexts"][0]  # 6th of the last question's BM25 top 10, now shown
    assert moved[0]["contexts"] == shown[0]["contexts"]  # not in the first question's top 10: only the pool is reordered
    with pytest.raises(ValueError, match="not on line 41"):
        line_recall(index, [dict(records[0], line=41)], 1, "bm25")


def test_gold_quoted_wants_the_phrase_as_written_inside_a_verbatim_quote():
    from eval import gold_quoted

    ex = {"short_answers": ["zR"], "contexts": ["zR  Open all folds.", "*zm* Fold more"]}
    assert gold_quoted(dict(ex, prediction="[zR  Open all folds.]"))
    assert gold_quoted(dict(ex, prediction="Type [zR] to open them."))
    assert not gold_quoted(dict(ex, prediction="[zm]"))  # another command
    assert not gold_quoted(dict(ex, prediction="zR opens all folds."))  # not quoted
    assert not gold_quoted(dict(ex, prediction="[zR opens all folds]"))  # quoted, but not verbatim
    assert not gold_quoted(dict(ex, prediction="[zr]"))  # as written: a case apart is another vim command
    assert not gold_quoted(dict(ex, short_answers=[], prediction="No answer"))


def test_quality_rows_run_alone_and_resume_from_their_folder(tmp_path, tiny_folder):
    # the dtype pinned: load's measured choice on a tiny model flips with the machine's load, and a resume wants it
    args = ("quality", "--model", str(tiny_folder), "--split", "dev", "--limit", "3", "--max-new-tokens", "8",
            "--rows", "own,reference", "--out", str(tmp_path / "rows"), "--dtype", "float32")
    first = eval_cli(*args)
    assert first.returncode == 0, first.stderr
    table = [l for l in first.stdout.splitlines() if l.startswith("| ") and "---" not in l][1:]
    assert [l.split(" | ")[0] for l in table] == ["| the question's own lines (today)", "| own lines, reference prompt"]
    own, reference = ([json.loads(l) for l in (tmp_path / "rows" / f"{k}.jsonl").read_text().splitlines()]
                      for k in ("own", "reference"))
    dev = [r["id"] for r in read_jsonl(str(ROOT / "data" / "docs_eval.jsonl")) if r["split"] == "dev"][:3]
    assert [p["id"] for p in own] == [p["id"] for p in reference] == dev
    (tmp_path / "rows" / "own.jsonl").write_text("".join(json.dumps(p) + "\n" for p in own[:2]))  # as if interrupted
    again = eval_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "read back" not in first.stderr
    for row, n in (("own", 2), ("reference", 3)):
        assert f"eval.py quality: {n} of 3 answers read back from {tmp_path / 'rows' / row}.jsonl" in again.stderr
    resumed = [json.loads(l) for l in (tmp_path / "rows" / "own.jsonl").read_text().splitlines()]
    assert resumed[:2] == own[:2] and len(resumed) == 3  # only the missing answer was decoded
    assert resumed[2]["prediction"] == own[2]["prediction"]
    assert again.stdout.splitlines()[-1] == first.stdout.splitlines()[-1]  # the reference row read back whole
    other = eval_cli(*args[:-1], "bfloat16")  # the same folder, other weights
    assert other.returncode == 2 and "holds answers of another setting" in other.stderr, other.stderr
    other = eval_cli(*args, "--quote-search", "2")  # other decoding flags
    assert other.returncode == 2 and "quote_search=2" in other.stderr, other.stderr
    assert other.stderr.strip().splitlines()[-1].startswith("eval.py: error: ") and "Traceback" not in other.stderr
    assert (tmp_path / "rows" / "own.jsonl").read_text().count("\n") == 3  # kept as it was


def test_quality_rows_add_each_lever_to_the_defaults_retrieval():
    from eval import quality_rows

    rows = quality_rows("bm25", 8, "smollm2")
    _, default, none = rows["default"]
    assert default == {"retriever": "hybrid", "best_last": True, "rerank": "smollm2"} and none == {}
    for key, fields in (("default-search", {"quote_search": 8}), ("default-reference", {"prompt": "reference"}),
                        ("default-all", {"quote_search": 8, "prompt": "reference"})):
        assert rows[key][1:] == (default, fields), key  # the chunks the default shows, one lever more
    assert rows["retrieved"][1] == {"retriever": "bm25"}  # --retriever moves the retrieval levers' rows only


def test_quality_rows_that_show_the_same_chunks_retrieve_them_once(tmp_path, tiny_folder, monkeypatch):
    import eval as evaluation
    from cli import CliError

    scored, retrievals = [], []
    shown_docs = evaluation.shown_docs

    def load_scorer(name, device, answering):
        return lambda question, texts: scored.append(question) or [float(len(t)) for t in texts]  # longest first

    def counted(records, index, k, **shown):
        retrievals.append(sorted(shown))
        return shown_docs(records, index, k, **shown)
    monkeypatch.setattr(evaluation, "load_scorer", load_scorer)
    monkeypatch.setattr(evaluation, "shown_docs", counted)
    out = tmp_path / "rows"
    assert evaluation.quality_command(["--model", str(tiny_folder), "--split", "dev", "--limit", "2", "--max-new-tokens",
                                       "4", "--dtype", "float32", "--rows", "default,default-search,retrieved",
                                       "--retriever", "bm25", "--top-k", "2", "--out", str(out)]) == 0
    assert retrievals == [["best_last", "rerank", "retriever"], ["retriever"]]  # the default's, then BM25's
    assert len(scored) == 2  # each question reranked once, for both rows that show the default's chunks
    default, search, bm25 = ([json.loads(l) for l in (out / f"{k}.jsonl").read_text().splitlines()]
                             for k in ("default", "default-search", "retrieved"))
    assert [p["contexts"] for p in default] == [p["contexts"] for p in search] != [p["contexts"] for p in bm25]
    for p in default:  # the reranker's best (here the longest chunk) shown last
        assert len(p["contexts"]) == 2 and len(p["contexts"][-1]) >= len(p["contexts"][0])
    for flags, row, said in ((["--width", "4"], "default-search", "quote_search=8"),  # the row's lever, not a flag
                             (["--top-k", "3"], "retrieved", "top_k=2"), (["--retriever", "hybrid"], "retrieved", "bm25")):
        argv = ["--model", str(tiny_folder), "--split", "dev", "--limit", "2", "--max-new-tokens", "4", "--dtype",
                "float32", "--retriever", "bm25", "--top-k", "2", "--out", str(out), "--rows", row]
        with pytest.raises(CliError, match=f"holds answers of another setting.*{said}"):
            evaluation.quality_command(argv + flags)  # the last of a flag given twice counts


@pytest.mark.parametrize("flags,message", [(["quality", "--rows", "own,bogus"], "--rows: no row 'bogus'"),
                                           (["quality", "--width", "0"], "--width must be >= 1"),
                                           (["quality", "--top-k", "0"], "--top-k must be >= 1, got 0"),
                                           (["quality", "--limit", "-3"], "--limit must be >= 1, got -3"),
                                           (["lines", "--top-k", "0"], "--top-k must be >= 1, got 0")])
def test_quality_and_lines_bad_flags_are_one_line(flags, message):
    r = eval_cli(*flags)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_retrieve_setting_shows_the_rerankers_top_k_best_last(tmp_path, monkeypatch):
    import argparse

    import eval as evaluation

    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    seen = []

    def load_scorer(name, device, answering):  # a reranker that prefers the retriever's later chunks
        assert (name, device, answering) == ("smollm2", "cpu", ("smollm2", "model", "tok"))  # the answering model, passed on

        def score(question, texts):
            seen.append(texts)
            return [float(i) for i in range(len(texts))]
        return score
    monkeypatch.setattr(evaluation, "load_scorer", load_scorer)
    corpus = read_jsonl(str(ROOT / "data" / "sample_eval.jsonl"))
    args = argparse.Namespace(chunk_tokens=60, chunk_overlap=10, rerank="smollm2", device="cpu", top_k=2, retriever="bm25")
    shown = evaluation.with_retrieval(corpus[:3], corpus, args, ("smollm2", "model", "tok"))
    assert len(seen) == 3 and all(len(pool) == 10 for pool in seen)  # the retriever's top 10 of each question
    for ex, pool in zip(shown, seen):
        assert ex["contexts"] == [pool[8], pool[9]]  # the reranker's top 2, its best last

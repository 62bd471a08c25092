"""The command line end to end on SmolLM2, and its bad-input cases."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

NOSE_WHEEL = "What is the nominal inflation pressure of the nose wheel tyres?"


def chyd(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, str(ROOT / "chyd.py"), *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=600, env=env)


def readme_main_command():
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines() if "python chyd.py" in l and "pip install" in l)
    return line.split("&& python chyd.py ", 1)[1]


def test_ci_runs_the_readme_test_command():
    readme_commands = [l.strip() for l in (ROOT / "README.md").read_text().splitlines() if "pytest" in l]
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert readme_commands and readme_commands[0] == ci_command


def test_readme_main_command_prints_a_quoted_answer_with_its_source(smollm2):
    import shlex

    r = chyd(*shlex.split(readme_main_command()))
    assert r.returncode == 0, r.stderr
    answer, *sources = r.stdout.strip().splitlines()
    assert "[" in answer and "]" in answer
    assert sources and sources[0].startswith("[1] passage ") and "data/manual.txt, line" in sources[0]
    quote = answer[answer.index("[") + 1: answer.index("]")].strip()
    assert quote in (ROOT / "data" / "manual.txt").read_text()
    assert "\033[" not in r.stdout  # not a terminal: no colour


def test_json_output_has_the_documented_fields(smollm2):
    r = chyd("--ctx", "data/manual.txt", "--ctx", "data/leaflet.txt", "--json", "--greedy", "--max-new-tokens", "24",
             stdin="How many tablets may an adult take in 24 hours at most?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"answer", "quotes", "passages", "spans", "tokens", "prompt_tokens", "quotes_opened",
                        "quotes_forced", "timings", "defaults", "engine", "not_verbatim"}
    assert out["not_verbatim"] == []
    assert out["engine"]["weights"] in ("float32", "bfloat16") and out["engine"]["threads"] >= 1
    assert out["defaults"] == {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "recognised": "by name", "quote_first": True,
                               "no_answer_above": 0.5, "quote_search": 8,
                               "why": "the default for HuggingFaceTB/SmolLM2-135M-Instruct (by name)"}
    assert set(out["timings"]) == {"index_s", "retrieve_s", "prefill_s", "decode_s", "tokens_per_s", "forward_passes"}
    assert out["timings"]["index_s"] == out["timings"]["retrieve_s"] == 0  # both files fit: nothing retrieved
    assert [(p["file"], p["page"], p["score"]) for p in out["passages"]][0] == ("data/manual.txt", None, None)
    assert [q["text"] for q in out["quotes"]] == [s["text"] for s in out["spans"]]
    assert out["quotes_opened"] >= 1 and out["spans"]
    files = {"data/manual.txt": (ROOT / "data/manual.txt").read_text(), "data/leaflet.txt": (ROOT / "data/leaflet.txt").read_text()}
    for span in out["spans"]:
        assert span["sources"]
        for src in span["sources"]:
            text = files[src["file"]]
            assert text[src["start"]:src["end"]] == span["text"]
            assert text.count("\n", 0, src["start"]) + 1 == src["line"]


def test_lookup_flag_keeps_the_greedy_answer_in_fewer_passes(smollm2):
    args = ("--ctx", "data/manual.txt", "--json", "--greedy", "--no-constraint", "-q", NOSE_WHEEL)
    plain, fast = chyd(*args), chyd(*args, "--lookup")
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    said = fast.stderr
    plain, fast = json.loads(plain.stdout), json.loads(fast.stdout)
    assert fast["answer"] == plain["answer"] and "[" not in plain["answer"]  # free: SmolLM2 writes no bracket here
    assert fast["timings"]["forward_passes"] < plain["timings"]["forward_passes"]
    assert "chyd: --no-constraint: decoded freely, no quote forced or checked" in said
    assert "quote-first on" not in said  # the banner of a decoding that forces the first quote


def test_compile_flag_keeps_the_greedy_answer(tiny_folder):
    args = ("--model", str(tiny_folder), "--ctx", "data/manual.txt", "--json", "--greedy", "--max-new-tokens", "24",
            "--trigger-bias", "6", "-q", NOSE_WHEEL)
    eager, compiled = chyd(*args), chyd(*args, "--compile", env=dict(os.environ, TORCH_LOGS="guards"))
    assert eager.returncode == 0 and compiled.returncode == 0, eager.stderr + compiled.stderr
    assert "[__guards]" in compiled.stderr  # dynamo compiled the step
    eager, compiled = json.loads(eager.stdout), json.loads(compiled.stdout)
    assert compiled["tokens"] == eager["tokens"] == 24 and compiled["answer"] == eager["answer"]
    assert compiled["spans"] == eager["spans"] and compiled["quotes_opened"] >= 1


def test_compile_without_a_cxx_compiler_is_one_line(tiny_folder):
    r = chyd("--model", str(tiny_folder), "--ctx", "data/manual.txt", "-q", "x", "--compile",
             env=dict(os.environ, PATH="/nonexistent"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("chyd.py: error: torch.compile needs a C++ compiler")


def test_samples_answer_with_verbatim_quotes(smollm2):
    import chyd as decoder
    from retrieve import paragraphs, read_documents

    model, tok = smollm2
    manual, leaflet = (paragraphs(d) for d in read_documents([str(ROOT / "data/manual.txt"), str(ROOT / "data/leaflet.txt")]))
    cases = [(manual, "What torque is the axle nut tightened to at first?"),
             (manual, "What should you wear when servicing the brake system?"),
             (leaflet, "How long should you leave between doses?"),
             (leaflet, "Where should the tablets be stored?")]
    quoted = 0
    for passages, q in cases:
        contexts = [p.text for p in passages]
        r = decoder.generate(model, tok, q, contexts, temperature=0, max_new_tokens=32, quote_first=True)
        quoted += bool(r.spans)
        for s in r.spans:
            assert any(s.text in c for c in contexts)
    assert quoted == len(cases)


def test_the_terminal_loop_says_what_is_wrong_with_a_question_and_asks_the_next(smollm2, monkeypatch, capsys):
    import io

    import chyd as cli_main

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    questions = iter(["word " * 9000, NOSE_WHEEL])  # the first fills SmolLM2's 8,192-token window alone

    def ask(prompt):
        if (q := next(questions, None)) is None:
            raise EOFError
        return q

    monkeypatch.setattr("sys.stdin", Terminal())
    monkeypatch.setattr("builtins.input", ask)
    code = cli_main.main(["--ctx", str(ROOT / "data/manual.txt"), "--greedy", "--max-new-tokens", "24", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "chyd.py: error: the question is too long" in err and "window of 8192 tokens" in err
    assert "150 psi" in out and "[1] passage" in out  # the next question was answered, with its source


def test_a_question_too_long_for_the_window_is_an_error_line_not_a_traceback():
    r = chyd("--ctx", "data/manual.txt", stdin="word " * 9000)  # the model is loaded first: its banners come before
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("chyd.py: error: the question is too long")


def test_an_answer_budget_larger_than_the_window_names_the_flag_not_the_question():
    r = chyd("--ctx", "data/manual.txt", "--max-new-tokens", "8190", "-q", "Which tyre?")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("chyd.py: error: --max-new-tokens 8190 leaves no room for the prompt "
                                                 "in the model's window of 8192 tokens")


def test_a_cache_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("mine")
    r = chyd("--ctx", "data/manual.txt", "-q", "x", env=dict(os.environ, CHYD_CACHE=str(tmp_path / "a-file")))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"chyd.py: error: the cache folder {tmp_path / 'a-file'} cannot be made "
                                             "(File exists); CHYD_CACHE moves it"]
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("args,message", [
    (["--ctx", "missing.txt", "-q", "x"], "context file missing.txt does not exist"),
    (["--ctx", "EMPTY", "-q", "x"], "is empty"),
    (["--ctx", "BINARY", "-q", "x"], "is binary"),
    (["--ctx", "data/manual.txt", "-q", "x", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--ctx", "data/manual.txt", "-q", "x", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--ctx", "data/manual.txt", "-q", "x", "--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--ctx", "data/manual.txt", "-q", "x", "--trigger-bias", "nan"], "--trigger-bias must be a finite number, got nan"),
    (["--ctx", "data/manual.txt", "-q", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--ctx", "data/manual.txt", "-q", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--ctx", "data/manual.txt", "-q", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--ctx", "data/manual.txt", "-q", "x", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["--ctx", "data/manual.txt", "-q", "x", "--temperature", "warm"], "invalid float value: 'warm'"),
    (["-q", "x"], "the following arguments are required: --ctx"),
    (["--ctx", "data/manual.txt", "-q", "  "], "the question is empty"),
    (["--ctx", "data/manual.txt", "-q", "x", "--no-repeat-ngram", "-1"], "--no-repeat-ngram must be >= 0"),
    (["--ctx", "data/manual.txt", "-q", "x", "--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
    (["--ctx", "data/manual.txt", "-q", "x", "--repetition-penalty", "inf"], "--repetition-penalty must be a finite number > 0"),
    (["--ctx", "data/manual.txt", "-q", "x", "--served-model", "m"], "--served-model names the model a server serves: give --server"),
    (["--ctx", "data/manual.txt", "-q", "x", "--device", "cuda:99"], "device 'cuda:99' cannot be used here"),
    (["--ctx", "data/manual.txt", "-q", "x", "--device", "gpu"], "device 'gpu' cannot be used here"),
    (["--ctx", "data/manual.txt", "-q", "x", "--quantize", "int4"], "invalid choice: 'int4'"),
    (["--ctx", "data/manual.txt", "-q", "x", "--quote-search", "-1"], "--quote-search must be >= 0"),
    (["--ctx", "data/manual.txt", "-q", "x", "--quote-search", "2"], "--quote-search chooses quotes greedily: give --greedy"),
    (["--ctx", "data/manual.txt", "-q", "x", "--prompt", "terse"], "argument --prompt: invalid choice: 'terse'"),
    (["--ctx", "data/manual.txt", "-q", "x", "--no-answer-above", "1"], "--no-answer-above must be in (0, 1), got 1.0"),
    (["--ctx", "data/manual.txt", "-q", "x", "--no-answer-above", "nan"], "--no-answer-above must be in (0, 1), got nan"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text(" \n\n ")
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02PK")
    args = [str(tmp_path / "empty.txt") if a == "EMPTY" else str(tmp_path / "binary.txt") if a == "BINARY" else a
            for a in args]
    r = chyd(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert message in r.stderr and r.stderr.startswith("chyd.py: error: ")


def test_llguidance_engine_answers_from_the_command_line(smollm2):
    r = chyd("--ctx", "data/manual.txt", "-q", "What is the nominal inflation pressure of the nose wheel tyres?",
             "--greedy", "--engine", "llguidance", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["quotes"] and all(q["sources"] for q in out["quotes"])


@pytest.mark.parametrize("args,message", [
    (["--only", "prefill", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--only", "answers", "--top-p", "3"], "--top-p must be in (0, 1], got 3.0"),
    (["--only", "speed"], "argument --only: invalid choice: 'speed'"),
])
def test_bench_bad_input_is_one_line_and_exit_2(args, message):
    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("bench.py: error: ")
    assert message in r.stderr


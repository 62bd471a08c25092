"""server.py and export.py. The tests marked `engine` need a real vLLM server: tests/vllm.sh makes its environment,
starts it and runs them with CHYD_TEST_SERVER=URL; the others play the server with a small fake of its API."""
import json
import math
import os
import re
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import chyd
import server
from chyd import DecodeOptions
from constraint import lark_grammar, ll_tokenizer, token_classes
from server import ServerError, connect, server_stream

URL = os.environ.get("CHYD_TEST_SERVER")
engine = pytest.mark.skipif(not URL, reason="no vLLM server: tests/vllm.sh starts one and sets CHYD_TEST_SERVER")
CONTEXTS = ["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft.", "Inflate the main wheel tyres to 185 psi."]


def matcher(tok, grammar):
    import llguidance

    m = llguidance.LLMatcher(ll_tokenizer(tok, tok.vocab_size), grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


@pytest.mark.parametrize("whole_words", [False, True])
def test_the_inside_quote_grammar_starts_after_the_bracket(toy_tok, whole_words):
    ok = ["45 lbf.ft] then [185 psi].", "the axle nut] ok", "Inflate the main wheel tyres to 185 psi.]"]
    bad = ["[45 lbf.ft]", "free text", "200 psi]", "]", "45 lbf.ft"]  # a second `[`, no quote, not verbatim, empty, open
    for text in ok + bad:
        m = matcher(toy_tok, lark_grammar(CONTEXTS, whole_words=whole_words, inside_quote=True))
        accepted = m.consume_tokens(toy_tok.encode(text)) and m.is_accepting()
        assert accepted == (text in ok), text
    with pytest.raises(ValueError, match="nothing to quote"):
        lark_grammar([" ", "[]"], inside_quote=True)


def test_a_returned_quote_that_is_not_verbatim_is_reported_and_an_open_one_closed(toy_tok):
    c = chyd.Constraint(token_classes(toy_tok, toy_tok.vocab_size), CONTEXTS)
    r = server.checked(toy_tok, c, toy_tok.encode("So [200 psi] and [45 lbf.ft"), 100, "length", 0.1, 0.2, "fake")
    assert r.text == "So [200 psi] and [45 lbf.ft]" and r.quotes_forced == 1 and r.quotes_opened == 2
    assert r.not_verbatim == ["200 psi"] and not r.verbatim
    assert [(s.text, s.sources) for s in r.spans] == [("200 psi", []), ("45 lbf.ft", [(0, CONTEXTS[0].index("45"))])]
    assert r.modes[0] == chyd.STANDARD and r.modes[-1] == chyd.EEC  # the closing `]` is written inside the quote
    assert server.checked(toy_tok, c, toy_tok.encode("[185 psi]."), 1, "stop", 0, 0, "").verbatim
    r = server.checked(toy_tok, c, toy_tok.encode("a [b [185 psi] c] d"), 1, "stop", 0, 0, "")  # no quote holds "b "
    assert r.not_verbatim == ["[b ", "] d"] and [s.sources for s in r.spans] == [[(1, CONTEXTS[1].index("185"))]]



def test_a_returned_quote_left_open_without_a_word_is_left_out_as_the_loop_leaves_it(toy_tok):
    c = chyd.Constraint(token_classes(toy_tok, toy_tok.vocab_size), CONTEXTS, whole_words=True)
    for text, kept, forced in [("So [45 lbf.ft] then\n [4", "So [45 lbf.ft] then", 0), ("\n[4", "\n[4]", 1),
                               ("So [45 lbf", "So [45 lbf]", 1)]:
        r = server.checked(toy_tok, c, toy_tok.encode(text), 100, "length", 0, 0, "fake")
        assert r.text == kept and toy_tok.decode(r.tokens) == kept and r.quotes_forced == forced, text
        assert r.verbatim and len(r.modes) == len(r.tokens)
    r = server.checked(toy_tok, chyd.Constraint(token_classes(toy_tok, toy_tok.vocab_size), CONTEXTS), toy_tok.encode("So [4"),
                       100, "length", 0, 0, "fake")
    assert r.text == "So [4]"  # without whole-word quotes [4] may close


class FakeVLLM(BaseHTTPRequestHandler):
    """vLLM's API as server.py uses it: the model list, the version, completions streamed as server-sent events
    (an answer that ignores the grammar) and log-probabilities by token id. The requests are kept."""

    models = ["served-model"]
    answer: list[int] = []
    finish_reason = "length"
    logprob = -0.1  # of the first token asked for
    requests: list[dict] = []

    def log_message(self, *args):
        pass

    def reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.reply(200, {"data": [{"id": m, "owned_by": "vllm", "max_model_len": 4096} for m in self.models]})
        elif self.path == "/version":
            self.reply(200, {"version": "0.0-fake"})
        else:
            self.reply(404, {"error": {"message": "Not Found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":  # /tokenize: a server without it is taken on trust
            return self.reply(404, {"error": {"message": "Not Found"}})
        FakeVLLM.requests.append(body)
        if "logprob_token_ids" in body:  # the k-th token asked for: (k + 1) * logprob
            top = {f"token_id:{t}": (k + 1) * self.logprob for k, t in enumerate(body["logprob_token_ids"])}
            return self.reply(200, {"choices": [{"text": "x", "logprobs": {"top_logprobs": [top]}}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"text": "", "token_ids": [], "prompt_token_ids": body["prompt"]}]}]
        chunks += [{"choices": [{"text": "?", "token_ids": [t]}]} for t in self.answer]
        chunks[-1]["choices"][0]["finish_reason"] = self.finish_reason
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    FakeVLLM.requests = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_connect_finds_the_served_model_or_says_what_is_wrong_in_one_line(fake, monkeypatch):
    s = connect(fake + "/v1/")
    assert (s.url, s.model, s.engine, s.max_model_len) == (fake, "served-model", f"vllm 0.0-fake at {fake}, model served-model", 4096)
    assert connect(fake, "served-model").model == "served-model"
    for url, name, said in [(fake, "other", "serves served-model, not other"), ("127.0.0.1:8765", None, "not an http"),
                            (fake + "/nowhere", None, "HTTP 404: Not Found")]:
        with pytest.raises(ServerError, match=said) as e:
            connect(url, name)
        assert "\n" not in str(e.value)
    monkeypatch.setattr(FakeVLLM, "models", ["a", "b"])
    with pytest.raises(ServerError, match="serves 2 models \\(a, b\\): name one"):
        connect(fake)
    assert connect(fake, "b").model == "b"


def test_a_server_that_is_down_is_one_line_naming_it():
    with pytest.raises(ServerError) as e:
        connect("http://127.0.0.1:9")  # the discard port: nothing listens there
    assert str(e.value).startswith("http://127.0.0.1:9/v1/models: cannot reach the server") and "\n" not in str(e.value)


def test_a_served_answer_is_checked_and_quote_first_weighs_no_answer_by_token(fake, toy_tok, monkeypatch):
    s = connect(fake)
    tail = toy_tok.encode("200 psi] and [45 lbf.ft")  # after the `[` chyd writes: not verbatim, then open at the limit
    monkeypatch.setattr(FakeVLLM, "answer", tail)
    o = DecodeOptions(temperature=0.0, max_new_tokens=16, quote_first=True, no_answer_above=0.5, whole_words=False)
    monkeypatch.setattr(FakeVLLM, "logprob", -0.5)  # p(No) = 0.61: above 1/2 alone, not with " answer" after it
    (i, r), = server_stream(s, toy_tok, ["Q?"], [CONTEXTS], o)
    assert r.text == "[200 psi] and [45 lbf.ft]" and r.not_verbatim == ["200 psi"] and r.quotes_forced == 1
    assert r.engine == s.engine and r.finish_reason == "length" and r.tokens[0] == token_classes(toy_tok, toy_tok.vocab_size).open_id
    scored, decoded = FakeVLLM.requests[:-1], FakeVLLM.requests[-1]
    no_answer = toy_tok.encode(chyd.NO_ANSWER)
    assert [q["logprob_token_ids"] for q in scored] == [[t] for t in no_answer[:2]]  # stopped once below 1/2
    prompt = toy_tok.encode(chyd.build_prompt(toy_tok, "Q?", CONTEXTS, quote_first=True))
    assert scored[0]["prompt"] == prompt and decoded["prompt"] == prompt + [r.tokens[0]]
    assert decoded["max_tokens"] == 15 and decoded["temperature"] == 0.0
    assert decoded["structured_outputs"]["grammar"] == lark_grammar(CONTEXTS, inside_quote=True)
    monkeypatch.setattr(FakeVLLM, "logprob", -0.01)  # every token of "No answer" at 0.99: likelier than 1/2
    FakeVLLM.requests = []
    (i, r), = server_stream(s, toy_tok, ["Q?"], [CONTEXTS], o)
    assert r.text == chyd.NO_ANSWER and r.tokens == no_answer and len(FakeVLLM.requests) == len(no_answer)
    monkeypatch.setattr(FakeVLLM, "logprob", -0.5)  # below 1/2, above a lower threshold: abstains as ours does
    p = math.exp(-0.5 * len(no_answer))
    for above, abstains in ((p * 0.99, True), (p * 1.01, False)):
        (i, r), = server_stream(s, toy_tok, ["Q?"], [CONTEXTS], replace(o, no_answer_above=above))
        assert (r.text == chyd.NO_ANSWER) == abstains, (above, r.text)


def test_a_served_answer_stops_at_the_prompts_headings_as_ours_does(fake, toy_tok, monkeypatch):
    s = connect(fake)
    monkeypatch.setattr(FakeVLLM, "answer", toy_tok.encode("185 psi] ok.\n\nQuestion: Q? [45 lbf.ft]"))  # a fake ends anywhere
    o = DecodeOptions(temperature=0.0, max_new_tokens=32, quote_first=True, no_answer_above=0.9, whole_words=False)
    (i, r), = server_stream(s, toy_tok, ["Q?"], [CONTEXTS], o)
    assert r.text == "[185 psi] ok." and r.verbatim and [sp.text for sp in r.spans] == ["185 psi"]
    assert FakeVLLM.requests[-1]["stop"] == ["\nPassage ", "\nQuestion:"]  # a real engine ends there itself


def test_the_command_line_reports_a_server_that_ignores_the_grammar_and_exits_1(fake, smollm2, monkeypatch):
    import subprocess
    import sys

    _, tok = smollm2
    monkeypatch.setattr(FakeVLLM, "answer", tok.encode("The nose wheel takes [200 psi] of air."))  # not in the manual
    root = chyd.DATA.parent
    r = subprocess.run([sys.executable, "chyd.py", "--ctx", "data/manual.txt", "--server", fake, "--greedy",
                        "--no-quote-first", "--quote-search", "2", "-q", "What is the pressure of the nose wheel tyres?"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "chyd: the engine does not apply no_repeat_ngram=4, quote_search=2" in r.stderr
    assert "[1] NOT VERBATIM: in no passage" in r.stdout and "[200 psi]" in r.stdout
    assert "chyd: error: 1 quote(s) from the engine are not in the passages: '200 psi'" in r.stderr
    assert "Traceback" not in r.stderr
    # SmolLM2's greedy default searches quotes in our loop; an engine is not asked to, and says nothing of it
    r = subprocess.run([sys.executable, "chyd.py", "--ctx", "data/manual.txt", "--server", fake, "--greedy", "--json",
                        "--no-quote-first", "--no-repeat-ngram", "0", "-q", "What is the pressure of the nose wheel tyres?"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and json.loads(r.stdout)["defaults"]["quote_search"] == 0
    assert "does not apply" not in r.stderr and "quote search" not in r.stderr


def test_an_engine_is_said_not_to_search_quotes():
    assert server.unsupported(DecodeOptions(no_repeat_ngram=0, quote_search=4)) == ["quote_search=4"]
    assert server.unsupported(DecodeOptions(no_repeat_ngram=0)) == []  # quote search off: nothing to say


def test_trace_decodes_and_judges_on_a_server(fake, smollm2, tmp_path, monkeypatch, capsys):
    import trace as tracing

    _, tok = smollm2
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(FakeVLLM, "answer", tok.encode("It is 185 psi."))
    monkeypatch.setattr(FakeVLLM, "logprob", -0.5)
    root = chyd.DATA.parent
    data = tmp_path / "q.jsonl"
    data.write_text((root / "data" / "facets_sample.jsonl").read_text().splitlines(keepends=True)[0])
    out = tmp_path / "trace.jsonl"
    args = ["--data", str(data), "--docs", str(root / "data" / "manual.txt"), "--out", str(out), "--server", fake,
            "--greedy", "--no-quote-first", "--top-k", "2", "--concurrency", "3"]
    assert tracing.main(args) == 0, capsys.readouterr().err
    facets = [json.loads(l) for l in out.read_text().splitlines()][:-1]
    assert len(facets) == 2 and all(r["answers"] == {m: "It is 185 psi." for m in tracing.MODES} for r in facets)
    p = torch.softmax(torch.tensor([-0.5, -1.0, -1.5]), -1)  # yes, no, maybe: the fake's log-probabilities
    assert all(v == round(float(p[0] - p[1]), 4) for r in facets for m in tracing.MODES for v in r["faith"][m])
    words = [tok.encode(w)[0] for w in tracing.JUDGE_WORDS]
    judged = [q for q in FakeVLLM.requests if q.get("logprob_token_ids") == words]
    assert len(judged) == 2 * 3 * 2  # every facet, mode and chunk
    decoded = [q for q in FakeVLLM.requests if "logprob_token_ids" not in q]
    assert len(decoded) == 2 * 3 + 3 and sum("structured_outputs" in q for q in decoded) == 2 * 3 + 3
    monkeypatch.setattr(FakeVLLM, "answer", tok.encode("It is [200 kPa of air]."))  # an engine that ignored the grammar
    out.unlink()
    assert tracing.main(args) == 2
    err = capsys.readouterr().err
    assert f"{fake}: " in err and "quote(s) that came back are in no passage" in err and "'200 kPa of air'" in err
    assert not out.exists()


def test_eval_never_adds_served_answers_to_local_ones_nor_local_to_served(fake, smollm2, tmp_path, monkeypatch, capsys):
    import eval as evaluation

    _, tok = smollm2
    monkeypatch.setattr(FakeVLLM, "answer", tok.encode("It is [150 psi]."))
    args = ["--data", str(chyd.DATA / "sample_eval.jsonl"), "--greedy", "--max-new-tokens", "8", "--dtype", "float32"]
    for first, then, said in [([], ["--server", fake], "from float32 weights, not a served engine"),
                              (["--server", fake], [], "from a served engine, not float32 weights")]:
        out = tmp_path / f"{len(first)}.jsonl"
        assert evaluation.main([*args, *first, "--limit", "1", "--out", str(out)]) == 0, capsys.readouterr().err
        written = out.read_bytes()
        capsys.readouterr()
        assert evaluation.main([*args, *then, "--limit", "2", "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"eval.py: error: --out {out} holds answers of smollm2 {said}: give another --out")
        assert out.read_bytes() == written


def test_passages_too_large_for_the_engines_grammar_are_refused_before_any_request(toy_tok):
    s = server.Server("http://127.0.0.1:9", "m", "fake")  # any request would fail with "cannot reach"
    big = [" ".join(f"word{i} part{i * 7 % 1000}" for i in range(j, j + 400)) for j in range(0, 12_000, 400)]
    with pytest.raises(ServerError, match=r"question 1's passages \([\d,]+ bytes\) are too large") as e:
        list(server_stream(s, toy_tok, ["Q?"], [big], DecodeOptions(quote_first=False, whole_words=False)))
    assert "\n" not in str(e.value)


def test_export_writes_a_folder_that_transformers_and_our_loader_read_as_our_model(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from export import write_hf_folder
    from checkpoints import load

    model, tok = smollm2
    write_hf_folder(model, tok, tmp_path)
    messages = [{"role": "user", "content": "What pressure? Naïve café 東京 [45 lbf.ft]"}]
    prompt = tok.apply_chat_template(messages)
    ids = tok.encode(prompt)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    assert hf_tok(prompt, add_special_tokens=False)["input_ids"] == ids
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model.setup_cache(1, 128)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]), torch.arange(len(ids)))[0]
        theirs = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4 * theirs.abs().max().item(), rtol=0)
    back, back_tok = load(str(tmp_path), dtype=torch.float32)  # the fixture's dtype (load's own choice is bf16 here)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    assert back_tok.eos_ids == tok.eos_ids and back_tok.encode(prompt) == ids


def test_export_never_overwrites_what_it_did_not_write_and_rewrites_its_own(smollm2, tmp_path, capsys):
    from export import EXPORT_FILES, main, write_hf_folder

    mine = tmp_path / "my-model"  # a model folder of the user's own
    mine.mkdir()
    (mine / "README.md").write_text("my notes")
    (mine / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("x")
    for args, said in [(["smollm2", str(mine)], "holds files an export does not write (README.md)"),
                       (["smollm2", str(tmp_path / "notes.txt")], "notes.txt is a file, not a folder"),
                       ([str(mine), str(mine)], "is the model's own folder")]:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert said in err and err.startswith("export.py: error: ") and len(err.strip().splitlines()) == 1
    assert (mine / "config.json").read_text() == "{}" and (mine / "README.md").read_text() == "my notes"
    assert (tmp_path / "notes.txt").read_text() == "x"
    model, tok = smollm2
    for _ in range(2):  # an earlier export is rewritten
        write_hf_folder(model, tok, tmp_path / "export")
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == sorted(EXPORT_FILES)


# the real engine


@pytest.fixture(scope="module")
def served(smollm2):
    """The sample set's 42 answers through the server, greedy, quote-first, whole words, 64 tokens: (data,
    options, results in order, seconds)."""
    _, tok = smollm2
    data = [json.loads(l) for l in (chyd.DATA / "sample_eval.jsonl").read_text().splitlines()]
    o = DecodeOptions(temperature=0.0, max_new_tokens=64, quote_first=True, no_answer_above=0.5, whole_words=True,
                      no_repeat_ngram=0, quote_search=0)  # ours, compared below, as an engine decodes: no search
    s = connect(URL)
    t0 = time.perf_counter()
    results = dict(server_stream(s, tok, [e["question"] for e in data], [e["contexts"] for e in data], o,
                                 concurrency=len(data)))
    seconds = time.perf_counter() - t0
    print(f"\n{len(data)} answers through {s.engine} in {seconds:.1f} s")
    return data, o, [results[i] for i in range(len(data))], seconds


@engine
def test_the_served_sample_answers_quote_only_verbatim_text_with_exact_sources(served):
    data, _, results, _ = served
    quotes = 0
    for e, r in zip(data, results):
        assert r.verbatim, (e["id"], r.text, r.not_verbatim)
        for s in r.spans:
            assert s.sources and all(e["contexts"][i][at:at + len(s.text)] == s.text for i, at in s.sources), (e["id"], s)
        quotes += len(r.spans)
    no_answers = sum(r.text == chyd.NO_ANSWER for r in results)
    print(f"{quotes} quotes, {no_answers} 'No answer', {sum(r.quotes_forced for r in results)} closed at the limit")
    assert quotes >= len(data) // 2 and no_answers < len(data) // 2  # quote-first quotes, not all "No answer"


@engine
def test_greedy_served_answers_are_ours_where_the_languages_agree(served, smollm2):
    model, tok = smollm2
    data, o, results, _ = served
    torch.set_num_threads(1)  # the server holds the other core
    t0 = time.perf_counter()
    ours = chyd.generate_batch(model, tok, [e["question"] for e in data], [e["contexts"] for e in data], options=o,
                               batch_size=8)
    # whitespace before `]` (a newline the engine lets into a quote, a trailing space then an exit such as `](`):
    # the two languages close such quotes differently, so there the answers may part; everywhere else they must not
    same = lambda a, b: re.sub(r"\s+\]", "]", a) == re.sub(r"\s+\]", "]", b)
    parted = [any(re.search(r"\s\]", r.text) for r in pair) for pair in zip(ours, results)]
    equal = sum(same(a.text, b.text) for a, b in zip(ours, results))
    print(f"\nours in {time.perf_counter() - t0:.1f} s; {equal} of {len(data)} served answers equal ours "
          f"({sum(a.text == b.text for a, b in zip(ours, results))} to the byte); {sum(parted)} with whitespace before ]")
    differ = [(e["id"], a.text, b.text) for e, a, b, p in zip(data, ours, results, parted) if not (p or same(a.text, b.text))]
    assert not differ and equal >= 35, differ


@engine
def test_the_engine_stops_at_the_prompts_headings_as_ours_does(smollm2, monkeypatch):
    model, tok = smollm2
    contexts = ["The sky is blue.", "The sea is blue.", "The grass is green.", "The sun is yellow."]
    prompt = tok.encode("".join(f"Passage {i + 1}:\n{c}\n\n" for i, c in enumerate(contexts)).rstrip() + "\n")
    o = DecodeOptions(temperature=0.0, max_new_tokens=32, quote_first=False, no_repeat_ngram=0, quote_search=0)
    (_, served), = server.prompt_stream(connect(URL), tok, [prompt], [contexts], o)
    (_, ours), = chyd.decode_stream(model, tok, [prompt], [contexts], o)
    assert served.finish_reason == "stop" and served.text == ours.text == "", (served.text, ours.text)
    monkeypatch.setattr(chyd, "ANSWER_STOPS", (b"\x00",))  # without the stops SmolLM2 goes on with a fifth passage
    (_, free), = chyd.decode_stream(model, tok, [prompt], [contexts], o)
    assert free.text.startswith("\nPassage 5:"), free.text


@engine
def test_a_server_that_ignores_the_grammar_is_caught(smollm2):
    _, tok = smollm2
    data = [json.loads(l) for l in (chyd.DATA / "sample_eval.jsonl").read_text().splitlines()][:21]
    s = connect(URL)
    s.send_grammar = False  # as a server started without the guidance backend, or one that drops the field
    o = DecodeOptions(temperature=0.0, max_new_tokens=64, quote_first=True, no_answer_above=0.5, whole_words=True)
    results = [r for _, r in server_stream(s, tok, [e["question"] for e in data], [e["contexts"] for e in data], o)]
    bad = [q for r in results for q in r.not_verbatim]
    assert bad, [r.text for r in results]
    assert all(not sp.sources for r in results for sp in r.spans if sp.text in r.not_verbatim)
    print(f"\nwithout the grammar: {len(bad)} of {sum(len(r.spans) for r in results)} quotes not verbatim")


@engine
def test_the_engine_refuses_or_empties_what_its_grammar_limits_cannot_hold(smollm2):
    """Why server_stream compiles large grammars first: vLLM's own check refuses about 90 KB of passages, and
    from about 50 KB its matcher fails after that check, leaving an empty answer."""
    _, tok = smollm2
    s = connect(URL)
    o = DecodeOptions(temperature=0.0, max_new_tokens=8, quote_first=False, whole_words=False)  # any-substring limits
    words = (chyd.DATA / "manual.txt").read_text().split()

    def passages(kb):  # different passages of 400 words, kb KB in all
        out = []
        while sum(len(p.encode()) for p in out) < kb * 1000:
            out.append(" ".join(words[(7 * len(out) + 13 * i) % len(words)] for i in range(400)))
        return out

    with pytest.raises(ServerError, match="too big") as e:
        server.answer(s, tok, tok.encode("Hi"), passages(120), o, [])
    assert "\n" not in str(e.value)
    assert server.answer(s, tok, tok.encode("Hi"), passages(60), o, []).text == ""


@engine
def test_the_command_lines_answer_on_the_server_with_sources(tmp_path):
    import subprocess
    import sys

    root = chyd.DATA.parent
    r = subprocess.run([sys.executable, "chyd.py", "--ctx", "data/manual.txt", "--server", URL, "--greedy", "--json",
                        "-q", "What is the nominal inflation pressure of the nose wheel tyres?"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["engine"]["engine"].startswith("vllm") and out["not_verbatim"] == [] and out["quotes"]
    manual = (root / "data" / "manual.txt").read_text()
    assert all(manual[src["start"]:src["end"]] == q["text"] for q in out["quotes"] for src in q["sources"])
    preds = tmp_path / "preds.jsonl"
    r = subprocess.run([sys.executable, "eval.py", "--data", "data/sample_eval.jsonl", "--limit", "12", "--server", URL,
                        "--concurrency", "6", "--greedy", "--out", str(preds)], cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "engine" in r.stdout and "vllm" in r.stdout and "EFA                       1.000" in r.stdout
    assert "eval.py: the engine does not apply no_repeat_ngram=4" in r.stderr
    records = [json.loads(l) for l in preds.read_text().splitlines()]
    ids = [json.loads(l)["id"] for l in (root / "data" / "sample_eval.jsonl").read_text().splitlines()[:12]]
    assert [p["id"] for p in records] == ids and all(p["not_verbatim"] == [] for p in records)


@engine
def test_the_served_judge_is_the_local_judge(smollm2):
    import trace as tracing

    model, tok = smollm2
    data = [json.loads(l) for l in (chyd.DATA / "sample_eval.jsonl").read_text().splitlines()][:4]
    asks = [(e["contexts"][0], e["question"], a) for e in data for a in ("It is [185 psi].", "No, it is not.")]
    local = tracing.ModelJudge(model, tok)(asks)
    served = tracing.ModelJudge(None, tok, connect(URL), concurrency=4)(asks)
    assert served == pytest.approx(local, abs=0.02) and len(set(round(v, 3) for v in local)) > 1

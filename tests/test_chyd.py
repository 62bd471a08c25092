"""chyd.py: the verbatim guarantee as a property, one test per decoding rule, and the constraint in transformers."""
import os
import re
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

import chyd
from chyd import build_prompt, generate
from constraint import EEC, STANDARD, ChydLogitsProcessor, Constraint, extract_spans, holds_word, joins_words, token_classes
from model import ModelConfig, Transformer


class BiasedToy(Transformer):
    """A random tiny transformer with a logit bias that makes brackets frequent."""

    def __init__(self, cfg, bias):
        super().__init__(cfg)
        self.bias = bias

    def logits(self, h, rows=None):
        return super().logits(h, rows) + self.bias


def biased_toy(tok, not_text: float = 0.0) -> BiasedToy:
    """The toy model: brackets frequent; not_text is added to a special token's logit (but the end's) and to that of
    a token whose bytes are no UTF-8 alone (a lone byte of a longer character)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                      intermediate_size=64, max_position_embeddings=4096, norm_eps=1e-5)
    bias = torch.zeros(tok.vocab_size)
    for i, b in enumerate(tok.token_bytes):
        if b"[" in b or b"]" in b:
            bias[i] = 4.0
        elif i in tok.special_ids - tok.eos_ids or not utf8_valid(b):
            bias[i] = not_text
    model = BiasedToy(cfg, bias).eval()
    with torch.no_grad():
        model.output.weight.mul_(8)  # peaked distributions, so that greedy and sampled runs differ
    return model


@pytest.fixture(scope="module")
def toy_model(toy_tok):
    return biased_toy(toy_tok)


@pytest.fixture(scope="module")
def text_toy_model(toy_tok):
    """The toy model, rarely writing what no grammar holds outside a quote: the Lark test kept 1 answer in 14 of
    toy_model's and 300 in 321 of these. Inside a quote a lone byte is still written where the passage needs it."""
    return biased_toy(toy_tok, not_text=-8.0)


def check_answer(result, contexts):
    """Every bracket pair is a verbatim quote with real sources, and no answer ends inside a quote."""
    text = result.text
    assert re.fullmatch(r"[^\[\]]*(\[[^\[\]]*\][^\[\]]*)*", text), f"unbalanced brackets: {text!r}"
    for inner in re.findall(r"\[([^\[\]]*)\]", text):
        assert inner, f"empty quote in {text!r}"
        assert any(inner.rstrip() in c for c in contexts), f"{inner!r} is not verbatim in {contexts!r}"
    for span in result.spans:
        assert span.sources, span
        for i, off in span.sources:
            assert contexts[i][off:off + len(span.text)] == span.text
    assert len(result.tokens) == len(result.modes)


context_text = st.one_of(
    st.text(alphabet="ab []\n", min_size=1, max_size=40),
    st.text(alphabet="Torque the axle nut to 45 lbf.ft, psi [185]. é東🙂\t", min_size=1, max_size=80),
    st.builds(lambda w, n: (w + " ") * n, st.sampled_from(["psi", "[S]", "nut", "é"]), st.integers(1, 12)),
    st.text(min_size=1, max_size=30),
)


def on_word_boundaries(quote: str, contexts) -> bool:
    """Whether the quote (outer whitespace aside) holds a word or is a term (holds_word, its cases pinned in
    test_constraint) and occurs somewhere without splitting a word at either end."""
    q = quote.strip()
    if not holds_word(q.encode()):
        return False
    for c in contexts:
        at = c.find(q)
        while at >= 0:
            end = at + len(q)
            if (at == 0 or not joins_words(c[at - 1], c[at])) and (end == len(c) or not joins_words(c[end - 1], c[end])):
                return True
            at = c.find(q, at + 1)
    return False


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(contexts=st.lists(context_text, min_size=1, max_size=3), seed=st.integers(0, 2**16),
       temperature=st.sampled_from([0.0, 0.7, 1.5]), bias=st.sampled_from([0.0, 3.0]), whole_words=st.booleans())
@example(contexts=["00\x850"], seed=0, temperature=0.0, bias=0.0, whole_words=True)  # [00\x85]: "00" once stripped
def test_every_quote_is_verbatim(toy_model, toy_tok, contexts, seed, temperature, bias, whole_words):
    r = generate(toy_model, toy_tok, "Q?", contexts, temperature=temperature, top_p=0.9, max_new_tokens=24,
                 seed=seed, trigger_bias=bias, whole_words=whole_words)
    check_answer(r, contexts)
    if whole_words:  # every quote keeps the rules; one the budget closed may end mid-word, but holds a word
        quotes = re.findall(r"\[([^\[\]]*)\]", r.text)
        budget_closed = len(r.tokens) >= 24 and r.modes[-1] == EEC
        assert all(on_word_boundaries(q, contexts) for q in quotes[:len(quotes) - budget_closed]), r.text
        alone = budget_closed and not r.text[:r.text.rfind("[")].strip()  # nothing before it: closed, not left out
        assert all(holds_word(q.strip().encode()) for q in quotes[:len(quotes) - alone]), r.text


def test_whole_words_keep_the_toy_model_quoting(toy_model, toy_tok):
    contexts = ["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft."]
    results = [generate(toy_model, toy_tok, "Q?", contexts, seed=s, max_new_tokens=24, whole_words=True) for s in range(40)]
    kept = [s.text for r in results for s in r.spans[:len(r.spans) - (len(r.tokens) >= 24 and r.modes[-1] == EEC)]]
    assert len(kept) >= 15 and all(on_word_boundaries(s, contexts) for s in kept), kept


def test_toy_model_quotes_often_so_the_property_is_exercised(toy_model, toy_tok):
    contexts = ["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft."]
    results = [generate(toy_model, toy_tok, "Q?", contexts, seed=s, max_new_tokens=24) for s in range(40)]
    assert sum(r.quotes_opened for r in results) >= 20
    assert sum(len(r.spans) for r in results) >= 20
    free = [generate(toy_model, toy_tok, "Q?", contexts, seed=s, max_new_tokens=24, constrained=False) for s in range(40)]
    # without the constraint the same model writes brackets that are no quotes
    assert any(not re.fullmatch(r"[^\[\]]*(\[[^\[\]]+\][^\[\]]*)*", r.text)
               or any(s not in contexts[0] for s in re.findall(r"\[([^\[\]]*)\]", r.text)) for r in free)


class ScriptedModel(Transformer):
    """At answer step k, prefers script[k] (a list of token strings, best first); every other token scores 0.
    The answer follows CHyD's prompt for the question "Q?" and these contexts. A one-layer Transformer whose
    forward pass is replaced, so that the loop finds the cache it expects."""

    def __init__(self, tok, script, contexts=(), quote_first=False):
        super().__init__(ModelConfig(vocab_size=tok.vocab_size, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                                     intermediate_size=8, max_position_embeddings=4096))
        self.script = [[self.id(tok, s) for s in step] for step in script]
        self.prompt_len = len(tok.encode(build_prompt(tok, "Q?", list(contexts), quote_first=quote_first)))

    @staticmethod
    def id(tok, s):
        ids = tok.encode(s)
        matches = [i for i, b in enumerate(tok.token_bytes) if b == s.encode()]
        assert matches, f"no token {s!r} in the toy vocabulary (it encodes as {ids})"
        return matches[0]

    def logits(self, h, rows=None):  # forward's "hidden states" are the scores already
        return h

    def forward(self, tokens, input_pos, hidden_only=False, row=0, lengths=None):
        V = self.config.vocab_size
        out = -0.001 * torch.arange(V, dtype=torch.float32).repeat(tokens.shape[0], tokens.shape[1], 1)
        for j, p in enumerate(input_pos.tolist()):
            step = p - self.prompt_len + 1
            for rank, t in enumerate(self.script[step] if 0 <= step < len(self.script) else []):
                out[:, j, t] = 10.0 - rank
        return out


def run(tok, script, contexts=("Torque the nut to 45 lbf.ft. Inflate the tyre to 185 psi.",), **kw):
    """The scripted answer under the paper's rules alone: no whole-word rules, no n-gram ban, unless kw says."""
    model = ScriptedModel(tok, script, contexts, bool(kw.get("quote_first")))
    kw = {"max_new_tokens": 30, "whole_words": False, "no_repeat_ngram": 0, **kw}
    return generate(model, tok, "Q?", list(contexts), temperature=0, **kw)


EOS = "<|im_end|>"


@pytest.mark.parametrize("trigger", ["[", " [", " (["])
def test_trigger_variants_open_a_quote(toy_tok, trigger):
    r = run(toy_tok, [[" Set"], [trigger], [" 45"], [" lbf"], [".ft"], ["]"], [EOS]])
    assert r.text == f" Set{trigger} 45 lbf.ft]"
    assert r.modes == [STANDARD, STANDARD, EEC, EEC, EEC, EEC]
    assert r.quotes_opened == 1 and [s.text for s in r.spans] == ["45 lbf.ft"]


def test_merged_bracket_tokens_are_never_emitted(toy_tok):
    # `[S`, `[[` and `2]` contain a bracket but are no trigger: banned, the next choice is taken
    r = run(toy_tok, [[" [S", " [[", "2]", " Set"], [" [Smith", " [S]", " nut"], [EOS]])
    assert r.text == " Set nut" and r.quotes_opened == 0


@pytest.mark.parametrize("exit_token,tail", [("]", ""), ("].", "."), ("],", ","), (" ]", ""), (" ])", ")")])
def test_exit_variants_close_a_quote(toy_tok, exit_token, tail):
    r = run(toy_tok, [[" ["], [" 185"], [" psi"], [exit_token], [" ok"], [EOS]])
    assert r.text == f" [ 185 psi{exit_token} ok" and r.text.endswith(f"]{tail} ok")
    assert r.modes[3] == EEC and r.modes[4] == STANDARD
    assert [s.text for s in r.spans] == ["185 psi"]


def test_inside_a_quote_the_model_can_only_copy(toy_tok):
    # the script wants ` 150` (not in the context) and then `[`: both are masked away
    r = run(toy_tok, [[" ["], [" 150", " 45", " 185"], ["[", " [", " lbf"], ["]"], [EOS]])
    assert r.text == " [ 45 lbf]"
    assert r.spans[0].sources == [(0, 18)]  # "45 lbf" in "Torque the nut to 45 lbf.ft."


def test_no_empty_quote(toy_tok):
    r = run(toy_tok, [[" ["], ["]", " ]", "].", EOS, " nut"], ["]"], [EOS]])
    assert r.text == " [ nut]"


def test_forced_close_at_a_dead_end(toy_tok):
    # the quote reaches the end of the only occurrence: `]` is written without asking the model
    r = run(toy_tok, [["["], ["ab"], ["c"], ["zz"], [EOS]], contexts=["abc"])
    assert r.text == "[abc]" and r.quotes_forced == 1
    assert r.spans[0].sources == [(0, 0)]


def test_forced_close_at_eos(toy_tok):
    # the model wants to stop inside a quote: the quote is closed and decoding goes on
    r = run(toy_tok, [[" ["], [" 185"], [EOS], [" then"], [EOS]])
    assert r.text == " [ 185] then"
    assert r.modes[2] == EEC and r.modes[3] == STANDARD


def test_forced_close_at_the_budget(toy_tok):
    r = run(toy_tok, [[" ["], [" the"], [" nut"], [" to"]], max_new_tokens=3)
    assert r.text == " [ the nut]" and r.quotes_forced == 1 and len(r.tokens) == 4


def test_a_quote_the_budget_ends_before_it_holds_a_word_is_dropped_and_never_streamed(toy_tok):
    # SmolLM2 ran out of tokens just after `[` and wrote [2] or [1.3,]: with whole-word quotes, no evidence
    script = [[" Set"], ["\n"], [" ["], ["T"], ["orque"]]
    for whole_words, budget, text in [(True, 4, " Set"), (True, 5, " Set\n [Torque]"), (False, 4, " Set\n [T]")]:
        streamed = []
        r = run(toy_tok, script, max_new_tokens=budget, whole_words=whole_words, on_token=lambda b, m: streamed.append(b))
        assert r.text == text and b"".join(streamed) == text.encode(), (whole_words, budget)
        assert r.quotes_opened == text.count("["), (whole_words, budget)  # a quote left out is not counted
        assert len(r.tokens) == len(r.modes) and toy_tok.decode(r.tokens) == text
    r = run(toy_tok, script[1:], max_new_tokens=3, whole_words=True)  # nothing but a blank before it: closed, not dropped
    assert r.text == "\n [T]" and r.quotes_forced == 1 and r.quotes_opened == 1


def test_an_answer_ends_before_the_prompts_headings_and_streams_only_what_it_keeps(toy_tok):
    # SmolLM2 on retrieved chunks went on after its answer with "\n\nPassage 6:\n..." or "\n\nQuestion: ...":
    # invented passages and questions, in free text
    contexts = ["Inflate the tyre to 185 psi.", "FAQ\nQuestion: how hot?"]
    for tail, kept in [("\n\nPassage 6:\nThe pump [ 185 psi].", ""), (" ok.\nQuestion: Q?", " ok."),
                       (" ok\nthen", " ok\nthen")]:  # a held "\n" that begins no heading is streamed in the end
        model = ScriptedModel(toy_tok, [[" ["], [" 185"], [" psi"], ["]"]], contexts)
        model.script += [[t] for t in toy_tok.encode(tail)] + [[ScriptedModel.id(toy_tok, EOS)]]
        streamed = []
        r = generate(model, toy_tok, "Q?", contexts, temperature=0, whole_words=False, no_repeat_ngram=0,
                     max_new_tokens=40, on_token=lambda b, m: streamed.append(b))
        assert r.text == " [ 185 psi]" + kept and toy_tok.decode(r.tokens) == r.text and len(r.modes) == len(r.tokens)
        assert b"".join(streamed) == r.text.encode()
    # inside a quote a heading is the passage's own text: copied, and the answer goes on
    model = ScriptedModel(toy_tok, [["["]], contexts)
    model.script += [[t] for t in toy_tok.encode("FAQ\nQuestion: how]")] + [[ScriptedModel.id(toy_tok, EOS)]]
    r = generate(model, toy_tok, "Q?", contexts, temperature=0, whole_words=False, no_repeat_ngram=0, max_new_tokens=40)
    assert r.text == "[FAQ\nQuestion: how]" and [s.text for s in r.spans] == ["FAQ\nQuestion: how"]


def test_stop_cut_keeps_the_tokens_before_a_heading_written_outside_a_quote():
    S, E = STANDARD, EEC
    assert chyd.stop_cut([b" [", b" 185", b"]\n", b"Passage", b" 6", b":"], [S, E, E, S, S, S]) == 3  # `]\n` stays
    assert chyd.stop_cut([b"]", b"\n", b"\n", b"Passage", b" "], [E, S, S, S, S]) == 1  # and the blank before goes
    assert chyd.stop_cut([b"ok", b".\nQuestion", b":"], [S, S, S]) == 1
    assert chyd.stop_cut([b"[", b"a\nPassage ", b"x", b"]"], [S, E, E, E]) is None  # in a quote: the passage's text
    assert chyd.stop_cut([b"see Passage 2 and Question: 3"], [S]) is None  # not at a line's start
    assert chyd.stop_cut([], []) is None


PIECES = [b"ok", b" ", b"\n", b"\n\n", b".\nQuestion", b"Passage", b" 6", b":", b"]\n", b"Question", b"Pass"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12))
def test_what_is_streamed_is_never_cut(pieces):
    # token by token, as Answer.step streams them after its stop check: nothing streamed is later cut by stop_cut
    modes, sent = [STANDARD] * len(pieces), 0
    for i in range(1, len(pieces) + 1):
        kept = chyd.stop_cut(pieces[:i], modes[:i])
        if kept is not None:
            assert sent <= kept, (pieces[:i], sent, kept)
            break
        sent += chyd.sendable(pieces[sent:i])
    assert chyd.sendable([b"ok", b" ", b".\nQuestion"]) == 1  # the blank before a token that may be cut waits
    assert chyd.sendable([b"[", b"FAQ\nQuestion:", b" how", b"]", b" ok"]) == 5  # a quote's heading holds nothing up


def test_the_budget_never_cuts_a_utf8_character(toy_tok):
    tok = toy_tok
    e_acute = "é".encode()
    first, second = ([i for i, b in enumerate(tok.token_bytes) if b == bytes([x])][0] for x in e_acute)
    model = ScriptedModel(tok, [["["]], ["café"])
    model.script += [[first], [second], [first]]
    r = generate(model, tok, "Q?", ["café"], temperature=0, max_new_tokens=2, whole_words=False)
    assert r.text == "[é]"


def test_no_quote_without_contexts(toy_tok):
    for contexts in ([], [""], [" \n  ", ""]):
        r = run(toy_tok, [[" [", "[", " nut"], [EOS]], contexts=contexts)
        assert r.text == " nut" and r.quotes_opened == 0


def test_contexts_with_brackets_are_quoted_up_to_the_bracket(toy_tok):
    r = run(toy_tok, [[" ["], [" nut"], [" [", "]"], [EOS]], contexts=["the nut [2] here"])
    assert r.text == " [ nut]"


def test_unconstrained_decoding_writes_what_the_model_wants(toy_tok):
    r = run(toy_tok, [[" ["], [" 150"], [" psi"], ["]"], [EOS]], constrained=False)
    assert r.text == " [ 150 psi]" and r.spans[0].sources == []


@pytest.mark.parametrize("field,value,rule", [
    ("temperature", -1.0, "a finite number >= 0"), ("temperature", float("inf"), "a finite number >= 0"),
    ("top_p", 0.0, "in (0, 1]"), ("max_new_tokens", 0, ">= 1"), ("trigger_bias", float("nan"), "a finite number"),
    ("no_repeat_ngram", -1, ">= 0"), ("repetition_penalty", 0.0, "a finite number > 0"), ("quote_search", -1, ">= 0"),
    ("no_answer_above", 1.0, "in (0, 1)"), ("batch_size", 0, ">= 1"), ("engine", "vllm", "chyd or llguidance"),
    ("prompt", "terse", "one of maintenance, reference"),
])
def test_a_bad_decoding_option_is_a_value_error_naming_it_before_anything_runs(toy_model, toy_tok, field, value, rule):
    with pytest.raises(ValueError, match=re.escape(f"{field} must be {rule}, got {value!r}")):
        generate(toy_model, toy_tok, "q?", ["a b"], **{field: value})


def test_contexts_given_as_one_string_are_refused(toy_model, toy_tok):
    with pytest.raises(TypeError, match="the contexts of question 0 must be a list of strings, got str"):
        generate(toy_model, toy_tok, "q?", "Inflate to 150 psi.")


def test_seeded_sampling_is_reproducible(toy_model, toy_tok):
    a = generate(toy_model, toy_tok, "Q?", ["the nut [2] here and there"], seed=7)
    b = generate(toy_model, toy_tok, "Q?", ["the nut [2] here and there"], seed=7)
    others = [generate(toy_model, toy_tok, "Q?", ["the nut [2] here and there"], seed=s).tokens for s in range(8, 14)]
    assert a.tokens == b.tokens and any(o != a.tokens for o in others)  # seeded, yet really sampled


def test_token_classes(toy_tok):
    c = token_classes(toy_tok, toy_tok.vocab_size)
    names = lambda mask: {toy_tok.token_bytes[i] for i in mask.nonzero().flatten().tolist()}
    assert {b"[", b" [", b" (["} <= names(c.trigger)
    assert not names(c.trigger) & {b" [S", b"[[", b" [].", b'" ]["', b'["'}
    exits = {toy_tok.token_bytes[i] for i in c.exit_ids.tolist()}
    assert {b"]", b"].", b"],", b" ]", b" ])"} <= exits and not exits & {b"2]", b" ]]", b" psi].", b'"]'}
    assert {b" [S", b"2]", b"]", b"[["} <= names(c.standard_banned) and not names(c.standard_banned) & names(c.trigger)
    assert toy_tok.token_bytes[c.close_id] == b"]" and toy_tok.token_bytes[c.open_id] == b"["
    assert token_classes(toy_tok, toy_tok.vocab_size) is c  # once per tokenizer


def test_prompt_has_system_fewshot_passages_and_question(toy_tok):
    p = build_prompt(toy_tok, "What torque?", ["Torque to 45 lbf.ft.", "Second passage."])
    assert p.startswith("<|im_start|>system\n" + chyd.SYSTEM_PROMPT)
    assert "Passage 1:\nTorque to 45 lbf.ft.\n\nPassage 2:\nSecond passage.\n\nQuestion: What torque?" in p
    for ex in chyd.load_fewshot():
        assert ex["answer"] in p
    assert p.endswith("<|im_start|>assistant\n")


def test_reference_prompt_has_its_own_instruction_and_examples(toy_tok):
    maintenance = build_prompt(toy_tok, "Which key?", ["G  Go to the end."])
    reference = build_prompt(toy_tok, "Which key?", ["G  Go to the end."], "reference")
    assert reference.startswith("<|im_start|>system\n" + chyd.REFERENCE_PROMPT) and "shortest exact phrase" in reference
    examples = chyd.load_fewshot("reference")
    for ex in examples:
        assert ex["question"] in reference and ex["question"] not in maintenance and ex["answer"] in reference
        for s in extract_spans(ex["answer"]):  # the examples' own quotes are verbatim, as the loop would write them
            assert any(s in c for c in ex["contexts"])
    assert examples[0]["answer"] == chyd.NO_ANSWER and examples[-1]["answer"].startswith("[")  # quote-first form
    assert reference.endswith("Passage 1:\nG  Go to the end.\n\nQuestion: Which key?<|im_end|>\n<|im_start|>assistant\n")
    assert build_prompt(toy_tok, "Which key?", ["G  Go to the end."], "maintenance") == maintenance


def test_the_prompt_option_reaches_the_model(toy_tok):
    seen = {}
    model = ScriptedModel(toy_tok, [])
    forward = model.forward

    def recording(tokens, *a, **k):  # the first pass is the prompt's
        seen.setdefault("prompt", toy_tok.decode(tokens[0].tolist()))
        return forward(tokens, *a, **k)

    model.forward = recording
    generate(model, toy_tok, "Q?", ["Some passage."], temperature=0, max_new_tokens=2, prompt="reference")
    assert chyd.REFERENCE_PROMPT in seen["prompt"] and chyd.SYSTEM_PROMPT not in seen["prompt"]


def test_a_quote_first_answer_is_shown_examples_that_open_with_their_quotes(toy_tok):
    for prompt in chyd.PROMPTS:
        shown = build_prompt(toy_tok, "Q?", ["x"], prompt, quote_first=True)
        for ex in chyd.load_fewshot(prompt):
            answer = ex.get("answer_quote_first", ex["answer"])
            assert answer in shown and (answer == chyd.NO_ANSWER or answer.startswith("["))
            assert extract_spans(answer) == extract_spans(ex["answer"])  # the same quotes, verbatim in the example
    seen = []
    model = ScriptedModel(toy_tok, [])
    forward = model.forward

    def recording(tokens, *a, **k):
        if tokens.shape[1] > 1:  # a prompt's pass
            seen.append(toy_tok.decode(tokens[0].tolist()))
        return forward(tokens, *a, **k)

    model.forward = recording
    for quote_first in (True, False):
        generate(model, toy_tok, "Q?", ["Some passage."], temperature=0, max_new_tokens=2, quote_first=quote_first)
    assert "\n[2 minutes before you read the reservoir level]." in seen[0] and "The pump must run" not in seen[0]
    assert "The pump must run for [2 minutes before you read the reservoir level]." in seen[1]


def test_too_long_a_prompt_names_both_sizes(toy_tok):
    model = ScriptedModel(toy_tok, [])
    model.config.max_position_embeddings = 100
    with pytest.raises(ValueError, match=r"prompt of \d+ tokens plus 30 new tokens exceeds the model's window of 100"):
        generate(model, toy_tok, "Q?", ["x " * 50], max_new_tokens=30)


# The real model, through our loop and through transformers' generate with our LogitsProcessor.
QUESTIONS = ["What is the nominal inflation pressure of the main wheel tyres?",
             "What torque is applied to the axle nut first?",
             "How long after engine shutdown is the oil level checked?"]


def manual_passages():
    return [p for p in (chyd.DATA / "manual.txt").read_text().split("\n\n") if p.strip()]


@pytest.mark.parametrize("question", QUESTIONS)
def test_logits_processor_in_transformers_generate_gives_our_tokens(smollm2, hf_smollm2, question):
    model, tok = smollm2
    hf, _ = hf_smollm2
    contexts = manual_passages()
    ours = generate(model, tok, question, contexts, temperature=0, max_new_tokens=40, trigger_bias=9.0, whole_words=False,
                    no_repeat_ngram=0, quote_first=False, quote_search=0)  # the processor's rules: the paper's alone
    assert ours.quotes_opened >= 1
    prompt = tok.encode(build_prompt(tok, question, contexts))
    constraint = Constraint(token_classes(tok, model.config.vocab_size), contexts, trigger_bias=9.0)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                      logits_processor=[ChydLogitsProcessor(constraint, len(prompt))])
    theirs = [t for t in out[0, len(prompt):].tolist() if t not in tok.eos_ids]
    n = len(theirs)
    assert theirs == ours.tokens[:n] and n >= len(ours.tokens) - 1  # ours may add a budget close


def test_quote_first_opens_the_answer_with_a_verbatim_quote(toy_model, toy_tok):
    contexts = ["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft.", "Inflate to 185 psi."]
    for seed in range(30):
        r = generate(toy_model, toy_tok, "Q?", contexts, seed=seed, max_new_tokens=20, quote_first=True)
        assert r.text.startswith("[") and r.modes[0] == STANDARD and r.modes[1] == EEC
        assert r.spans and r.text.index("]") > 1 and any(r.spans[0].text in c for c in contexts)
        check_answer(r, contexts)


def test_quote_first_keeps_no_answer_when_the_model_prefers_it(toy_tok):
    r = run(toy_tok, [["No", " Set"], [" answer"], [" then"]], quote_first=True)
    assert r.text == "No answer" and r.quotes_opened == 0
    # the same model, once "No answer" is not its likeliest start, must quote
    r = run(toy_tok, [[" Set", "No"], [" answer"], [" then"]], quote_first=True)
    assert r.text.startswith("[") and r.quotes_opened == 1
    # and without passages there is nothing to quote: the model's own answer
    r = run(toy_tok, [[" Set", "No"], [" then"], [EOS]], quote_first=True, contexts=[])
    assert r.text == " Set then"


def test_quote_first_abstains_where_no_answer_is_above_the_threshold(toy_tok):
    script = [[" Set", "No"], [" answer"], [" then"]]  # "No answer" second at its first token: p about 0.27
    model, no_answer = ScriptedModel(toy_tok, script, quote_first=True), toy_tok.encode(chyd.NO_ANSWER)
    positions = torch.arange(len(no_answer)) + model.prompt_len - 1  # the prompt's last token, then "No answer"'s
    logp = torch.log_softmax(model(torch.tensor([no_answer]), positions)[0], -1)
    p = float(logp[torch.arange(len(no_answer)), no_answer].sum().exp())
    assert 0.05 < p < 0.5
    assert run(toy_tok, script, quote_first=True).text.startswith("[")  # below the model's default, 1/2
    assert run(toy_tok, script, quote_first=True, no_answer_above=p * 1.01).text.startswith("[")
    r = run(toy_tok, script, quote_first=True, no_answer_above=p * 0.99)
    assert r.text == chyd.NO_ANSWER and r.quotes_opened == 0


def test_trigger_bias_raises_the_quote_rate_and_never_the_violations(toy_tok):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=toy_tok.vocab_size, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                      intermediate_size=64, max_position_embeddings=4096)
    model = BiasedToy(cfg, torch.zeros(toy_tok.vocab_size)).eval()  # no bracket bias of its own
    contexts = ["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft."]
    rates = []
    for bias in (-5.0, 0.0, 5.0):
        results = [generate(model, toy_tok, "Q?", contexts, seed=s, max_new_tokens=16, trigger_bias=bias, temperature=1.0)
                   for s in range(30)]
        for r in results:
            check_answer(r, contexts)
        rates.append(sum(r.quotes_opened for r in results) / len(results))
    assert rates[0] <= rates[1] < rates[2], rates


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(contexts=st.lists(context_text, min_size=1, max_size=3), seed=st.integers(0, 2**16),
       quote_first=st.booleans(), lookup=st.booleans(), constrained=st.booleans())
def test_greedy_speculation_gives_the_same_tokens(toy_model, toy_tok, contexts, seed, quote_first, lookup, constrained):
    kw = dict(temperature=0.0, max_new_tokens=24, seed=seed, quote_first=quote_first, constrained=constrained)
    plain = generate(toy_model, toy_tok, "Q?", contexts, speculate=False, **kw)
    fast = generate(toy_model, toy_tok, "Q?", contexts, speculate=True, lookup=lookup, **kw)
    assert fast.tokens == plain.tokens and fast.modes == plain.modes
    if not lookup:  # a lookup draft can be rejected at its first token: a pass that gains nothing
        assert fast.forward_passes <= plain.forward_passes


def test_speculation_drafts_the_context_and_saves_passes(toy_tok):
    # the script copies the context token by token: every draft is accepted
    script = [[" ["], [" Torque"], [" the"], [" axle"], [" nut"], [" to"], [" 45"], [" lbf"], [".ft"], ["]"], [EOS]]
    contexts = ["Now Torque the axle nut to 45 lbf.ft now."]
    plain = run(toy_tok, script, contexts=contexts, speculate=False)
    fast = run(toy_tok, script, contexts=contexts, speculate=True)
    assert fast.text == plain.text and fast.text.startswith(" [") and "lbf.ft]" in fast.text
    assert fast.forward_passes < plain.forward_passes - 3


@pytest.mark.parametrize("constrained", [True, False])
def test_lookup_drafts_the_answers_continuation_outside_quotes(toy_tok, constrained):
    # free text that copies the context: after two tokens every lookup draft is accepted
    script = [[" Torque"], [" the"], [" axle"], [" nut"], [" to"], [" 45"], [" lbf"], [".ft"], [","], [" then"], [EOS]]
    contexts = ["Now Torque the axle nut to 45 lbf.ft, then stop."]
    plain = run(toy_tok, script, contexts=contexts, constrained=constrained, lookup=False)
    fast = run(toy_tok, script, contexts=contexts, constrained=constrained, lookup=True)
    assert fast.text == plain.text == " Torque the axle nut to 45 lbf.ft, then"
    assert set(fast.modes) == {STANDARD}
    assert plain.forward_passes == len(plain.tokens) + 1
    assert fast.forward_passes <= plain.forward_passes - 5


def test_sampled_speculation_has_the_same_distribution(toy_model, toy_tok):
    from collections import Counter
    from scipy.stats import chi2_contingency

    contexts = ["abab abba baab aabb abab", "the nut the bolt the nut"]
    outcomes = {}
    for spec in (False, True):
        seqs = [tuple(generate(toy_model, toy_tok, "Q?", contexts, temperature=1.0, top_p=0.95, max_new_tokens=4,
                               seed=s, quote_first=True, speculate=spec, whole_words=False).tokens[:4]) for s in range(600)]
        outcomes[spec] = Counter(seqs)
    keys = [k for k in set(outcomes[False]) | set(outcomes[True]) if outcomes[False][k] + outcomes[True][k] >= 10]
    assert len(keys) >= 4  # the answers vary, so the test can see a difference
    table = [[outcomes[s][k] for k in keys] for s in (False, True)]
    _, p, _, _ = chi2_contingency(table)
    assert p > 0.001, (p, table)


def test_speculation_on_smollm2_gives_the_same_tokens_in_fewer_passes(smollm2):
    import json

    model, tok = smollm2
    data = [json.loads(l) for l in (chyd.DATA / "sample_eval.jsonl").read_text().splitlines()][:6]
    plain_passes = fast_passes = 0
    for ex in data:
        kw = dict(temperature=0, max_new_tokens=40, quote_first=True, quote_search=0)  # a searched quote is verified whole
        plain = generate(model, tok, ex["question"], ex["contexts"], speculate=False, **kw)
        fast = generate(model, tok, ex["question"], ex["contexts"], speculate=True, lookup=True, **kw)
        assert fast.tokens == plain.tokens, ex["id"]
        plain_passes, fast_passes = plain_passes + plain.forward_passes, fast_passes + fast.forward_passes
    assert fast_passes < 0.8 * plain_passes
    plain_passes = fast_passes = 0
    for ex in data[:3]:  # free decoding: lookup drafts alone
        kw = dict(temperature=0, max_new_tokens=40, constrained=False)
        plain = generate(model, tok, ex["question"], ex["contexts"], **kw)
        fast = generate(model, tok, ex["question"], ex["contexts"], lookup=True, **kw)
        assert fast.tokens == plain.tokens, ex["id"]
        plain_passes, fast_passes = plain_passes + plain.forward_passes, fast_passes + fast.forward_passes
    assert fast_passes < 0.8 * plain_passes


def test_no_repeat_ngram_breaks_a_loop_outside_quotes(toy_tok):
    # a model that wants " the nut" again and again, and " to" second best
    script = [[" the"], [" nut"]] * 6 + [[EOS]]
    script = [step + [" to"] for step in script]
    looped = run(toy_tok, script, max_new_tokens=13)
    assert looped.text == " the nut" * 6
    broken = run(toy_tok, script, max_new_tokens=5, no_repeat_ngram=2)
    assert broken.text == " the nut the to the"  # " the nut" again is banned, " nut the" was new
    assert len(set(zip(broken.tokens, broken.tokens[1:]))) == 4  # no bigram twice


def test_no_repeat_ngram_is_not_evaded_by_blanks_between_repeats(toy_tok):
    # " the nut" again and again, one more blank between each: no trigram of tokens repeats, a trigram of words does
    script = [[" the"], [" nut"], [" "], [" the"], [" nut"], ["  "], [" the", " to"], [" nut"], [EOS]]
    looped = run(toy_tok, script, no_repeat_ngram=0)
    assert looped.text == " the nut  the nut   the nut"
    broken = run(toy_tok, script, no_repeat_ngram=3)
    assert broken.text.startswith(" the nut  the nut   to")  # " the nut the" a second time is banned


def test_no_repeat_ngram_follows_transformers(toy_model, toy_tok):
    from transformers import NoRepeatNGramLogitsProcessor

    tokens = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = torch.randn(toy_tok.vocab_size)
    exempt = torch.zeros(toy_tok.vocab_size, dtype=torch.bool)
    for n in (1, 2, 3):
        expected = NoRepeatNGramLogitsProcessor(n)(torch.tensor([tokens]), logits[None].clone())[0]
        assert torch.equal(chyd.discourage_repeats(logits, tokens, n, 1.0, exempt), expected)


def test_repetition_penalty_follows_transformers_and_spares_triggers(toy_tok):
    from transformers import RepetitionPenaltyLogitsProcessor

    open_id = ScriptedModel.id(toy_tok, "[")
    tokens = [5, 9, 9, 30, open_id]
    logits = torch.randn(toy_tok.vocab_size)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([tokens[:-1]]), logits[None].clone())[0]
    exempt = torch.zeros(toy_tok.vocab_size, dtype=torch.bool)
    exempt[open_id] = True
    got = chyd.discourage_repeats(logits, tokens, 0, 1.3, exempt)
    assert torch.equal(got, expected) and got[open_id] == logits[open_id]


def test_inside_a_quote_the_passage_decides_not_the_penalties(toy_tok):
    # the quote repeats " nut" of the free text before it; the ban and the penalty leave it alone
    script = [[" nut"], [" ["], [" nut"], [" to"], [" 45"], ["]"], [EOS]]
    r = run(toy_tok, script, no_repeat_ngram=1, repetition_penalty=5.0)
    assert r.text == " nut [ nut to 45]"


questions = st.sampled_from(["Q?", "What torque is the axle nut tightened to at first, and then?", "é 東?"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(st.tuples(questions, st.lists(context_text, min_size=1, max_size=3)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16), speculate=st.booleans(), lookup=st.booleans(), quote_first=st.booleans(),
       whole_words=st.booleans(), batch_size=st.sampled_from([None, 1, 2, 3]))
def test_a_batch_gives_the_answers_of_batch_one(toy_model, toy_tok, batch, seed, speculate, lookup, quote_first, whole_words,
                                                 batch_size):
    kw = dict(temperature=0.0, max_new_tokens=20, seed=seed, speculate=speculate, lookup=lookup,
              quote_first=quote_first, whole_words=whole_words, no_repeat_ngram=3)
    # batch_size below the number of questions: rows that end are refilled with the next questions
    together = chyd.generate_batch(toy_model, toy_tok, [q for q, _ in batch], [c for _, c in batch],
                                   batch_size=batch_size, **kw)
    for (q, contexts), r in zip(batch, together):
        alone = generate(toy_model, toy_tok, q, contexts, **kw)
        assert r.tokens == alone.tokens and r.modes == alone.modes and r.text == alone.text
        assert r.quotes_opened == alone.quotes_opened and r.quotes_forced == alone.quotes_forced
        check_answer(r, contexts)


def test_sampled_batches_are_reproducible_per_seed(toy_model, toy_tok):
    qs = ["Q?", "What torque is the axle nut tightened to?", "Why?"]
    ctx = [["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft."], ["ab [x] ab"], ["psi 185 psi"]]
    runs = [chyd.generate_batch(toy_model, toy_tok, qs, ctx, temperature=1.0, seed=s, max_new_tokens=16) for s in (7, 7, 8)]
    texts = [[r.text for r in run] for run in runs]
    assert texts[0] == texts[1] and texts[0] != texts[2]
    # a row is sampled with the seed it would have alone
    assert texts[0] == [generate(toy_model, toy_tok, q, c, temperature=1.0, seed=7, max_new_tokens=16).text
                        for q, c in zip(qs, ctx)]


def test_a_batch_on_smollm2_gives_the_answers_of_batch_one(smollm2):
    import json

    model, tok = smollm2
    data = [json.loads(l) for l in (chyd.DATA / "sample_eval.jsonl").read_text().splitlines()[:4]]
    kw = dict(temperature=0.0, max_new_tokens=24, quote_first=True, whole_words=True)
    together = chyd.generate_batch(model, tok, [e["question"] for e in data], [e["contexts"] for e in data], **kw)
    for e, r in zip(data, together):
        assert r.tokens == generate(model, tok, e["question"], e["contexts"], **kw).tokens, e["id"]
    assert sum(len(r.spans) for r in together) >= 2


def grammar_matcher(tok, contexts, quote_first=False, whole_words=False):
    import llguidance

    from constraint import lark_grammar

    llt = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size, eos_token=min(tok.eos_ids))
    m = llguidance.LLMatcher(llt, lark_grammar(contexts, quote_first, whole_words), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(contexts=st.lists(context_text, min_size=1, max_size=3), seed=st.integers(0, 2**16),
       temperature=st.sampled_from([0.0, 1.0]), quote_first=st.booleans(), whole_words=st.booleans())
def test_the_lark_grammar_accepts_every_answer_of_our_decoder(text_toy_model, toy_tok, contexts, seed, temperature,
                                                              quote_first, whole_words):
    r = generate(text_toy_model, toy_tok, "Q?", contexts, temperature=temperature, max_new_tokens=24, seed=seed,
                 trigger_bias=3.0, quote_first=quote_first, whole_words=whole_words)
    # outside quotes ours may write a special token or bytes that are no UTF-8 (a random toy model does), a grammar not;
    # a quote that the budget closed may end mid-word, where the grammar's engine would have stopped
    text = b"".join(toy_tok.token_bytes[t] for t in r.tokens)
    assume(not any(t in toy_tok.special_ids for t in r.tokens) and utf8_valid(text))
    assume(not (whole_words and len(r.tokens) >= 24 and r.modes[-1] == EEC))
    # a quote of blank characters alone ("\x85", reached through a token that ends inside it), closed at a dead end:
    # verbatim, but no quote to the grammar, which asks for a non-blank one (left as it is: README, the rules)
    assume(all(q.strip() for q in re.findall(r"\[([^\[\]]*)\]", r.text)))
    m = grammar_matcher(toy_tok, contexts, quote_first, whole_words)
    assert m.consume_tokens(r.tokens), (r.text, m.get_error())
    assert m.is_accepting(), r.text


def utf8_valid(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_the_lark_grammar_accepts_smollm2s_answers(smollm2):
    import json

    model, tok = smollm2
    data = [json.loads(l) for l in (chyd.DATA / "sample_eval.jsonl").read_text().splitlines()[:8]]
    quotes = 0
    for e in data:
        r = generate(model, tok, e["question"], e["contexts"], temperature=0.0, max_new_tokens=32, quote_first=True)
        m = grammar_matcher(tok, e["contexts"], quote_first=True)
        assert m.consume_tokens(r.tokens) and m.is_accepting(), (e["id"], r.text, m.get_error())
        quotes += len(r.spans)
    assert quotes >= 4


def test_the_lark_grammar_rejects_what_is_not_verbatim(toy_tok):
    contexts = ["Torque the nut to 45 lbf.ft [see note] then 30.", "Inflate to 185 psi."]
    ok = ["The nut [45 lbf.ft] and [185 psi].", "[see note]", "x [ then 30.] y", "no quote"]
    bad = ["[45 lbf.ft [see]", "[200 psi]", "[]", "[ ]", "[lbf.ft] [see note] then]", "x ] y", "[Inflate to 185 psi. Torque]"]
    for text in ok + bad:
        m = grammar_matcher(toy_tok, contexts)
        accepted = m.consume_tokens(toy_tok.encode(text)) and m.is_accepting()
        assert accepted == (text in ok), text
    m = grammar_matcher(toy_tok, [" ", "[]", "   "])
    assert not m.consume_tokens(toy_tok.encode("[ ]"))  # nothing to quote: no `[`


def test_the_whole_words_grammar_keeps_our_rules(toy_tok):
    contexts = ["Torque the nut to 45 lbf.ft [see note] then 30, at 1 psi.", "Naïve café 東京 ok", "a 1 [,]", "00\x85 zz\u3000",
                "zR -y [12] C-b, -6 [-x 7] é1"]
    ok = ["[Torque the nut]", "[ the nut to 45]", "[45 lbf.ft]", "[lbf]", "[see note]", "[Naïve café]", "[東京]", "[京 ok]",
          "[30, at]", "[30,]", "[at 1]", "x [then 30, at 1 psi.] y", "[Naïve]", "[ok]", "[zR]", "[ -y]", "[C-b]", "[-6]",
          "[-x]", "[é1]", "[zz\u3000]"]  # terms; blank as str.strip() has it
    bad = ["[orque]", "[the nu]", "[1]", "[,]", "[ 1 ]", "[a 1]", "[ïve]", "[東]", "[45 lbf.ft [see]", "[200 psi]",
           "[00\x85]", "[12]", "[C-]", "[-]", "[R]", "[-x 7]", "[7]"]  # blank as str.strip() has it
    for text in ok + bad:
        m = grammar_matcher(toy_tok, contexts, whole_words=True)
        accepted = m.consume_tokens(toy_tok.encode(text)) and m.is_accepting()
        assert accepted == (text in ok), text
        quotes = re.findall(r"\[([^\[\]]*)\]", text)
        if text.count("[") == len(quotes):  # the tests' own oracle agrees where it can read the quotes
            assert accepted == all(on_word_boundaries(q, contexts) for q in quotes), text
    # where ours can start no quote (no word and no term ahead), quote-first leaves the grammar "No answer" or text
    m = grammar_matcher(toy_tok, ["a 1 [,] b"], quote_first=True, whole_words=True)
    assert m.consume_tokens(toy_tok.encode("a")) and not Constraint(token_classes(toy_tok, toy_tok.vocab_size),
                                                                    ["a 1 [,] b"], whole_words=True).can_quote


@pytest.mark.parametrize("whole_words", [False, True])
def test_random_walks_under_the_grammar_quote_verbatim(toy_tok, whole_words):
    import llguidance.torch as lt

    contexts = ["Torque the axle nut to 45 lbf.ft [see note], then é東 to 30.", "ab [x] ab"]
    gen = torch.Generator().manual_seed(0)
    quotes = 0
    for walk in range(30):
        m = grammar_matcher(toy_tok, contexts, whole_words=whole_words)
        mask = lt.allocate_token_bitmask(1, toy_tok.vocab_size)
        tokens = []
        for _ in range(30):
            lt.fill_next_token_bitmask(m, mask, 0)
            logits = torch.zeros(1, toy_tok.vocab_size)
            for b in ("[", "]", " ["):  # push the walk into quotes
                logits[0, ScriptedModel.id(toy_tok, b)] = 3.0
            lt.apply_token_bitmask_inplace(logits, mask)
            t = int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen))
            if t in toy_tok.eos_ids:
                break
            assert m.consume_token(t)
            tokens.append(t)
        text = toy_tok.decode(tokens)
        spans = re.findall(r"\[([^\[\]]*)\]", text)
        quotes += len(spans)
        assert all(s.strip() and any(s.rstrip() in c for c in contexts) for s in spans), text  # `]` may follow blanks
        assert not whole_words or all(on_word_boundaries(s, contexts) for s in spans), text
    assert quotes >= 20


@pytest.mark.parametrize("whole_words", [False, True])
def test_the_llguidance_engine_gives_our_greedy_answers_where_the_languages_agree(smollm2, whole_words):
    import json

    model, tok = smollm2
    classes = token_classes(tok, model.config.vocab_size)
    closing = lambda t: t == classes.close_id or bool((classes.exit_ids == t).any()) or not tok.token_bytes[t].strip()
    data = [json.loads(l) for l in (chyd.DATA / "sample_eval.jsonl").read_text().splitlines()[:12]]
    same = 0
    for e in data:
        kw = dict(temperature=0.0, max_new_tokens=48, quote_first=True, whole_words=whole_words, quote_search=0)
        ours = generate(model, tok, e["question"], e["contexts"], **kw)
        theirs = generate(model, tok, e["question"], e["contexts"], engine="llguidance", **kw)
        check_answer(theirs, e["contexts"])
        if ours.tokens == theirs.tokens:
            same += 1
            continue
        # they part only where a quote closes: ours writes `]` at a dead end and folds a stop token's probability
        # into `]`, the grammar lets the model close with whitespace first
        i = next(i for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)) if a != b)
        assert ours.modes[i] == EEC and closing(ours.tokens[i]) and closing(theirs.tokens[i]), (e["id"], ours.text, theirs.text)
    assert same >= 8


def test_the_prompts_shared_start_is_prefilled_once_and_reused(toy_model, toy_tok, monkeypatch):
    monkeypatch.setitem(chyd.PREFIXES, toy_model, OrderedDict())
    contexts = [["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft."], ["ab [x] ab"], ["psi 185 psi"]]
    kw = dict(temperature=0.0, max_new_tokens=16, quote_first=True)
    prompts = [toy_tok.encode(build_prompt(toy_tok, f"Q{i}?", c, quote_first=True)) for i, c in enumerate(contexts)]
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)  # the system message and examples
    assert shared > len(prompts[0]) / 2
    found = []
    monkeypatch.setattr(chyd, "reuse_prefix", lambda *a: found.append(real_reuse_prefix(*a)) or found[-1])
    reused = [generate(toy_model, toy_tok, f"Q{i}?", c, **kw) for i, c in enumerate(contexts)]
    # the first prompt prefilled whole, the others from the block in which they part
    assert found == [0] + 2 * [shared // chyd.PREFIX_BLOCK * chyd.PREFIX_BLOCK]
    toy_model.setup_cache(4, toy_model.max_seq_len)  # an empty cache: the start must come from the kept blocks
    together = chyd.generate_batch(toy_model, toy_tok, [f"Q{i}?" for i in range(3)], contexts, **kw)
    monkeypatch.setattr(chyd, "reuse_prefix", lambda *a: 0)
    whole = [generate(toy_model, toy_tok, f"Q{i}?", c, **kw) for i, c in enumerate(contexts)]
    assert [r.tokens for r in whole] == [r.tokens for r in reused] == [r.tokens for r in together]


real_forward_hidden, real_reuse_prefix = chyd.forward_hidden, chyd.reuse_prefix


def test_the_blocks_kept_are_the_most_recently_used_and_a_block_goes_before_its_start(toy_model, monkeypatch):
    B = chyd.PREFIX_BLOCK
    monkeypatch.setattr(chyd, "PREFIX_TOKENS_KEPT", 3 * B)
    monkeypatch.setitem(chyd.PREFIXES, toy_model, OrderedDict())
    chyd.ensure_cache(toy_model, 1, 256)
    a, b, c = ([t] * (n * B + 1) for t, n in ((5, 2), (6, 1), (7, 1)))  # whole blocks and one token to prefill
    keys = {name: [k for _, k in chyd.prefix_keys(p, len(p))] for name, p in (("a", a), ("b", b), ("c", c))}
    with torch.inference_mode():  # as generate's
        for p in (a, b, a):
            chyd.prefill(toy_model, p)
        assert list(chyd.PREFIXES[toy_model]) == keys["b"] + keys["a"][::-1]  # a used last; its start after its end
        assert chyd.reuse_prefix(toy_model, a) == 2 * B
        chyd.prefill(toy_model, c)  # over the budget: b, the least recently used, goes
        assert list(chyd.PREFIXES[toy_model]) == keys["a"][::-1] + keys["c"]
        chyd.prefill(toy_model, b)  # then a's second block, before its first
        assert list(chyd.PREFIXES[toy_model]) == keys["a"][:1] + keys["c"] + keys["b"]
        assert chyd.reuse_prefix(toy_model, a) == B


def test_a_prompt_reuses_the_blocks_it_shares_with_an_earlier_one(toy_model, toy_tok, monkeypatch):
    monkeypatch.setitem(chyd.PREFIXES, toy_model, OrderedDict())
    chyd.ensure_cache(toy_model, 3, 256)
    evidence = toy_tok.encode("Passage: torque the axle nut to 45 lbf.ft, then to 30 lbf.ft. " * 3)
    strict, soft = evidence + toy_tok.encode(" Use only the passage. Q?"), evidence + toy_tok.encode(" Use anything. Q?")
    common = next(i for i, (a, b) in enumerate(zip(strict, soft)) if a != b)  # the evidence and " Use"
    start = common // chyd.PREFIX_BLOCK * chyd.PREFIX_BLOCK
    computed = []
    monkeypatch.setattr(chyd, "forward_hidden", lambda *a: computed.append(a[1]) or real_forward_hidden(*a))
    with torch.inference_mode():
        last_strict = chyd.prefill(toy_model, strict, row=2)
        last_soft = chyd.prefill(toy_model, soft, row=1)  # strict's blocks, copied into row 1
        alone = [real_forward_hidden(toy_model, p, 0)[-1] for p in (strict, soft)]
    assert start >= 2 * chyd.PREFIX_BLOCK and computed == [strict, soft[start:]]
    assert torch.allclose(last_strict[0], alone[0], atol=1e-5) and torch.allclose(last_soft[0], alone[1], atol=1e-5)


def test_a_stream_yields_each_answer_once_as_it_ends(toy_model, toy_tok):
    qs = [f"Q{i}?" for i in range(5)]
    contexts = [["Torque the axle nut to 45 lbf.ft."], ["ab [x] ab"], ["psi 185 psi"], ["Inflate with nitrogen."], ["x"]]
    ends = list(chyd.generate_stream(toy_model, toy_tok, qs, contexts, batch_size=2, temperature=0.0, max_new_tokens=12))
    assert sorted(i for i, _ in ends) == list(range(5))
    assert [len(r.tokens) for _, r in ends] == [len(generate(toy_model, toy_tok, qs[i], contexts[i], temperature=0.0,
                                                                max_new_tokens=12).tokens) for i, _ in ends]
    alone = list(chyd.generate_stream(toy_model, toy_tok, qs, contexts, batch_size=1, temperature=0.0, max_new_tokens=12))
    assert [i for i, _ in alone] == list(range(5))  # a batch of one: in order


def test_a_larger_batch_does_not_lengthen_the_cache(toy_model):
    toy_model.setup_cache(1, 100)
    chyd.ensure_cache(toy_model, 16, 90)  # more rows, as long: the length stays
    assert (toy_model.max_batch_size, toy_model.max_seq_len) == (16, 100)
    chyd.ensure_cache(toy_model, 2, 150)  # longer: doubled at least, the rows kept
    assert (toy_model.max_batch_size, toy_model.max_seq_len) == (16, 200)


def opened_quote(model, tok, contexts, width, whole_words=True, max_new_tokens=24, quote_first=False):
    """An Answer to "Q?" whose first token, `[`, has just opened a quote, its prompt in cache row 0 (its examples
    quote-first with quote_first) and the cache with 2 * `width` rows to spare for the beam and its contrast's."""
    prompt = tok.encode(build_prompt(tok, "Q?", contexts, quote_first=quote_first))
    chyd.ensure_cache(model, 1 + 2 * width, len(prompt) + max_new_tokens + 16)  # the beam's rows and its contrast's
    o = chyd.DecodeOptions(temperature=0, quote_first=False, whole_words=whole_words, quote_search=width,
                           max_new_tokens=max_new_tokens)
    a = chyd.Answer(model, tok, prompt, contexts, o)
    with torch.inference_mode():
        chyd.prefill(model, prompt, 0)
    a.emit(a.classes.open_id, STANDARD)
    return a


def span_text(tok, span):
    return b"".join(tok.token_bytes[t] for t in span).decode()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(contexts=st.lists(context_text, min_size=1, max_size=3), width=st.integers(1, 4), whole_words=st.booleans())
def test_quote_search_proposes_only_real_spans(toy_model, toy_tok, contexts, width, whole_words):
    a = opened_quote(toy_model, toy_tok, contexts, width, whole_words)
    assume(a.constraint.can_quote)
    found = chyd.quote_candidates(toy_model, a, 0, width)
    exits = set(a.classes.exit_ids.tolist())
    for span, score in found:
        text = span_text(toy_tok, span[:-1])  # the span, then its exit token
        assert span[-1] in exits and span[:-1]
        assert any(text in c for c in contexts), (text, contexts)  # verbatim, in the suffix tree's contexts
        assert text.strip() and score <= 0
        if whole_words:
            assert on_word_boundaries(text, contexts), text
    assert a.constraint.quote == b"" and a.constraint.mode == EEC  # the answer's own rules untouched


def span_log_probs(model, prompt, answer, span, ends) -> list[float]:
    """The log-probability of each of span's tokens after prompt and answer (whose last token is the trigger), then
    that of the quote's end, from one forward pass from scratch (no cache reused)."""
    tokens = prompt + answer + span
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([tokens]), torch.arange(len(tokens)))[0].float(), -1)
    start = len(prompt) + len(answer) - 1  # the trigger's position: its logits predict the span's first token
    return [float(logp[start + i, t]) for i, t in enumerate(span)] + [float(torch.logsumexp(logp[start + len(span), ends], 0))]


@pytest.mark.parametrize("contexts,width", [(["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft."], 3),
                                            (["Inflate the tyre to 185 psi.", "psi [S] nut é 東京"], 4)])
@pytest.mark.parametrize("with_contrast", [False, True])
def test_quote_search_scores_are_those_of_a_full_forward_pass(toy_model, toy_tok, contexts, width, with_contrast):
    a = opened_quote(toy_model, toy_tok, contexts, width)
    contrast = toy_tok.encode(build_prompt(toy_tok, "", contexts)) if with_contrast else None
    # the prompt's start (all of it, or what the contrast shares) is read from row 0, not copied into every row:
    # there the spare rows hold NaN, which a read would spread to the scores
    common = a.pos if contrast is None else len(os.path.commonprefix([a.prompt, contrast]))
    caches = [layer.attention.kv_cache for layer in toy_model.layers]
    for c in caches:
        c.k[1:, :, :common], c.v[1:, :, :common] = float("nan"), float("nan")
    found = chyd.quote_candidates(toy_model, a, 0, width, contrast)
    written = [r for r in range(1, toy_model.max_batch_size) if not caches[0].k[r, :, :common].isnan().all()]
    for c in caches:  # none left for the tests to come, which share the model
        c.k.nan_to_num_(0.0), c.v.nan_to_num_(0.0)
    assert len(found) >= 2
    assert len(written) == (contrast is not None)  # the contrast's one row, before its end is computed after it
    ends = torch.cat([a.classes.exit_ids, a.classes.stop_ids])
    for span, score in found:
        span = span[:-1]  # the exit token is not scored: the quote's end is, by every exit and stop token
        terms = span_log_probs(toy_model, a.prompt, a.tokens, span, ends)
        if contrast is not None:  # less a share of the same span's log-probability after the prompt without its question
            terms = [t - chyd.QUOTE_CONTRAST * c for t, c in zip(terms, span_log_probs(toy_model, contrast, a.tokens, span, ends))]
        expected = sum(terms) / len(terms) ** chyd.QUOTE_LENGTH_ALPHA
        assert score == pytest.approx(expected, abs=1e-4), span_text(toy_tok, span)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(contexts=st.lists(context_text, min_size=1, max_size=3), seed=st.integers(0, 2**16), width=st.integers(1, 3),
       batch_size=st.sampled_from([None, 1, 2]))
def test_quote_search_writes_its_best_span_verbatim_through_the_loop(toy_model, toy_tok, contexts, seed, width, batch_size):
    kw = dict(temperature=0.0, max_new_tokens=24, seed=seed, quote_first=True, quote_search=width)
    r = generate(toy_model, toy_tok, "Q?", contexts, **kw)
    check_answer(r, contexts)
    if r.text.startswith("["):  # the first quote is the best candidate the beam found for it
        a = opened_quote(toy_model, toy_tok, contexts, width, quote_first=True)
        contrast = toy_tok.encode(build_prompt(toy_tok, "", contexts, quote_first=True))  # the prompt without "Q?"
        found = chyd.quote_candidates(toy_model, a, 0, width, contrast)
        if found:
            best = span_text(toy_tok, max(found, key=lambda f: f[1])[0])  # the span and its exit
            assert r.text.startswith(f"[{best}"), (r.text, best)
    # in a batch each answer is the one it is alone
    together = chyd.generate_batch(toy_model, toy_tok, ["Q?", "Why?"], [contexts, contexts], batch_size=batch_size, **kw)
    assert together[0].tokens == r.tokens


def test_quote_search_weighs_spans_against_the_prompt_without_its_question(toy_model, toy_tok, monkeypatch):
    contexts, seen, search = ["Inflate the tyre to 185 psi.", "Torque the axle nut to 45 lbf.ft."], [], chyd.quote_candidates

    def recording(model, answer, row, width, contrast=None):
        seen.append((answer.prompt, contrast))
        return search(model, answer, row, width, contrast)

    monkeypatch.setattr(chyd, "quote_candidates", recording)
    generate(toy_model, toy_tok, "What pressure?", contexts, temperature=0, quote_first=True, max_new_tokens=12, quote_search=2)
    without = toy_tok.encode(build_prompt(toy_tok, "", contexts, quote_first=True))
    assert seen and all(contrast == without != prompt for prompt, contrast in seen)


def test_quote_search_off_leaves_greedy_answers_alone(toy_model, toy_tok, monkeypatch):
    contexts = ["Torque the axle nut to 45 lbf.ft, then to 30 lbf.ft.", "Inflate the tyre to 185 psi."]
    before = [generate(toy_model, toy_tok, q, contexts, temperature=0, quote_first=True, max_new_tokens=24)
              for q in ("Q?", "Why?", "What torque?")]
    searched = [generate(toy_model, toy_tok, q, contexts, temperature=0, quote_first=True, max_new_tokens=24, quote_search=3)
                for q in ("Q?", "Why?", "What torque?")]
    assert [r.text for r in searched] != [r.text for r in before]  # the lever does something here

    def never(*args):
        raise AssertionError("quote search ran with quote_search=0")

    monkeypatch.setattr(chyd, "quote_candidates", never)
    after = [generate(toy_model, toy_tok, q, contexts, temperature=0, quote_first=True, max_new_tokens=24)
             for q in ("Q?", "Why?", "What torque?")]
    assert [r.tokens for r in after] == [r.tokens for r in before]
    with pytest.raises(ValueError, match="temperature 0"):
        generate(toy_model, toy_tok, "Q?", contexts, temperature=0.7, quote_search=2)


def test_question_scorer_is_the_questions_mean_log_probability_after_the_passage(toy_model, toy_tok, smollm2):
    question, texts = "What torque for the axle nut?", ["Torque the axle nut to 45 lbf.ft.", "Inflate the tyre.", ""]
    scores = chyd.question_scorer(toy_model, toy_tok)(question, texts)
    q = toy_tok.encode(question)
    for text, score in zip(texts, scores):
        before = toy_tok.encode(text + chyd.RERANK_PROMPT)
        tokens = before + q
        with torch.inference_mode():  # the scorer's cache is made in inference mode, as the decoder's
            logits = toy_model(torch.tensor([tokens]), torch.arange(len(tokens)))[0]  # from scratch: logits, not hidden states
        logp = torch.log_softmax(logits.float(), -1)
        assert score == pytest.approx(sum(float(logp[len(before) - 1 + i, t]) for i, t in enumerate(q)) / len(q), abs=1e-4)
    # a real model: the passage that answers makes the question likelier than one about something else
    folds = "zR\t\tOpen all folds.  This sets 'foldlevel' to highest fold level."
    tyres = "Inflate the main wheel tyres to 185 psi with dry nitrogen."
    right, wrong = chyd.question_scorer(*smollm2)("Which command opens all folds?", [folds, tyres])
    assert right > wrong + 1.0

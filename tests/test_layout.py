"""The reference's shape: model.py the network alone, small signatures, one set of defaults, defaults that follow
the model rather than its spelling."""
import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chyd
import model
from checkpoints import ALIASES, identify, load
from model import ModelConfig
from retrieve import paragraphs, read_documents
from test_model import LLAMA31_8B, MISTRAL_NEMO, QWEN3_4B, SMOLLM2_TF5

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):  # every import, at the top or inside a function
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    return names


def test_model_py_is_the_network_alone():
    source = ROOT / "model.py"
    assert imported_modules(source) - set(sys.stdlib_module_names) - {"__future__"} == {"torch"}
    assert len(source.read_text().splitlines()) <= 400
    # the compiled step's variants are installed by compile_decode_step, not chosen inside the math
    assert "is_compiling" not in source.read_text()
    assert "rope=apply_rope_real" in inspect.getsource(model.Transformer.compile_decode_step)


@pytest.mark.parametrize("module", [model, chyd])
def test_no_function_takes_more_than_six_parameters(module):
    too_many = []
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            functions = [(name, obj)]
        elif inspect.isclass(obj) and "__dataclass_fields__" not in vars(obj):  # a dataclass's __init__ is its fields
            functions = [(f"{name}.{k}", v) for k, v in vars(obj).items() if inspect.isfunction(v)]
        else:
            continue
        for n, f in functions:
            params = [p for p in inspect.signature(f).parameters if p != "self"]
            if len(params) > 6:
                too_many.append((n, params))
    assert not too_many


def test_imports_point_one_way():
    assert "chyd" not in imported_modules(ROOT / "cli.py")  # chyd.py's command uses cli.py, never the reverse
    for lower in ("cli.py", "chyd.py", "retrieve.py", "checkpoints.py", "constraint.py"):
        assert not {"eval", "trace", "bench"} & imported_modules(ROOT / lower), lower


@pytest.mark.parametrize("config,hub_id", [(QWEN3_4B, ALIASES["qwen3"]), (LLAMA31_8B, ALIASES["llama3.1"]),
                                           (MISTRAL_NEMO, ALIASES["mistral-nemo"]), (SMOLLM2_TF5, ALIASES["smollm2"])])
def test_a_model_is_known_by_its_shape_under_any_name(config, hub_id):
    cfg = ModelConfig.from_hf(config)
    cfg.name = "/home/me/models/my-copy"
    assert identify(cfg)[0] == hub_id
    cfg.name = hub_id
    assert identify(cfg) == (hub_id, "by name")
    other = ModelConfig.from_hf(dict(config, num_hidden_layers=config["num_hidden_layers"] + 1))
    other.name = "/home/me/models/mine"
    assert identify(other) == ("/home/me/models/mine", "not a model chyd knows")


def test_the_quote_first_default_follows_the_model(smollm2, smollm2_gguf_path, tiny_folder):
    assert chyd.model_defaults(smollm2[0].config)["quote_first"]
    from_gguf, _ = load(str(smollm2_gguf_path))
    assert from_gguf.config.name == str(smollm2_gguf_path)
    assert chyd.model_defaults(from_gguf.config) == {"model": ALIASES["smollm2"], "quote_first": True, "no_answer_above": 0.5,
                                              "quote_search": 8,
                                              "recognised": "by its shape: llama, 30 layers, 576 wide, 49152 tokens"}
    assert not chyd.model_defaults(load(str(tiny_folder))[0].config)["quote_first"]  # a model chyd has not measured
    # the 1.5B abstains above the p("No answer") its dev split chose, under any name
    coder = ModelConfig(vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                        intermediate_size=8960, model_type="qwen2", name="/home/me/coder.gguf")
    assert chyd.model_defaults(coder)["no_answer_above"] == chyd.NO_ANSWER_ABOVE[ALIASES["qwen2.5-coder-1.5b"]] < 0.5
    o = chyd.with_model_defaults(chyd.DecodeOptions(no_answer_above=0.9), coder)
    assert (o.quote_first, o.no_answer_above) == (True, 0.9)  # a value given is kept


def test_smollm2s_greedy_answers_search_their_quotes_by_default(smollm2, tiny_folder):
    smol, tiny = smollm2[0].config, load(str(tiny_folder))[0].config
    width = lambda cfg, **kw: chyd.with_model_defaults(chyd.DecodeOptions(**kw), cfg).quote_search
    assert width(smol, temperature=0) == chyd.QUOTE_SEARCH_MODELS[ALIASES["smollm2"]] == 8
    assert width(smol, temperature=0, quote_search=0) == 0 and width(smol, temperature=0, quote_search=3) == 3  # given: kept
    # where a beam cannot run, the default is off: sampling, free decoding, llguidance's mask; and for other models
    assert width(smol) == width(smol, temperature=0, constrained=False) == width(smol, temperature=0, engine="llguidance") == 0
    served = lambda **kw: chyd.with_model_defaults(chyd.DecodeOptions(temperature=0, **kw), smol, served=True).quote_search
    assert served() == 0 and served(quote_search=3) == 3  # an engine does not search unless a flag asks (it is then told)
    assert width(tiny, temperature=0) == 0 and chyd.model_defaults(tiny)["quote_search"] == 0


def test_the_alias_its_gguf_and_a_folder_give_the_same_greedy_answer(smollm2, smollm2_gguf_path, tmp_path):
    from export import write_hf_folder

    model, tok = smollm2
    write_hf_folder(model, tok, tmp_path / "my-model")  # SmolLM2's weights under a name that says nothing
    from_gguf, _ = load(str(smollm2_gguf_path), dtype=torch.float32)
    from_folder, folder_tok = load(str(tmp_path / "my-model"), dtype=torch.float32)
    assert chyd.model_defaults(from_folder.config)["model"] == ALIASES["smollm2"]
    question = "What pressure should the nose wheel tyres be inflated to?"
    contexts = [p.text for p in paragraphs(read_documents([str(ROOT / "data" / "manual.txt")])[0])]
    a = chyd.generate(model, tok, question, contexts, temperature=0)
    b = chyd.generate(from_gguf, tok, question, contexts, temperature=0)
    c = chyd.generate(from_folder, folder_tok, question, contexts, temperature=0)
    assert a.text == b.text == c.text and a.text.startswith("[")  # quote-first, the SmolLM2 default, for all three


def test_the_library_defaults_are_the_command_lines():
    """generate(..., temperature=0) with no other option answers as `chyd.py -q Q --greedy`, both on load's choice of
    dtype."""
    model, tok = load("smollm2")
    manual = ROOT / "data" / "manual.txt"
    contexts = [p.text for p in paragraphs(read_documents([str(manual)])[0])]
    for question in ("What is the nominal inflation pressure of the nose wheel tyres?", "How often is the nut checked?"):
        ours = chyd.generate(model, tok, question, contexts, temperature=0)
        r = subprocess.run([sys.executable, "chyd.py", "--ctx", str(manual), "-q", question, "--greedy", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["answer"] == ours.text
        assert ("quote-first on, No answer where its probability is above 0.5, quote search 8: the default for "
                "HuggingFaceTB/SmolLM2-135M-Instruct (by name)") in r.stderr
    d = chyd.DecodeOptions()
    assert d.whole_words and d.no_repeat_ngram == 4 and None is d.quote_first is d.no_answer_above is d.quote_search


# SmolLM2's greedy answers to the 42 sample questions, recorded with eval.py before the reference was split into
# model.py / quantize.py / checkpoints.py / cli.py (commit 64678bc), and again when quote-first answers were first
# shown quote-first worked examples (8bcd4ca), and when the n-gram ban learned to read past whitespace-only tokens
# (two --no-quote-first answers moved, q29 and q35: a number after a repeated phrase, and SmolLM2 writes a space token
# before digits), and when quote search became SmolLM2's greedy default (""; without it, "--quote-search 0", the
# answers of before): a change not meant to move an answer must leave them as they are
RECORDED = json.loads((ROOT / "tests" / "sample_answers.json").read_text())


@pytest.mark.parametrize("flags", list(RECORDED))
def test_the_sample_answers_are_the_ones_recorded(smollm2, flags):
    from cli import Parser, add_decoding_args, decode_options

    model, tok = smollm2
    p = Parser()
    add_decoding_args(p, chyd.DecodeOptions())
    p.add_argument("--method", default="chyd")
    args = p.parse_args(["--greedy", *flags.split()])
    options = decode_options(args, chyd.DecodeOptions(constrained=args.method == "chyd", batch_size=8))
    data = [json.loads(line) for line in (ROOT / "data" / "sample_eval.jsonl").read_text().splitlines()]
    results = chyd.generate_batch(model, tok, [e["question"] for e in data], [e["contexts"] for e in data], options=options)
    assert {e["id"]: r.text for e, r in zip(data, results)} == RECORDED[flags]

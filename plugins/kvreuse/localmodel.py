"""Build the small local Llama models that tests, benchmarks and ``make demo`` run on.

No model can be downloaded here, so we make one: a Llama-architecture causal LM with random weights (RoPE,
grouped-query attention, head_dim 64) and a byte-level BPE tokenizer trained with ``tokenizers`` on the text of
``shared/datasets``. Random weights are fine for latency, cache hit rates and exactness checks; they say nothing
about answer quality. The build is deterministic (fixed seeds, single-threaded tokenizer training) and cached:
a folder that already holds a complete build of the same preset is reused.

Run ``python -m kvreuse.localmodel --preset small --out build/models/small``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

# The repository keeps real data in ../shared/datasets; KVREUSE_DATASETS points elsewhere.
DATASETS = Path(os.environ.get("KVREUSE_DATASETS", Path(__file__).resolve().parents[2].parent / "shared" / "datasets"))


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
    "small": ModelPreset(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2),
    # Prefill dominates: for benchmarks that measure time to first token.
    "large": ModelPreset(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4),
}

_STAMP = "kvreuse-build.json"


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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(datasets), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                                   pad_token=specials[2])
    # A plain chat template, so chat-style prompts (the module cache's <system>/<user>) have a defined layout.
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    fast.save_pretrained(out)


def build_model(preset: str = "small", out: str | os.PathLike | None = None, datasets: Path = DATASETS) -> Path:
    """Build (or reuse) the model of ``preset`` in ``out`` and return its folder."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; presets: {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    out = Path(out) if out is not None else Path("build") / "models" / preset
    stamp = out / _STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(shape):
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    train_tokenizer(shape.vocab_size, out, datasets)
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=10000.0,
        initializer_range=shape.initializer_range, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(shape)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
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
    args = dict(model=str(model), block_size=32, enforce_eager=True, kv_cache_memory_bytes=256 << 20,
                max_model_len=4096, dtype="float32", seed=0, enable_prefix_caching=True, disable_log_stats=False)
    args.update(overrides)
    return args

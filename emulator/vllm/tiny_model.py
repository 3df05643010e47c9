"""Build a tiny random-weight chat model and its tokenizer into a directory, locally.

Run it by file path with the vLLM venv's python (it imports nothing from this project)::

    VENV/bin/python /path/to/emulator/vllm/tiny_model.py OUT_DIR [--seed 0]

What it writes (``save_pretrained``): a ``Qwen2ForCausalLM`` with 2 layers, hidden 256,
4 attention heads of 64, 2 KV heads, intermediate 512, tied embeddings, 4,096 positions,
random weights drawn with a fixed seed, stored in bf16 (about 2.2M parameters); and a
byte-level BPE tokenizer (vocabulary 4,096) trained here with ``tokenizers`` on text this
script generates from the same seed, with the special tokens ``<|endoftext|>`` (padding),
``<|im_start|>`` and ``<|im_end|>`` (end of sequence) and a ChatML chat template in
``tokenizer_config.json``. The output is the same, byte for byte, for the same seed and
library versions; it prints a SHA-256 of every file and one over the whole directory.

The model's output is random tokens: ask for exact lengths with ``"ignore_eos": true`` and
``max_tokens``.

``--tokenizer-only`` writes the tokenizer files alone (tokenizer.json, tokenizer_config.json),
the same bytes ``save_pretrained`` writes, with ``tokenizers`` alone (no torch, no
transformers): the emulated engines tokenize with them (emulator/engine/tokenizer.py).
"""

import argparse
import hashlib
import importlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ONSETS = [
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "ch",
    "sh",
    "th",
    "st",
    "tr",
    "pl",
    "gr",
    "br",
    "qu",
]
VOWELS = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ou", "io", "ee", "oo"]
CODAS = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st", "rd", "x"]
PUNCT = [".", ".", ".", ",", "?", "!", ";", ":"]


def corpus(seed: int, n_lines: int = 20000) -> list[str]:
    """Lines of made-up words, numbers, code and chat turns, the same for the same seed."""
    rng = random.Random(seed)
    lexicon = []
    for _ in range(6000):
        syllables = rng.choices([1, 2, 3, 4], weights=[4, 5, 3, 1])[0]
        lexicon.append(
            "".join(
                rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                for _ in range(syllables)
            )
        )
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]  # Zipf-like
    lines = []
    for i in range(n_lines):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(4, 30))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        text = " ".join(words) + rng.choice(PUNCT)
        kind = i % 10
        if kind == 0:
            text = f"def {words[0]}({words[-1]}): return {rng.randint(0, 9)} + {words[1]}"
        elif kind == 1:
            text = f'{{"{words[0]}": [{rng.randint(0, 999)}, "{words[1]}"]}}'
        lines.append(text)
    return lines


def build_tokenizer(seed: int, vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # The pipeline transformers' Qwen2Tokenizer rebuilds around the vocabulary and merges of
    # tokenizer.json when it loads a qwen2 model (NFC, a split on this pattern, byte-level):
    # with the same pipeline here, tokenizer.json read alone (the router) and the engine's
    # tokenizer give the same token ids.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


# What transformers 5 (the vLLM venv's) writes to tokenizer_config.json for the tokenizer
# build() saves; write_tokenizer writes the same without transformers.
TOKENIZER_CONFIG = {
    "backend": "tokenizers",
    "chat_template": CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "extra_special_tokens": ["<|im_start|>"],
    "model_max_length": 4096,
    "pad_token": "<|endoftext|>",
    "tokenizer_class": "TokenizersBackend",
}


def write_tokenizer(out: Path, seed: int = 0, vocab_size: int = 4096) -> None:
    """tokenizer.json and tokenizer_config.json as build() saves them, byte for byte."""
    from tokenizers import processors

    out.mkdir(parents=True, exist_ok=True)
    raw = build_tokenizer(seed, vocab_size)
    # PreTrainedTokenizerFast.save_pretrained adds this post-processor (it adds no tokens:
    # the tokenizer has no BOS).
    raw.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A $B:1", special_tokens=[]
    )
    raw.save(str(out / "tokenizer.json"))
    text = json.dumps(TOKENIZER_CONFIG, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


def build(out: Path, seed: int = 0, vocab_size: int = 4096) -> str:
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")

    out.mkdir(parents=True, exist_ok=True)
    raw = build_tokenizer(seed, vocab_size)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out, save_jinja_files=False)  # template in tokenizer_config.json

    config = transformers.Qwen2Config(
        vocab_size=raw.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=raw.token_to_id("<|endoftext|>"),
        eos_token_id=raw.token_to_id("<|im_end|>"),
        pad_token_id=raw.token_to_id("<|endoftext|>"),
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny model: {n_params:,} parameters, vocabulary {config.vocab_size}")
    return digest(out)


def digest(out: Path) -> str:
    whole = hashlib.sha256()
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        h = hashlib.sha256(f.read_bytes()).hexdigest()
        rel = f.relative_to(out).as_posix()
        print(f"  {h}  {rel} ({f.stat().st_size:,} bytes)")
        whole.update(f"{rel}\0{h}\n".encode())
    return whole.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description="Build the tiny random-weight model.")
    parser.add_argument("out", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--tokenizer-only", action="store_true", help="the tokenizer files alone (no torch)"
    )
    args = parser.parse_args()
    start = time.monotonic()
    if args.tokenizer_only:
        write_tokenizer(args.out, args.seed, args.vocab_size)
        whole = digest(args.out)
    else:
        whole = build(args.out, args.seed, args.vocab_size)
    print(f"sha256 of {args.out}: {whole}")
    print(f"built in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

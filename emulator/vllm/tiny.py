"""The tiny model the real-vLLM tier serves, built once into the vLLM environment, and a
tiny LoRA adapter for it (written here by hand, no peft)."""

from __future__ import annotations

import json
import random
import struct
import subprocess
from pathlib import Path

from emulator.vllm.paths import TINY_MODEL

# The tiny model's attention shapes (tiny_model.py): hidden 256, 4 query heads and 2 KV
# heads of 64, 2 layers.
HIDDEN, Q_OUT, KV_OUT, LAYERS = 256, 4 * 64, 2 * 64, 2
LORA_RANK = 8  # one of vLLM's max_lora_rank values (config/lora.py MaxLoRARanks)


def ensure_tiny_model(venv: Path, seed: int = 0) -> Path:
    """The model directory inside `venv` (built there with the venv's python on first use:
    ~7-13 s, 4.6 MB, byte-identical for a seed)."""
    out = venv / f"tiny-model-seed{seed}"
    if not (out / "config.json").exists():
        subprocess.run(
            [str(venv / "bin" / "python"), str(TINY_MODEL), str(out), "--seed", str(seed)],
            check=True,
            capture_output=True,
        )
    return out


def ensure_tiny_lora(venv: Path, seed: int = 0) -> Path:
    """A PEFT LoRA adapter for the tiny model inside `venv`: rank 8 on q_proj and v_proj of
    both layers, small random float32 weights from `seed` (adapter_config.json and
    adapter_model.safetensors, the files vLLM's LoRAModel.from_local_checkpoint reads).
    Stdlib only, ~0.1 s, the same bytes for a seed."""
    out = venv / f"tiny-lora-seed{seed}"
    if (out / "adapter_model.safetensors").exists():
        return out
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], bytes]] = {}
    for layer in range(LAYERS):
        for proj, out_dim in (("q_proj", Q_OUT), ("v_proj", KV_OUT)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            for part, shape in (("lora_A", [LORA_RANK, HIDDEN]), ("lora_B", [out_dim, LORA_RANK])):
                n = shape[0] * shape[1]
                data = struct.pack(f"<{n}f", *(rng.gauss(0.0, 0.02) for _ in range(n)))
                tensors[f"{prefix}.{part}.weight"] = (shape, data)
    header: dict[str, object] = {}
    offset = 0
    for name, (shape, data) in tensors.items():
        end = offset + len(data)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}
        offset = end
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp = out / "adapter_model.safetensors.tmp"
    tmp.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(d for _, d in tensors.values()))
    tmp.rename(out / "adapter_model.safetensors")
    return out

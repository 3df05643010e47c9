"""Engine profiles: every shipped one loads, is named after its file, and says what it is
made of; its numbers are the published ones it cites. A profile for the router alone needs
only the keys the router reads, and is told every one it lacks at once."""

from importlib import resources
from pathlib import Path

import pytest
import yaml

from ext_proc.estimate.profile import (
    EMULATOR_KEYS,
    OPTIONAL_KEYS,
    ROUTER_KEYS,
    load_profile,
    profile_from_dict,
)

SHIPPED = sorted(
    p.name.removesuffix(".yaml")
    for p in resources.files("ext_proc.estimate.profiles").iterdir()
    if p.name.endswith(".yaml")
)


def test_the_issue_27_profiles_are_shipped() -> None:
    assert {"h100-llama3.1-8b", "a10g-llama3.1-8b", "h200-llama3.1-70b-fp8"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads_and_cites_its_sources(name: str) -> None:
    p = load_profile(name)
    assert p.name == name
    text = resources.files("ext_proc.estimate.profiles").joinpath(f"{name}.yaml").read_text()
    assert text.startswith("# Engine profile:")
    # a profile's timings are sane: a prompt costs time, a larger batch a longer step
    assert 0 < p.lone_ttft_ms(1000) < p.lone_ttft_ms(8000)
    assert p.decode_ms(1, 1000) < p.decode_ms(64, 64_000)
    assert p.chunk_tokens <= p.kv_capacity_tokens


def test_the_faster_gpu_is_faster_and_the_70b_is_slower_per_token() -> None:
    h100, a10g, h200 = (
        load_profile(n) for n in ("h100-llama3.1-8b", "a10g-llama3.1-8b", "h200-llama3.1-70b-fp8")
    )
    # an 8k prompt alone: H100 8B 310 ms, H200 70B 1.25 s, A10G 8B 4.3 s
    assert h100.lone_ttft_ms(8000) == pytest.approx(310, rel=0.02)
    assert h200.lone_ttft_ms(8000) == pytest.approx(1249, rel=0.02)
    assert a10g.lone_ttft_ms(8000) == pytest.approx(4265, rel=0.02)
    # one request decoding: ~6, ~19 and ~35 ms a token (77 % of the memory roofline)
    assert [round(p.decode_ms(1, 1000)) for p in (h100, h200, a10g)] == [6, 19, 35]
    # TensorRT-LLM's 303 tok/s for 32 x (2,048 in, 128 out) on one H200: within 5 %
    prefill_s = 32 * 2048 / h200.prefill_tokens_per_s
    decode_s = 128 * h200.decode_ms(32, 32 * (2048 + 64)) / 1000
    assert 32 * 128 / (prefill_s + decode_s) == pytest.approx(303, rel=0.05)
    assert a10g.kv_capacity_tokens < h200.kv_capacity_tokens < h100.kv_capacity_tokens


# The minimal profile for the router alone: ROUTER_KEYS, nothing the emulator reads.
ROUTER_ONLY = {
    "prefill_base_ms": 8.0,
    "prefill_tokens_per_s": 30000.0,
    "prefill_context_tokens": 30000.0,
    "chunk_tokens": 8192,
    "decode_base_ms": 6.0,
    "decode_per_request_ms": 0.06,
    "decode_per_1k_context_ms": 0.051,
    "kv_capacity_tokens": 437000,
    "max_running_requests": 1024,
}


def test_a_router_side_profile_needs_only_the_keys_the_router_reads(tmp_path: Path) -> None:
    assert set(ROUTER_ONLY) == set(ROUTER_KEYS)
    path = tmp_path / "my-h100.yaml"
    path.write_text(yaml.safe_dump(ROUTER_ONLY))
    p = load_profile(str(path))
    assert p.name == "my-h100"  # the file's name when it has none
    # the optional decode terms are off: a dense model, every batch CUDA-graphed
    h100 = load_profile("h100-llama3.1-8b")
    assert p.decode_ms(600, 50_000) == pytest.approx(h100.decode_ms(600, 50_000) - 1.0)
    assert p.lone_ttft_ms(8000) == pytest.approx(h100.lone_ttft_ms(8000))
    # the emulator's keys default to the shipped profiles' values
    assert (p.block_tokens, p.jitter_sigma) == (h100.block_tokens, h100.jitter_sigma)


def test_every_missing_router_key_is_named_at_once_and_emulator_keys_are_not_asked_for() -> None:
    with pytest.raises(ValueError, match="missing keys") as e:
        profile_from_dict({"prefill_base_ms": 5}, "mine.yaml")
    named = str(e.value).split("missing keys ")[1].split(", ")
    assert named == [k for k in ROUTER_KEYS if k != "prefill_base_ms"]
    assert not set(named) & set(EMULATOR_KEYS + OPTIONAL_KEYS)


def test_a_near_miss_key_is_named_with_the_real_one() -> None:
    with pytest.raises(
        ValueError, match=r"unknown key 'kv_capacity' .*did you mean 'kv_capacity_tokens'"
    ):
        profile_from_dict({**ROUTER_ONLY, "kv_capacity": 1})


def test_optional_terms_that_need_a_partner_say_so() -> None:
    with pytest.raises(ValueError, match="no_cuda_graph_ms needs no_cuda_graph_batch"):
        profile_from_dict({**ROUTER_ONLY, "no_cuda_graph_ms": 2.0})
    with pytest.raises(ValueError, match="decode_batch_fraction"):
        profile_from_dict({**ROUTER_ONLY, "decode_batch_ms": 5.0, "decode_batch_fraction": 0})
    moe = profile_from_dict({**ROUTER_ONLY, "decode_batch_ms": 18.0, "no_cuda_graph_batch": 20})
    assert moe.decode_ms(32, 0) > moe.decode_ms(1, 0) + 5  # the expert term is on


def test_the_emulator_keys_are_read_nowhere_in_the_router() -> None:
    # The router's cache granularity is routing.block_tokens; jitter is the emulator's.
    root = Path(__file__).resolve().parents[3] / "ext_proc"
    for path in root.rglob("*.py"):
        if path.name == "profile.py":
            continue
        text = path.read_text()
        for key in EMULATOR_KEYS:
            for reader in ("profile.", "p."):
                assert f"{reader}{key}" not in text, f"{path} reads {key}"


def test_the_docs_router_side_example_loads_as_the_router_loads_it() -> None:
    doc = Path(__file__).resolve().parents[3] / "docs" / "engines.md"
    section = doc.read_text().split("## Describe your hardware", 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    raw = yaml.safe_load(example)
    assert set(raw) - {"name"} == set(ROUTER_KEYS)  # the router's keys, no more
    p = profile_from_dict(raw, "docs/engines.md")
    assert p.name == "my-h100-8b" and p.kv_capacity_tokens == 437_000

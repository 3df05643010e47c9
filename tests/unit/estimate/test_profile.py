"""Engine profiles: every shipped one loads, is named after its file, and says what it is
made of; its numbers are the published ones it cites."""

from importlib import resources

import pytest

from ext_proc.estimate.profile import load_profile

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

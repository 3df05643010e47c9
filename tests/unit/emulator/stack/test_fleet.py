"""Fleet files: each region's engine profile, checked at load with errors naming the key."""

from pathlib import Path

import pytest

from emulator.stack.fleet import NO_FLEET, fleet_from_dict, load_fleet
from ext_proc.estimate.profile import load_profile
from ext_proc.vocab.backend import DEFAULT_PROFILE

ROOT = Path(__file__).resolve().parents[4]
FLEETS = ROOT / "loadgen/data/fleets"
REGIONS = ("us-ashburn", "eu-frankfurt", "ap-seoul")


def test_a_listed_region_runs_its_profile_and_the_others_the_default() -> None:
    fleet = fleet_from_dict(
        {"backends": [{"id": "ap-seoul", "engine_profile": "h100-llama3.1-8b"}]}, REGIONS
    )
    assert fleet.profile_of("ap-seoul", DEFAULT_PROFILE) == "h100-llama3.1-8b"
    assert fleet.profile_of("us-ashburn", DEFAULT_PROFILE) == DEFAULT_PROFILE
    assert NO_FLEET.profile_of("ap-seoul", DEFAULT_PROFILE) == DEFAULT_PROFILE


def test_a_profile_path_is_relative_to_the_fleet_file() -> None:
    fleet = load_fleet(FLEETS / "fast-far.yaml", REGIONS)
    far = fleet.profile_of("eu-frankfurt", DEFAULT_PROFILE)
    assert Path(far) == FLEETS / "l40s-prefill3x-decode2x.yaml"
    assert fleet.profile_of("us-ashburn", "x") == DEFAULT_PROFILE


def test_the_shipped_fleets_scale_the_shipped_profile_as_issue_27_says() -> None:
    shipped = load_profile()
    fast = load_profile(load_fleet(FLEETS / "fast-far.yaml", REGIONS).profiles["ap-seoul"])
    slow = load_profile(load_fleet(FLEETS / "slow-near.yaml", REGIONS).profiles["us-ashburn"])
    assert fast.prefill_tokens_per_s == 3 * shipped.prefill_tokens_per_s
    assert fast.lone_ttft_ms(8000) == pytest.approx(shipped.lone_ttft_ms(8000) / 3, rel=1e-4)
    assert fast.decode_ms(40, 80_000) == pytest.approx(shipped.decode_ms(40, 80_000) / 2)
    assert slow.lone_ttft_ms(8000) == pytest.approx(shipped.lone_ttft_ms(8000) * 3)
    assert slow.decode_ms(40, 80_000) == pytest.approx(shipped.decode_ms(40, 80_000) * 2)
    mixed = load_fleet(FLEETS / "mixed-gpus.yaml", REGIONS)
    assert sorted(mixed.profiles) == sorted(REGIONS)
    assert DEFAULT_PROFILE not in mixed.profiles.values()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "expected a mapping"),
        ({"backend": []}, "unknown key 'backend'"),
        ({"backends": []}, "backends: expected a non-empty list"),
        ({"backends": ["us-ashburn"]}, r"backends\[0\]: expected a mapping"),
        ({"backends": [{"id": "us-ashburn"}]}, r"backends\[0\].engine_profile: expected"),
        (
            {"backends": [{"id": "us-ashburn", "engine_profile": "x", "rtt": 1}]},
            r"backends\[0\]: unknown key 'rtt'",
        ),
        (
            {"backends": [{"id": "mars", "engine_profile": DEFAULT_PROFILE}]},
            r"backends\[0\].id: unknown region 'mars'",
        ),
        (
            {
                "backends": [
                    {"id": "ap-seoul", "engine_profile": DEFAULT_PROFILE},
                    {"id": "ap-seoul", "engine_profile": DEFAULT_PROFILE},
                ]
            },
            r"backends\[1\].id: 'ap-seoul' listed twice",
        ),
        (
            {"backends": [{"id": "ap-seoul", "engine_profile": "h900-nope"}]},
            r"backends\[0\].engine_profile: unknown engine profile 'h900-nope'",
        ),
    ],
)
def test_a_bad_fleet_names_the_key(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fleet_from_dict(raw, REGIONS, "f.yaml")


def test_a_bad_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"fleet .*missing\.yaml: No such file"):
        load_fleet(tmp_path / "missing.yaml", REGIONS)
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  - id: ap-seoul\n    engine_profile: nope.yaml\n")
    with pytest.raises(ValueError, match=r"bad.yaml: backends\[0\].engine_profile: .*nope.yaml"):
        load_fleet(bad, REGIONS)


def test_a_backend_may_name_its_model_and_adapters() -> None:
    fleet = fleet_from_dict(
        {
            "backends": [
                {"id": "us-ashburn", "model": "alpha", "lora_modules": ["sql", "chat=/a/chat"]},
                {"id": "ap-seoul", "engine_profile": "h100-llama3.1-8b", "model": "beta"},
            ]
        },
        REGIONS,
    )
    assert fleet.models == {"us-ashburn": "alpha", "ap-seoul": "beta"}
    assert fleet.loras == {"us-ashburn": ("sql", "chat=/a/chat")}
    assert fleet.profile_of("us-ashburn", DEFAULT_PROFILE) == DEFAULT_PROFILE
    # the shipped fleets name none: every engine serves its default name, no adapters
    shipped = load_fleet(FLEETS / "mixed-gpus.yaml", REGIONS)
    assert shipped.models == {} and shipped.loras == {}


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ({"model": ""}, r"backends\[0\].model: expected a non-empty model name"),
        ({"model": 3}, r"backends\[0\].model: expected"),
        ({"lora_modules": "sql"}, r"backends\[0\].lora_modules: expected a list"),
        ({"lora_modules": [""]}, r"backends\[0\].lora_modules\[0\]: expected an adapter name"),
        ({"lora_modules": ["=/p"]}, r"backends\[0\].lora_modules\[0\]: '=/p': expected NAME"),
        ({"lora_modules": ["a", "a=/x"]}, r"lora_modules\[1\]: adapter 'a' listed twice"),
        (
            {"model": "a", "lora_modules": ["a"]},
            r"lora_modules\[0\]: adapter 'a' has the model's own name",
        ),
        ({"models": ["a"]}, r"backends\[0\]: unknown key 'models'"),
    ],
)
def test_a_bad_model_or_adapter_names_the_key(backend: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fleet_from_dict({"backends": [{"id": "us-ashburn", **backend}]}, REGIONS, "f.yaml")

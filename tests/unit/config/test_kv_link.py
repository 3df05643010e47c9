import pytest

from ext_proc.config.load import config_from_dict
from ext_proc.estimate.profile import load_profile, profile_from_dict
from ext_proc.vocab.params import ConfigError


def cfg(backends: list[dict[str, object]], **routing: object) -> dict[str, object]:
    return {
        "backends": [{"address": f"127.0.0.1:{i + 1}", **b} for i, b in enumerate(backends)],
        "routing": routing,
    }


def test_a_pd_fleet_and_its_links_load() -> None:
    c = config_from_dict(
        cfg(
            [
                {"id": "p", "role": "prefill", "region": "eu", "models": ["m"]},
                {"id": "d", "role": "decode", "region": "us"},
                {"id": "x"},
            ],
            kv_bytes_per_token=131072,
            kv_link={"gbps": 25, "links": [{"regions": ["us", "eu"], "gbps": 1, "rtt_ms": 80}]},
        )
    )
    links = c.routing.kv_link
    assert links.link("eu", "us") == links.link("us", "eu") == (1.0, 80.0)
    assert links.link("eu", "eu") == (25.0, 0.0)
    assert c.routing.kv_bytes_per_token == 131072


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        (
            [{"id": "x", "models": ["b"]}, {"id": "p", "role": "prefill", "models": ["a"]}],
            r"backends\[1\]\.role: prefill .*'p'",
        ),
        ([{"id": "p", "role": "prefill"}], r"backends\[0\]\.role: prefill engine 'p' has no"),
        ([{"id": "d", "role": "decode"}], r"backends\[0\]\.role: decode engine 'd' has no"),
        (
            [
                {"id": "p", "role": "prefill", "models": ["a"]},
                {"id": "d", "role": "decode", "models": ["b"]},
            ],
            r"backends\[0\]\.role: prefill engine 'p' has no decode engine for \['a'\]",
        ),
    ],
)
def test_half_a_pair_alone_is_refused_naming_the_key(
    backends: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cfg(backends))


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([{"regions": ["a"]}], r"routing\.kv_link\.links\[0\]\.regions: two region names"),
        (
            [{"regions": ["a", "b"]}, {"regions": ["b", "a"]}],
            r"routing\.kv_link\.links\[1\]\.regions: \['a', 'b'\] listed twice",
        ),
        ([{"regions": ["a", "b"], "gbps": 0}], r"routing\.kv_link\.links\[0\]\.gbps"),
    ],
)
def test_a_bad_link_is_refused_naming_the_key(links: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cfg([{"id": "x"}], kv_link={"links": links}))


def test_the_profile_may_say_the_kv_bytes_per_token() -> None:
    raw = {**load_profile().__dict__, "kv_bytes_per_token": 131072}
    assert profile_from_dict(raw).kv_bytes_per_token == 131072
    raw.pop("kv_bytes_per_token")
    assert profile_from_dict(raw).kv_bytes_per_token == 131072  # Llama-3.1-8B fp16 unless said

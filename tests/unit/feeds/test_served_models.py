"""What a backend serves, read from its engine's /v1/models (vLLM's and SGLang's shape)."""

import pytest

from ext_proc.feeds.served_models import ModelsError, ServedModels, parse_models

VLLM_WITH_ADAPTER = {
    "object": "list",
    "data": [
        {
            "id": "alpha",
            "object": "model",
            "root": "/m/alpha",
            "parent": None,
            "max_model_len": 4096,
        },
        {
            "id": "alpha-chat",
            "object": "model",
            "root": "/m/alpha",
            "parent": None,
            "max_model_len": 8192,
        },
        {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "alpha"},
    ],
}


def test_base_names_and_adapters_with_their_parent() -> None:
    served = parse_models(VLLM_WITH_ADAPTER)
    assert served.base == {"alpha", "alpha-chat"}
    assert served.adapters == {"sql-lora": "alpha"}
    assert served.max_model_len == 4096  # the tighter limit
    assert served.serves("sql-lora") and not served.serves("beta")
    assert served.names == {"alpha", "alpha-chat", "sql-lora"}


def test_restricted_to_the_configured_names() -> None:
    served = parse_models(VLLM_WITH_ADAPTER).restricted_to(["alpha", "sql-lora", "beta"])
    assert served == ServedModels(frozenset({"alpha"}), {"sql-lora": "alpha"}, 4096)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "expected an object with a 'data' list"),
        ({"data": {}}, "expected an object with a 'data' list"),
        ({"data": [{"object": "model"}]}, r"data\[0\]: no model id"),
        ({"data": [{"id": ""}]}, r"data\[0\]: no model id"),
        ({"data": []}, "lists no model"),
    ],
)
def test_an_unreadable_list_names_what_is_wrong(doc: object, message: str) -> None:
    with pytest.raises(ModelsError, match=message):
        parse_models(doc)

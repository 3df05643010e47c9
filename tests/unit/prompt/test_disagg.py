"""The bodies of a disaggregated request's two legs, in SGLang's and vLLM's protocols."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ext_proc.prompt import disagg

CHAT = json.dumps(
    {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
    }
).encode()


def test_sglang_body_adds_the_bootstrap_fields_and_keeps_the_rest() -> None:
    out = json.loads(disagg.sglang_body(CHAT, "10.0.0.5", 8998, 12345))
    assert (out["bootstrap_host"], out["bootstrap_port"], out["bootstrap_room"]) == (
        "10.0.0.5",
        8998,
        12345,
    )
    assert {k: out[k] for k in json.loads(CHAT)} == json.loads(CHAT)


@given(st.integers(0, 2**32))
def test_bootstrap_rooms_are_63_bit(seed: int) -> None:
    room = disagg.bootstrap_room(random.Random(seed))
    assert 0 <= room <= 2**63 - 1


def test_rooms_differ_per_request() -> None:
    rng = random.Random(1)
    assert len({disagg.bootstrap_room(rng) for _ in range(100)}) == 100


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("127.0.0.1:30000", "127.0.0.1"),
        ("prefill.local:8000", "prefill.local"),
        ("[::1]:8000", "::1"),
        ("::1", "::1"),
        ("bare-host", "bare-host"),
    ],
)
def test_host_of_an_address(address: str, host: str) -> None:
    assert disagg.host_of(address) == host


def test_vllm_prefill_leg_asks_for_one_token_unstreamed_and_keeps_the_kv() -> None:
    body = json.loads(CHAT)
    body["max_completion_tokens"] = 70
    out = json.loads(disagg.vllm_prefill_body(json.dumps(body).encode()))
    assert out["kv_transfer_params"] == {"do_remote_decode": True}
    assert (out["max_tokens"], out["max_completion_tokens"], out["stream"]) == (1, 1, False)
    assert "stream_options" not in out
    assert out["messages"] == body["messages"]


def test_vllm_decode_leg_carries_the_prefill_answers_params() -> None:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e",
        "remote_request_id": "cmpl-1",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    }
    answer = json.dumps({"id": "cmpl-1", "choices": [], "kv_transfer_params": params}).encode()
    got = disagg.kv_transfer_params(answer)
    assert got == params
    out = json.loads(disagg.vllm_decode_body(CHAT, got))
    assert out["kv_transfer_params"] == params
    assert (out["stream"], out["max_tokens"]) == (True, 50)  # the client's own


@pytest.mark.parametrize(
    "answer",
    [
        b"not json",
        b"[]",
        b'{"choices": []}',
        b'{"kv_transfer_params": null}',
        b'{"kv_transfer_params": {}}',
    ],
)
def test_a_prefill_answer_without_params_is_an_error(answer: bytes) -> None:
    with pytest.raises(disagg.PrefillAnswerError):
        disagg.kv_transfer_params(answer)


def test_a_body_not_an_object_is_refused() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        disagg.sglang_body(b"[1]", "h", 1, 1)

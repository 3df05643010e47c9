import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.prompt.parse import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    ParseError,
    api_for_path,
    ends_event_stream,
    event_bytes,
    parse_body,
    streamed_tokens,
)
from ext_proc.prompt.tokens import count_tokens, render_chat


def body(obj: object) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions?x=1", CHAT),
        ("/v1/completions/", COMPLETIONS),
        ("/generate", GENERATE),
        ("/v1/models", None),
        ("/", None),
        ("", None),
    ],
)
def test_api_for_path(path: str, api: str | None) -> None:
    assert api_for_path(path) == api


def test_chat_counts_the_rendered_prompt_and_reads_fields() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "image"}]},
    ]
    req = parse_body(
        CHAT,
        body({"model": "m", "messages": messages, "stream": True, "max_tokens": 7, "user": "u1"}),
    )
    assert req.prompts == ("system\nbe brief\nuser\nhello \nassistant\n",)
    assert req.input_tokens == count_tokens(render_chat(messages)) == 10  # ceil(37 bytes / 4)
    assert (req.stream, req.max_output_tokens, req.model, req.user) == (True, 7, "m", "u1")


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse_body(
        CHAT,
        body({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3,
              "max_tokens": 9}),
    )  # fmt: skip
    assert req.max_output_tokens == 3


def test_completions_and_generate() -> None:
    c = parse_body(COMPLETIONS, body({"prompt": "abcd", "max_tokens": 2}))
    assert (c.prompts, c.input_tokens, c.stream) == (("abcd",), 1, False)
    g = parse_body(GENERATE, body({"text": "12345", "sampling_params": {"max_new_tokens": 4}}))
    assert (g.prompts, g.input_tokens, g.max_output_tokens) == (("12345",), 2, 4)


def test_token_id_prompts_count_exactly() -> None:
    c = parse_body(COMPLETIONS, body({"prompt": [5, 6, 7, 8, 9]}))
    assert (c.prompts, c.prompt_tokens, c.input_tokens) == (((5, 6, 7, 8, 9),), (5,), 5)
    g = parse_body(GENERATE, body({"input_ids": [1, 2, 3], "text": "ignored when ids are given"}))
    assert (g.prompts, g.input_tokens) == (((1, 2, 3),), 3)


def test_a_list_of_prompts_is_a_batch_not_one_prompt() -> None:
    c = parse_body(COMPLETIONS, body({"prompt": ["ab", "cdefgh"]}))
    assert (c.prompts, c.prompt_tokens, c.input_tokens) == (("ab", "cdefgh"), (1, 2), 3)
    ids = parse_body(COMPLETIONS, body({"prompt": [[1, 2], [3, 4, 5]]}))
    assert (ids.prompts, ids.prompt_tokens) == (((1, 2), (3, 4, 5)), (2, 3))
    g = parse_body(GENERATE, body({"input_ids": [[1], [2, 3]]}))
    assert g.prompt_tokens == (1, 2)
    t = parse_body(GENERATE, body({"text": ["a", "b"]}))
    assert t.prompts == ("a", "b")


@pytest.mark.parametrize(
    ("api", "raw", "names"),
    [
        (CHAT, b"{not json", "invalid JSON"),
        (CHAT, b"\xff\xfe", "body"),
        (CHAT, b"[1, 2]", "expected a JSON object"),
        (CHAT, body({"messages": []}), "messages"),
        (CHAT, body({"messages": "hi"}), "messages"),
        (CHAT, body({"messages": [1]}), "messages[0]"),
        (CHAT, body({"messages": [{"content": 5}]}), "messages[0].content"),
        (CHAT, body({"messages": [{"content": "x"}], "max_tokens": -1}), "max_tokens"),
        (CHAT, body({"messages": [{"content": "x"}], "max_tokens": True}), "max_tokens"),
        (CHAT, body({"messages": [{"content": "x"}], "stream": "yes"}), "stream"),
        (CHAT, body({"messages": [{"content": "x"}], "user": 3}), "user"),
        (COMPLETIONS, body({"prompt": 3}), "prompt"),
        (COMPLETIONS, body({"prompt": []}), "prompt"),
        (COMPLETIONS, body({"prompt": [1, "a"]}), "prompt"),
        (COMPLETIONS, body({"prompt": [-1]}), "prompt"),
        (COMPLETIONS, body({"prompt": [[1], "a"]}), "prompt"),
        (GENERATE, body({"input_ids": "x"}), "input_ids"),
        (GENERATE, body({"text": None}), "text"),
        (GENERATE, body({"text": "x", "sampling_params": []}), "sampling_params"),
        (CHAT, b"[" * 100_000, "body"),
    ],
)
def test_bad_bodies_raise_an_error_naming_the_field(api: str, raw: bytes, names: str) -> None:
    with pytest.raises(ParseError, match=names.replace("[", r"\[").replace("]", r"\]")):
        parse_body(api, raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=20,
).map(lambda v: json.dumps(v).encode()))  # fmt: skip
def test_any_body_parses_or_raises_parse_error(raw: bytes) -> None:
    for api in (CHAT, COMPLETIONS, GENERATE):
        try:
            req = parse_body(api, raw)
        except ParseError:
            continue
        counted = [len(p) if isinstance(p, tuple) else count_tokens(p) for p in req.prompts]
        assert req.input_tokens == sum(counted) >= 0 and len(req.prompts) >= 1


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def sse_events(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.strip().split(b"\n\n")]


def test_a_real_vllm_streams_tokens_are_counted_from_its_size() -> None:
    """The real vLLM's stream (8 tokens, a role event before them, a usage event after):
    its second event's size and the whole size give the count within the two events
    around the tokens (the usage event, asked for here, is the second)."""
    raw = (FIXTURES / "vllm" / "sse-chat.txt").read_bytes()
    events = sse_events(raw)
    usage = json.loads(events[-2][5:])["usage"]["completion_tokens"]
    size = event_bytes(events[1])
    assert size == len(events[1])
    assert usage == 8 and abs(streamed_tokens(len(raw), size) - usage) <= 2
    # not an event stream: nothing to count by
    assert event_bytes(b'{"choices": []}') is None
    # a chunk of several events: their mean; the closing [DONE] not among them
    two = events[1] + events[2] + b"data: [DONE]\n\n"
    assert event_bytes(two) == (len(events[1]) + len(events[2])) / 2
    assert ends_event_stream(two) and not ends_event_stream(events[1])


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
@pytest.mark.parametrize("tokens", [3, 40, 700])
def test_the_twins_streams_are_counted_within_two_tokens(flavor: str, tokens: int) -> None:
    """The engine twin writes each flavor's events (emulator/engine/wire.py): a stream of
    one chunk per token, without usage, counts within 2 of its length (1 %)."""
    from emulator.engine.config import EngineConfig
    from emulator.engine.model.scheduler import Emission
    from emulator.engine.parse import GenRequest
    from emulator.engine.wire import StreamEncoder

    req = GenRequest("chat", 50, tokens, stream=True, include_usage=False, model="m")
    enc = StreamEncoder(req, "r", EngineConfig("e", flavor=flavor))
    emissions = [Emission("r", i, 0.0, i == tokens - 1, 0) for i in range(tokens)]
    chunks = [enc.encode([e])[0] for e in emissions]
    counted = streamed_tokens(sum(map(len, chunks)), event_bytes(chunks[1]) or 0)
    assert abs(counted - tokens) <= max(2, tokens // 100), (counted, tokens)

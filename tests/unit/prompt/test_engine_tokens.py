"""The router tokenizes as the engine does: the chat template, the multi-turn cache (equal
to tokenizing whole), the config's errors, and the shell's tokenization step."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.engine.config import EngineConfig
from emulator.engine.kv_publisher import KvEventsConfig
from emulator.engine.tokenizer import tiny_tokenizer_dir
from emulator.engine.wire import parse_chat
from emulator.vllm.tiny_model import CHAT_TEMPLATE
from ext_proc.config.load import config_from_dict
from ext_proc.envoy import codec
from ext_proc.envoy.encoders import decision_encoder
from ext_proc.envoy.roles import open_session
from ext_proc.estimate.prefix import as_hashes
from ext_proc.prompt.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from ext_proc.prompt.engine_tokens import (
    EngineTokenizer,
    PromptCache,
    PromptTokenizer,
    load_engine_tokenizer,
)
from ext_proc.prompt.parse import CHAT, COMPLETIONS, GENERATE, parse_body
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.prompt.tokens import HfTokenizer, block_hashes_of_ids
from ext_proc.vocab.params import ConfigError
from tests.builders import REGIONS, make_router
from tests.messages import body, headers


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    """The tiny model's tokenizer files (built once into the cache, ~4 s)."""
    return tiny_tokenizer_dir()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> EngineTokenizer:
    loaded = load_engine_tokenizer(TokenizerConfig(str(tiny_dir / "tokenizer.json")))
    assert loaded is not None
    return loaded


def whole(e: EngineTokenizer, messages: list[dict[str, Any]]) -> tuple[int, ...]:
    """The reference: the rendered chat tokenized in one piece, no cache."""
    return tuple(e.tokenizer.ids(e.template.render(messages)))


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": messages, **extra}).encode()


# -- the chat template ---------------------------------------------------------------------


def test_chatml_renders_as_the_engine_does() -> None:
    t = ChatTemplate(CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    assert t.render(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n"  # text parts joined by newlines, as vLLM does
        "<|im_start|>assistant\n<|im_end|>\n"  # no content: ""
        "<|im_start|>assistant\n"  # the generation prompt, on by default
    )
    assert t.render(messages[:1], add_generation_prompt=False).endswith("brief<|im_end|>\n")


def test_the_template_environment_is_the_one_hf_templates_expect(tmp_path: Path) -> None:
    source = (
        "{%- if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}\n"
        "{% for m in messages %}\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ bos_token }}{{ m | tojson }}\n"
        "{% endfor %}\n"
        "{% generation %}{{ flag }}{% endgeneration %}"
    )
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": source, "bos_token": {"content": "<s>"}}))
    t = load_chat_template(config)
    two = [{"role": "user", "content": "<&>"}, {"role": "user", "content": "no"}]
    out = t.render(two, template_kwargs={"flag": "on"})
    # trim_blocks and lstrip_blocks (no stray newlines or indents), tojson without HTML
    # escapes, loop controls, {% generation %}, bos_token from the tokenizer_config.json
    assert out == '<s>{"role": "user", "content": "<&>"}\non'
    with pytest.raises(jinja2.TemplateError, match="user first"):
        t.render([{"role": "system", "content": "x"}])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(
            []
        )


def test_template_files_jinja_or_tokenizer_config(tmp_path: Path) -> None:
    jinja_file = tmp_path / "chat.jinja"
    jinja_file.write_text("{{ eos_token }}{{ messages[0]['content'] }}")
    config = tmp_path / "tokenizer_config.json"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    config.write_text(json.dumps({"eos_token": "</s>", "chat_template": named}))
    # a Jinja file takes its special tokens from the tokenizer_config.json given
    assert load_chat_template(jinja_file, config).render([{"content": "x"}]) == "</s>x"
    assert load_chat_template(config).render([]) == "plain"  # named templates: default
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match=r"bad\.jinja: not a valid Jinja template"):
        load_chat_template(tmp_path / "bad.jinja")


# -- the multi-turn cache: equal to tokenizing whole -------------------------------------


def conversation(rng: random.Random, turns: int) -> list[list[dict[str, Any]]]:
    """Each turn's messages, with text that tempts a tokenizer to merge across a cut:
    leading and trailing whitespace and newlines, digits, unicode, special-token text."""
    pieces = ["hello", " world", "\n", "\n\n", "  ", "42", "x=1;", "é", "e\u0301", "日本",
              "<|im_end|>", "<|im_start|>", "tool", "!", "\t", ""]  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    out = []
    for _ in range(turns):
        user = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        messages.append({"role": "user", "content": user})
        out.append(list(messages))
        answer = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        messages.append({"role": "assistant", "content": answer})
    return out


def test_each_turn_reuses_the_last_and_equals_whole_tokenization(engine: EngineTokenizer) -> None:
    e = EngineTokenizer(engine.tokenizer, engine.template, cache_entries=64)
    rng = random.Random(7)
    conversations = [conversation(rng, 6) for _ in range(8)]
    for turns in zip(*conversations, strict=True):  # interleaved, as live traffic is
        for messages in turns:
            assert e.cache.ids(e.template.render(messages)) == whole(e, messages)
    s = e.cache.stats
    assert s.mismatches == 0
    assert s.hits >= 8 * 5 and s.hits + s.misses == 8 * 6  # each later turn found its last
    assert s.reused_tokens > 2 * s.tokenized_tokens - s.reused_tokens  # mostly reused


# Any text, with the special tokens' own text and whitespace runs mixed in.
TEXT = st.lists(
    st.text(max_size=12) | st.sampled_from(["<|im_end|>", "<|im_start|>", "\n", " ", "\n\n "]),
    max_size=6,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(st.lists(TEXT, min_size=1, max_size=8), st.booleans())
def test_cached_ids_equal_whole_tokenization(
    engine: EngineTokenizer, texts: list[str], answer_first: bool
) -> None:
    e = EngineTokenizer(engine.tokenizer, engine.template, cache_entries=8)
    messages: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        role = "user" if (i % 2 == 0) != answer_first else "assistant"
        messages.append({"role": role, "content": text})
        assert e.cache.ids(e.template.render(messages)) == whole(e, messages)
    assert e.cache.stats.mismatches == 0


def test_the_cache_is_bounded_and_a_plain_text_is_tokenized_whole(engine: EngineTokenizer) -> None:
    e = EngineTokenizer(engine.tokenizer, engine.template, cache_entries=3)
    for i in range(10):
        e.cache.ids(e.template.render([{"role": "user", "content": f"conversation {i}"}]))
    assert len(e.cache) == 3
    text = "no special tokens here"
    assert e.cache.ids(text) == tuple(e.tokenizer.ids(text)) and len(e.cache) == 3


def test_no_reuse_where_a_cut_is_not_exact(tmp_path: Path) -> None:
    """A tokenizer whose first piece is special (Metaspace prepend_scheme: first) or whose
    special tokens swallow what follows (rstrip) has no safe cut: tokenized whole."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    def save(pre: Any, rstrip: bool, name: str) -> HfTokenizer:
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "▁a": 1, "a": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre
        tok.add_special_tokens([AddedToken("<|x|>", rstrip=rstrip, normalized=False)])
        tok.save(str(tmp_path / name))
        return HfTokenizer(tmp_path / name)

    first = save(pre_tokenizers.Metaspace(prepend_scheme="first"), False, "first.json")
    assert first.boundaries()[0] is None and "prepend_scheme" in first.boundaries()[1]
    text = "a<|x|>a"
    # the reason: the tail alone would get the prefix the whole text does not
    assert first.ids(text) != first.ids("a<|x|>") + first.ids("a")
    cache = PromptCache(first.ids, None, 8)
    assert cache.ids(text) == tuple(first.ids(text))
    swallowing = save(pre_tokenizers.Whitespace(), True, "rstrip.json")
    assert swallowing.boundaries()[0] is None
    always = save(pre_tokenizers.Metaspace(prepend_scheme="always"), False, "always.json")
    assert always.boundaries()[0] is not None


# -- config --------------------------------------------------------------------------------


BACKENDS = [{"id": "a", "address": "127.0.0.1:1"}]


def cfg_with(tokenizer: dict[str, Any]) -> Any:
    return config_from_dict({"backends": BACKENDS, "tokenizer": tokenizer})


def test_config_default_is_the_approximation() -> None:
    cfg = config_from_dict({"backends": BACKENDS})
    assert cfg.tokenizer == TokenizerConfig() and load_engine_tokenizer(cfg.tokenizer) is None


def test_config_errors_name_the_key_and_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    tok = str(tiny_dir / "tokenizer.json")
    lone = tmp_path / "lone" / "tokenizer.json"  # a tokenizer.json with no config beside it
    lone.parent.mkdir()
    lone.write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    bare = tmp_path / "tokenizer_config.json"
    bare.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    bad_jinja = tmp_path / "t.jinja"
    bad_jinja.write_text("{% if %}")
    not_json = tmp_path / "broken" / "tokenizer.json"
    not_json.parent.mkdir()
    not_json.write_text("{}")
    (not_json.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x"}))
    cases = [
        ({"path": str(tmp_path / "nope.json")}, r"tokenizer\.path: no such file .*nope\.json"),
        ({"chat_template": str(bare)}, r"tokenizer\.chat_template: a chat template needs tokeni"),
        ({"path": str(lone)}, r"tokenizer\.chat_template: required with tokenizer\.path .*lone"),
        ({"path": tok, "chat_template": str(bare)}, r"chat_template: .*json has no chat_templ"),
        ({"path": tok, "chat_template": str(tmp_path / "x.jinja")}, r"chat_template: no such f"),
        ({"path": tok, "chat_template": str(bad_jinja)}, r"chat_template: .*t\.jinja: not a va"),
        ({"path": str(not_json)}, r"tokenizer\.path: .*broken/tokenizer\.json is not a tokeni"),
        ({"path": tok, "cache_entries": -1}, r"tokenizer\.cache_entries: must be >= 0"),
        ({"path": tok, "vocab": 1}, r"tokenizer\.vocab: unknown key"),
    ]
    for raw, message in cases:
        with pytest.raises(ConfigError, match=message):
            cfg_with(raw)
    cfg = cfg_with({"path": tok, "cache_entries": 10})
    loaded = load_engine_tokenizer(cfg.tokenizer)
    assert loaded is not None and loaded.template.special_tokens["eos_token"] == "<|im_end|>"


# -- the shell's tokenization step ---------------------------------------------------------


def test_a_chat_keeps_what_its_template_reads() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    extra = {"tools": tools, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}}
    llm = parse_body(CHAT, chat_body([{"role": "user", "content": "hi"}], **extra))
    assert llm.chat is not None and llm.chat.messages == ({"role": "user", "content": "hi"},)
    assert llm.chat.tools == tuple(tools) and llm.chat.add_generation_prompt is False
    assert llm.chat.template_kwargs == {"x": 1}
    assert llm.prompts == ("user\nhi\nassistant\n",)  # the approximation's rendering stays
    odd = parse_body(CHAT, chat_body([{"content": "hi"}], tools="no", chat_template_kwargs=[]))
    assert odd.chat is not None and odd.chat.tools is None and odd.chat.template_kwargs == {}
    assert parse_body(COMPLETIONS, json.dumps({"prompt": "x"}).encode()).chat is None


def test_requests_become_token_id_prompts(engine: EngineTokenizer) -> None:
    step = PromptTokenizer(EngineTokenizer(engine.tokenizer, engine.template, 16))
    messages = [{"role": "user", "content": "hello there"}]
    llm = step.apply(parse_body(CHAT, chat_body(messages)))
    assert llm.prompts == (whole(engine, messages),)
    assert llm.prompt_tokens == (len(llm.prompts[0]),) and llm.chat is not None
    text = parse_body(COMPLETIONS, json.dumps({"prompt": ["ab", "cd ef"]}).encode())
    assert step.apply(text).prompts == tuple(
        tuple(engine.tokenizer.ids(p)) for p in ("ab", "cd ef")
    )
    ids = parse_body(GENERATE, json.dumps({"input_ids": [5, 6, 7]}).encode())
    assert step.apply(ids) == ids
    # a chat the template refuses (here: content its '+' cannot join) keeps the approximation
    refused = parse_body(CHAT, chat_body([{"role": 7, "content": "x"}]))
    assert step.apply(refused, "rid-9") == refused and step.failures == 1
    assert step.snapshot()["failures"] == 1 and step.snapshot()["misses"] >= 1


def test_a_routing_session_decides_on_the_engines_ids(engine: EngineTokenizer) -> None:
    r, _ = make_router("gorgo", backends=REGIONS, routing={"block_tokens": 4})
    step = PromptTokenizer(EngineTokenizer(engine.tokenizer, engine.template, 16))
    first = headers("/v1/chat/completions", "tok-1")
    session = open_session(r, decision_encoder(r.cfg), first, codec.decode(first), (), step)
    session.handle(codec.decode(first))
    messages = [{"role": "user", "content": "count me as the engine does " * 4}]
    reply = session.handle(codec.decode(body(chat_body(messages))))
    assert reply is not None and reply.WhichOneof("response") == "request_body"
    ids = whole(engine, messages)
    assert r.recent.decisions[-1].input_tokens == len(ids) > 8
    blocks = r.in_flight["tok-1"].blocks
    assert blocks is not None and list(blocks) == list(as_hashes(block_hashes_of_ids(ids, 4)))


def test_an_emulated_engine_with_the_template_sees_the_same_ids(engine: EngineTokenizer) -> None:
    events = KvEventsConfig.parse('{"enable_kv_cache_events": true}', "vllm")
    cfg = EngineConfig(
        name="e", tokenizer=engine.tokenizer, chat_template=engine.template, kv_events=events
    )
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": " y\n"}]
    req = parse_chat(json.loads(chat_body(messages)), cfg)
    assert req.token_ids == whole(engine, messages) and req.input_tokens == len(req.token_ids)
    assert req.blocks == tuple(block_hashes_of_ids(req.token_ids, cfg.profile.block_tokens))


@pytest.fixture(scope="module")
def bos_engine(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineTokenizer:
    """The tiny tokenizer with a post-processor that puts a BOS before every text (as
    Llama's tokenizers do when special tokens are added)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    out = tmp_path_factory.mktemp("bos")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text((tiny_dir / "tokenizer_config.json").read_text())
    loaded = load_engine_tokenizer(TokenizerConfig(str(out / "tokenizer.json")))
    assert loaded is not None
    return loaded


def test_completions_get_the_bos_the_engine_adds(bos_engine: EngineTokenizer) -> None:
    """vLLM's completions add special tokens by default (completion/protocol.py
    add_special_tokens=True), its chats do not (the template writes them)."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(bos_engine.tokenizer.path))
    bos = raw.token_to_id("<|endoftext|>")
    step = PromptTokenizer(bos_engine)
    text = "a completion prompt that a BOS model must see whole"
    llm = step.apply(parse_body(COMPLETIONS, json.dumps({"prompt": text}).encode()))
    assert llm.prompts == (tuple(raw.encode(text, add_special_tokens=True).ids),)
    assert llm.prompts[0][0] == bos and llm.prompt_tokens == (len(llm.prompts[0]),)
    off = {"prompt": text, "add_special_tokens": False}
    assert step.apply(parse_body(COMPLETIONS, json.dumps(off).encode())).prompts == (
        tuple(raw.encode(text, add_special_tokens=False).ids),
    )
    messages = [{"role": "user", "content": text}]
    chat = step.apply(parse_body(CHAT, chat_body(messages)))
    assert chat.prompts[0][0] != bos and chat.prompts == (whole(bos_engine, messages),)
    # the packing block hashes read matches the ids (the BOS is packed too)
    ids = llm.prompts[0]
    assert list(block_hashes_of_ids(ids, 4)) == list(block_hashes_of_ids(list(ids), 4))


def test_a_requests_own_template_and_continued_message(engine: EngineTokenizer) -> None:
    step = PromptTokenizer(EngineTokenizer(engine.tokenizer, engine.template, 16))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    llm = step.apply(parse_body(CHAT, chat_body(messages, chat_template=own)))
    assert llm.prompts == (tuple(engine.tokenizer.ids("[user] hi\n[assistant] Once\n")),)
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    llm = step.apply(parse_body(CHAT, chat_body(messages, **cont)))
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce"
    assert llm.prompts == (tuple(engine.tokenizer.ids(text)),)


def test_tool_call_arguments_reach_the_template_parsed() -> None:
    """vLLM parses a tool call's JSON arguments before rendering, and makes malformed
    ones {} (vllm/renderers/chat_utils.py _postprocess_messages)."""
    source = (
        "{% for m in messages %}{% for c in m.get('tool_calls', []) %}"
        "{{ c.function.name }}:{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}"
    )
    template = ChatTemplate(source)

    def call(arguments: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "f", "arguments": arguments}}

    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Seoul"}')]},
        {"role": "assistant", "content": "", "tool_calls": [call("{not json"), call("[1]")]},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]
    assert template.render(messages) == 'f:{"city": "Seoul"};f:{};f:{};'


def test_threads_tokenizing_at_once_get_whole_tokenizations(engine: EngineTokenizer) -> None:
    from concurrent.futures import ThreadPoolExecutor

    shared = EngineTokenizer(engine.tokenizer, engine.template, 64)
    rng = random.Random(5)
    turns = conversation(rng, 12)
    with ThreadPoolExecutor(4) as pool:
        got = list(
            pool.map(lambda m: tuple(shared.cache.ids(engine.template.render(m))), turns * 3)
        )
    assert got == [whole(engine, m) for m in turns * 3]
    assert shared.cache.stats.hits > 0


def test_the_cache_is_bounded_by_bytes_as_well(engine: EngineTokenizer) -> None:
    """Long prompts fill the byte bound before the count of entries: the oldest go, the
    count of bytes stays at or under it, and reuse still finds the last turn."""
    limit = 40_000
    cache = PromptCache(engine.tokenizer.ids, engine.tokenizer.boundaries()[0], 512, limit)
    rng = random.Random(3)
    texts = []
    for i in range(40):
        words = " ".join(f"w{rng.randint(0, 999)}" for _ in range(400))
        text = engine.template.render([{"role": "user", "content": f"{i} {words}"}])
        texts.append(text)
        assert cache.ids(text) == tuple(engine.tokenizer.ids(text))
        assert 0 < cache.bytes <= limit
        kept = sum(PromptCache.entry_bytes(e.text, len(e.ids)) for e in cache._lru.values())
        assert cache.bytes == kept  # the count is the entries' own sum
    assert 1 <= len(cache) < 40  # the bytes bound, not the 512 entries, took the old ones
    hits = cache.stats.hits
    follow = texts[-1] + "<|im_start|>assistant\nyes<|im_end|>\n"
    assert cache.ids(follow) == tuple(engine.tokenizer.ids(follow))
    assert cache.stats.hits == hits + 1  # the newest entry is still there to reuse


def test_an_entry_larger_than_the_bound_is_not_kept(engine: EngineTokenizer) -> None:
    cache = PromptCache(engine.tokenizer.ids, engine.tokenizer.boundaries()[0], 8, 100)
    text = engine.template.render([{"role": "user", "content": "x " * 200}])
    assert cache.ids(text) == tuple(engine.tokenizer.ids(text))
    assert (len(cache), cache.bytes) == (0, 0)
    with pytest.raises(ValueError, match="max_bytes"):
        PromptCache(engine.tokenizer.ids, None, 8, -1)

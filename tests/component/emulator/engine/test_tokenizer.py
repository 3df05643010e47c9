"""The twin's tokenizer (emulator/engine/tokenizer.py): the tiny model's tokenizer files built once
into a cache directory (a child process each; two at once end with one complete directory),
the same bytes and token ids as the real tiny model's, what `--tokenizer` accepts, and the
special tokens each engine adds when it encodes a prompt."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.engine.parse import parse_request
from emulator.engine.tokenizer import (
    APPROX_SPEC,
    TOKENIZER_JSON,
    TwinTokenizer,
    cache_root,
    load_twin_tokenizer,
    tiny_tokenizer_dir,
)
from emulator.stack.settings import StackSettings
from emulator.vllm.tiny_model import CHAT_TEMPLATE
from ext_proc.prompt.chat_template import TOKENIZER_CONFIG
from ext_proc.prompt.tokens import APPROX
from ext_proc.vocab.params import ConfigError

# The real tiny model's tokenizer, as emulator/vllm/tiny.py ensure_tiny_model builds it.
REAL_MODEL = StackSettings().vllm_venv / "tiny-model-seed0"
TEXTS = [
    "hello",
    "Hello, world! def f(x): return 3 + y",
    '{"key": [12, "ünïcödé"]}\n\n  spaced   out\ttabs',
    "<|im_start|>user\nhi<|im_end|>\n",
]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Read this:\n" + "doc1 alpha beta " * 40},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "And?"},
    ],
]


def test_a_build_writes_a_model_directory_once(tmp_path: Path) -> None:
    """A child process writes the files (~4 s); later calls find them."""
    t0 = time.monotonic()
    out = tiny_tokenizer_dir(0, tmp_path)
    built_s = time.monotonic() - t0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary directory left
    assert out.name.startswith("tiny-tokenizer-seed0-tokenizers")
    assert sorted(p.name for p in out.iterdir()) == [TOKENIZER_JSON, TOKENIZER_CONFIG]
    config = json.loads((out / TOKENIZER_CONFIG).read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["eos_token"], config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    assert config["model_max_length"] == 4096
    t0 = time.monotonic()
    assert tiny_tokenizer_dir(0, tmp_path) == out
    assert time.monotonic() - t0 < 0.1 < built_s
    print(f"built in {built_s:.1f} s")


def test_a_build_that_loses_the_race_keeps_the_winners_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes build at once: the second rename fails on the first's complete
    directory, which stays; the loser's copy goes. A failed build leaves nothing."""
    built = tiny_tokenizer_dir()

    def build(argv: list[str], **_: object) -> None:  # the child, and another one's win
        final = tmp_path / built.name
        final.mkdir()
        for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
            (final / name).write_bytes((built / name).read_bytes())
            (Path(argv[2]) / name).write_bytes(b"the loser's copy")

    monkeypatch.setattr(subprocess, "run", build)
    out = tiny_tokenizer_dir(0, tmp_path)
    assert out == tmp_path / built.name and [p.name for p in tmp_path.iterdir()] == [out.name]
    assert (out / TOKENIZER_JSON).read_bytes() == (built / TOKENIZER_JSON).read_bytes()

    def fail(argv: list[str], **_: object) -> None:
        raise subprocess.CalledProcessError(1, argv)

    monkeypatch.setattr(subprocess, "run", fail)
    with pytest.raises(subprocess.CalledProcessError):
        tiny_tokenizer_dir(1, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []


def test_the_cache_directory_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GORGO_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "gorgo"
    monkeypatch.setenv("GORGO_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_the_files_and_ids_are_the_real_tiny_models() -> None:
    """Byte for byte the files the real model's save_pretrained wrote, so every id is its
    tokenizer's too (checked on plain texts and chat renderings)."""
    if not (REAL_MODEL / TOKENIZER_JSON).is_file():
        print(f"skipped: no real tiny model at {REAL_MODEL} (`make vllm` builds it)")
        pytest.skip(f"no real tiny model at {REAL_MODEL}")
    ours = load_twin_tokenizer()
    mine = Path(ours.model_dir)
    for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
        assert (mine / name).read_bytes() == (REAL_MODEL / name).read_bytes(), name
    real = TwinTokenizer(REAL_MODEL / TOKENIZER_JSON)
    assert ours.template is not None
    rendered = [ours.template.render(c) for c in CHATS]
    for text in TEXTS + rendered:
        assert ours.tokenizer.ids(text) == real.ids(text), text
    # the real vLLM counts 15 prompt tokens for this chat (tests/fixtures/vllm/errors.json)
    assert len(ours.tokenizer.ids(rendered[0])) == 15


def test_the_tokenizer_flag_takes_tiny_approx_a_file_or_a_directory(tmp_path: Path) -> None:
    tiny = load_twin_tokenizer("tiny")
    assert tiny.model_dir == str(tiny_tokenizer_dir()) and Path(tiny.model_dir).is_absolute()
    approx = load_twin_tokenizer(APPROX_SPEC)
    assert (approx.tokenizer, approx.template, approx.model_dir) == (APPROX, None, "")
    for spec in (tiny.model_dir, f"{tiny.model_dir}/{TOKENIZER_JSON}"):
        same = load_twin_tokenizer(spec)
        assert same.model_dir == tiny.model_dir and same.tokenizer is tiny.tokenizer
    with pytest.raises(ConfigError, match=r"--tokenizer: no such file .*nowhere"):
        load_twin_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="--chat-template: a chat template needs"):
        load_twin_tokenizer(APPROX_SPEC, "t.jinja")
    # a tokenizer without a template beside it needs --chat-template
    (tmp_path / TOKENIZER_JSON).write_bytes((Path(tiny.model_dir) / TOKENIZER_JSON).read_bytes())
    with pytest.raises(ConfigError, match="--chat-template: required with --tokenizer"):
        load_twin_tokenizer(str(tmp_path))
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    loaded = load_twin_tokenizer(str(tmp_path), str(tmp_path / "t.jinja"))
    assert loaded.template is not None and loaded.template.render(CHATS[0]) == "hi"


def test_a_chat_turn_tokenizes_only_what_it_added() -> None:
    template = load_twin_tokenizer().template
    assert template is not None
    first, second = template.render(CHATS[1][:2]), template.render(CHATS[1])
    whole = TwinTokenizer(tiny_tokenizer_dir() / TOKENIZER_JSON, cache_entries=0).ids(second)
    tok = TwinTokenizer(tiny_tokenizer_dir() / TOKENIZER_JSON)  # a cache of its own
    n_first = len(tok.ids(first))
    assert tok.ids(second) == whole
    # turn 1 up to its last special token (the <|im_start|> before "assistant\n") is reused
    reused = n_first - len(TwinTokenizer(tiny_tokenizer_dir() / TOKENIZER_JSON).ids("assistant\n"))
    stats = tok.cache.stats
    assert (stats.misses, stats.hits, stats.reused_tokens) == (1, 1, reused)
    assert stats.tokenized_tokens == n_first + len(whole) - reused


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer with a post-processor that puts a BOS before every text (as
    Llama's do when special tokens are added)."""
    from tokenizers import Tokenizer, processors

    tiny = tiny_tokenizer_dir()
    tok = Tokenizer.from_file(str(tiny / TOKENIZER_JSON))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    out = tmp_path_factory.mktemp("bos")
    tok.save(str(out / TOKENIZER_JSON))
    (out / TOKENIZER_CONFIG).write_bytes((tiny / TOKENIZER_CONFIG).read_bytes())
    return out


@pytest.mark.parametrize("flavor", [SGLANG, VLLM])
def test_each_engine_adds_special_tokens_where_it_does(bos_dir: Path, flavor: str) -> None:
    """vLLM: completions add them unless add_special_tokens is false (completion/protocol.py
    default true), chat only when asked (default false). SGLang: text prompts always
    (tokenizer_manager.py encodes with the tokenizer's default), chat never."""
    tokens = load_twin_tokenizer(str(bos_dir))
    assert isinstance(tokens.tokenizer, TwinTokenizer) and tokens.tokenizer.adds_special_tokens
    cfg = EngineConfig(
        name="e",
        flavor=flavor,
        model="m",
        tokenizer=tokens.tokenizer,
        chat_template=tokens.template,
    )
    plain = len(tokens.tokenizer.ids("hello"))
    assert plain == 4

    def prompt_tokens(kind: str, body: dict[str, object]) -> int:
        return parse_request(kind, json.dumps({"model": "m", **body}).encode(), cfg).input_tokens  # type: ignore[arg-type]

    chat = len(tokens.tokenizer.ids(tokens.template.render(CHATS[0]))) if tokens.template else 0
    assert prompt_tokens("completion", {"prompt": "hello"}) == plain + 1
    assert prompt_tokens("chat", {"messages": CHATS[0]}) == chat == 15
    asked = {"add_special_tokens": False}
    if flavor == VLLM:
        assert prompt_tokens("completion", {"prompt": "hello", **asked}) == plain
        assert prompt_tokens("chat", {"messages": CHATS[0], "add_special_tokens": True}) == 16
    else:  # SGLang's requests have no such field: unchanged
        assert prompt_tokens("completion", {"prompt": "hello", **asked}) == plain + 1
        assert prompt_tokens("generate", {"text": "hello"}) == plain + 1
        assert prompt_tokens("chat", {"messages": CHATS[0], "add_special_tokens": True}) == 15

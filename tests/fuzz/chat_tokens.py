"""The chat template and tokenizer path (ext_proc/prompt/engine_tokens.py, chat_template.py):
any request body, chats and completions, rendered through the model's chat template (or
a request's own `chat_template`) and tokenized by the tiny model's tokenizer.json, with
the multi-turn cache kept from input to input.

Invariant: the shell's tokenization step never raises (a body it cannot render or
tokenize keeps the approximation and is counted); what it tokenizes holds as many ids as
it counts, and the cache's ids equal the text tokenized whole; no input takes long (a
request's own template runs in the sandbox)."""

from __future__ import annotations

import logging

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    from emulator.engine.tokenizer import tiny_tokenizer_dir
    from ext_proc.prompt.engine_tokens import PromptTokenizer, load_engine_tokenizer
    from ext_proc.prompt.parse import CHAT, ParseError, parse_body
    from ext_proc.prompt.tokenizer_config import TokenizerConfig

from tests.fuzz.body import body_of
from tests.fuzz.runner import fuzz

logging.disable(logging.CRITICAL)

NAME = "chat_tokens"
_engine = load_engine_tokenizer(TokenizerConfig(str(tiny_tokenizer_dir() / "tokenizer.json")))
assert _engine is not None
ENGINE = _engine
STEP = PromptTokenizer(ENGINE)


def one_input(data: bytes) -> None:
    api, body = body_of(data)
    try:
        llm = parse_body(api, body)
    except ParseError:
        return
    failures = STEP.failures
    out = STEP.apply(llm, "fuzz")
    if out is llm:
        assert STEP.failures == failures + 1  # counted, the approximation kept
        return
    assert out.prompt_tokens == tuple(len(p) for p in out.prompts)
    assert all(isinstance(p, tuple) for p in out.prompts)
    if llm.chat is not None:
        text = ENGINE.render(llm.chat)
        whole = tuple(ENGINE.tokenizer.ids(text))
        if llm.add_special_tokens:
            whole = (*ENGINE.prefix_ids, *whole, *ENGINE.suffix_ids)
        assert out.prompts[0] == whole, "the cache's ids differ from the text's own"
    else:
        assert api != CHAT


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()

"""The replay's synthesized prompts (loadgen/traces/prompts.py) count exactly the trace's
tokens under the emulated engines' default tokenizer, the tiny model's BPE, as under the
4-bytes-per-token approximation: the replay reproduces trace lengths on a fleet of twins."""

from __future__ import annotations

from emulator.engine.tokenizer import TwinTokenizer, load_twin_tokenizer
from ext_proc.prompt.tokens import count_tokens
from loadgen.traces.prompts import TINY_WORDS, PromptSynth
from loadgen.traces.request import TraceRequest

TOKENS = load_twin_tokenizer()


def test_every_word_is_one_token_of_the_tiny_vocabulary() -> None:
    tok = TOKENS.tokenizer
    assert isinstance(tok, TwinTokenizer)
    assert len(TINY_WORDS) == len(set(TINY_WORDS)) == 213
    for word in TINY_WORDS:
        assert len(tok.ids(f" {word}")) == 1 and count_tokens(f" {word}") == 1, word


def test_a_synthesized_prompt_counts_the_trace_tokens_under_both() -> None:
    synth = PromptSynth()
    assert TOKENS.template is not None
    header = len(TOKENS.tokenizer.ids(TOKENS.template.render([{"role": "user", "content": ""}])))
    for n_in in (1, 511, 513, 4096):
        ids = tuple(range(100, 100 + -(-n_in // 512)))
        text = synth.prompt(TraceRequest(0, 0.0, n_in, 1, ids, 512, "s"))
        assert count_tokens(text) == len(TOKENS.tokenizer.ids(text)) == n_in
        # as a chat's one user message: the template's own tokens around it, no merges
        chat = TOKENS.template.render([{"role": "user", "content": text}])
        assert len(TOKENS.tokenizer.ids(chat)) == n_in + header

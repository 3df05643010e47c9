"""Prompt synthesis: trace block ids into text the project's tokenizer counts exactly (4
bytes per token). Every block id maps to its own deterministic text, so requests that
share leading ids share byte-identical prefixes.
"""

from __future__ import annotations

import numpy as np

from loadgen.traces.request import MOONCAKE_BLOCK_TOKENS, TraceRequest

# 3-letter words, each with a leading space: 4 bytes, one token under the project's
# approximation, and one token too under the tiny model's byte-level BPE (the emulated
# engines' default tokenizer, emulator/engine/tokenizer.py): each " xyz" is one vocabulary
# entry, and its pre-tokenizer cuts text before every space + letters, so words never merge.
# tests/component/loadgen/traces/test_prompt_tokens.py checks both counts.
_TINY_WORDS = (
    "ail aim ard ast bal ber bit bix bom bor bos bra bre bri bum bus bux byl byx cai cas "
    "cee cen cer ces cha che chi chy cil cim cin cir col com cus cut cyl cyr cyx dam dee "
    "del dim din dit dom don dos dot dou dun dyr eam eel een fat fax fea fen fet fit fou "
    "fox fun fur fus fut fyt gao gea gim gis gix gor gra gur gyr hax hee hex hin hir hoo "
    "hun hyx iom iox jam jar jex jil jou jum jut kam ket kol koo kot kum kyt ler lil lin "
    "lix lom los lul lum lyt mai mam mer mil mit mom mou mut mux mym myn nas nee nel nen "
    "nit non noo nun nut nyx ool oon oum oux pen pex pir pis ple poo pou pur pux pyl qua "
    "rax ret rix rur rux rys sas sat sax sea see sem ses shy sil sou sti stu sum sur sus "
    "sut syl tai tan tat tea ter thu til tit tol tos tra tri tro tur tyn tyx vat vax vee "
    "ver vio vor vum vur vut vux vyl vym vyt vyx wai wan was woo wor zex zin zio zir zou "
    "zut zyn zyx"
)
TINY_WORDS = _TINY_WORDS.split()
_WORDS = np.array([f" {w}" for w in TINY_WORDS], dtype="S4").view(np.uint32)
_N_WORDS = np.uint64(len(_WORDS))
_POSITIONS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
# splitmix64 constants
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def block_text(block_id: int, tokens: int) -> str:
    """Deterministic text for one block: `tokens` words of a space and 3 letters (4 bytes,
    1 token each under the approximation and the tiny model's BPE alike: TINY_WORDS). Word
    j is a hash (splitmix64) of the block id and j alone, so fewer tokens give a prefix of
    the block's longer text (a partial last block matches the full block's start). ~18 us
    per 512-token block: the replay synthesizes prompts while it streams."""
    pos = _POSITIONS if tokens <= len(_POSITIONS) else np.arange(tokens, dtype=np.uint64)
    x = pos[:tokens] + np.uint64((block_id * _GOLDEN) & 0xFFFFFFFFFFFFFFFF)
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return _WORDS.take(x % _N_WORDS).tobytes().decode("ascii")


class PromptSynth:
    """Trace block ids -> prompt text, with a cache of recent blocks (prefixes repeat)."""

    def __init__(self, cache_blocks: int = 20_000) -> None:
        self._cache: dict[tuple[int, int], str] = {}
        self._cache_blocks = cache_blocks

    def _block(self, block_id: int, tokens: int) -> str:
        key = (block_id, tokens)
        text = self._cache.get(key)
        if text is None:
            if len(self._cache) >= self._cache_blocks:
                self._cache.pop(next(iter(self._cache)))
            text = self._cache[key] = block_text(block_id, tokens)
        return text

    def prompt(self, r: TraceRequest) -> str:
        """Exactly r.input_tokens tokens; the last block may be partial."""
        parts = []
        left = r.input_tokens
        for block_id in r.block_ids:
            n = min(r.block_tokens, left)
            if n <= 0:
                break
            parts.append(
                self._block(block_id, n) if n == r.block_tokens else block_text(block_id, n)
            )
            left -= n
        return "".join(parts)

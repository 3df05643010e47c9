from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ext_proc.prompt.tokens import APPROX, HfTokenizer, count_tokens


@given(st.text(max_size=200))
def test_count_is_ceil_of_utf8_bytes_over_four(text: str) -> None:
    assert count_tokens(text) == -(-len(text.encode()) // 4) == count_tokens(text.encode())


@given(st.text(min_size=1, max_size=50), st.text(max_size=50), st.text(max_size=50))
def test_block_hashes_share_exactly_the_common_full_blocks(base: str, a: str, b: str) -> None:
    bt = 4  # 16 bytes per block
    prefix = (base * 64)[:160]  # 10 full blocks of ASCII-or-not text
    ha = APPROX.block_hashes(prefix + a, bt)
    hb = APPROX.block_hashes(prefix + b, bt)
    common_blocks = len(prefix.encode()) // 16
    assert ha[:common_blocks] == hb[:common_blocks]
    assert len(ha) == len((prefix + a).encode()) // 16


def test_a_different_first_block_changes_every_hash() -> None:
    x = APPROX.block_hashes("a" * 64 + "z" * 64, 4)
    y = APPROX.block_hashes("b" * 64 + "z" * 64, 4)
    assert len(x) == len(y) == 8 and not set(x) & set(y)  # chained: later blocks differ too


def make_tokenizer_json(path: Path) -> Path:
    """A small real tokenizer built locally (word level), nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["the", "cat", "sat", "on", "a", "mat"]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_real_tokenizer_from_a_local_file(tmp_path: Path) -> None:
    tok = HfTokenizer(make_tokenizer_json(tmp_path))
    assert tok.count("the cat sat on the mat") == 6
    assert tok.count("the dog") == 2  # unknown words still count
    h1 = tok.block_hashes("the cat sat on a mat the cat", 2)
    h2 = tok.block_hashes("the cat sat on a dog", 2)
    assert len(h1) == 4 and h1[:2] == h2[:2] and h1[2] != h2[2]


def test_tokenizer_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        HfTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"not a tokenizer\.json"):
        HfTokenizer(bad)

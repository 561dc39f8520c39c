"""Stop strings: the incremental matcher against a search of the whole text, and what
``txlm.generate`` returns against the same draws cut by hand."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.helpers.models import spread_weights
from txlm.config import ModelConfig
from txlm.data.vocab import Vocab
from txlm.errors import ConfigError
from txlm.inference.generate import generate
from txlm.inference.stops import Continuation, StopMatcher
from txlm.model import TransformerXL


def first_stop(text: str, stops) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


@pytest.mark.parametrize("seed", range(6))
def test_the_incremental_matcher_finds_what_a_whole_search_finds(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["ab", "bba", "c", "aaaa"][: 1 + seed % 4]
    for _ in range(50):
        matcher, text = StopMatcher(stops), ""
        final = "".join(rng.choice("abc" if seed % 4 else "ab") for _ in range(30))
        shown = 0
        while len(text) < len(final):
            text = final[: len(text) + rng.randint(1, 4)]
            safe = matcher.safe(text)
            assert matcher.feed(text) == first_stop(text, stops)
            # what is shown never has to be taken back
            cut = first_stop(final, stops)
            want = final if cut is None else final[:cut]
            assert shown <= safe <= len(want) and text[:safe] == want[:safe]
            shown = safe


def test_a_stop_string_inside_a_token_drops_that_token() -> None:
    vocab = Vocab.build_word(Counter(["the", "cat", "sat", "on", "a", "mat"]))
    ids = [vocab.id_of(w) for w in ["the", "cat", "sat", "on"]]
    row = Continuation(vocab.decode, [], stops=["at s"])
    done = [row.push(i) for i in ids]
    assert done == [False, False, True, True]  # "the cat sat" holds "at s"; then ended
    assert row.text() == "the c"
    assert row.kept_ids() == ids[:1]  # "cat" holds text before the stop string: dropped
    row = Continuation(vocab.decode, [ids[0]], stops=[" sat"])
    for i in ids[1:]:
        row.push(i)
    assert row.text() == " cat" and row.kept_ids() == ids[1:2]  # matched after the prompt


def test_stop_strings_need_text() -> None:
    with pytest.raises(ConfigError, match="vocabulary"):
        Continuation(None, [1], stops=["x"])
    with pytest.raises(ConfigError, match="non-empty"):
        StopMatcher([""])


CHARS = "abcdefgh .\n"


@pytest.fixture(scope="module")
def char_model():
    vocab = Vocab.build_char(Counter(CHARS))
    config = ModelConfig.from_preset("debug", vocab_size=len(vocab), tgt_len=4, mem_len=40)
    torch.manual_seed(2)
    return spread_weights(TransformerXL(config).eval(), 0.25), vocab


def test_generate_ends_each_row_before_its_first_stop_string(char_model) -> None:
    model, vocab = char_model
    prompts = [vocab.encode("abc"), vocab.encode("h. ")]
    kw = dict(max_new_tokens=30, seed=3, num_samples=3, top_k=None)  # (<unk> banned)
    free = generate(model, prompts, vocab=vocab, **kw)
    texts = [vocab.decode(r) for r in free]
    # two-character stops, and one that some rows never meet
    stops = [texts[0][7:9], texts[4][12:14], "zz"]
    got = generate(model, prompts, vocab=vocab, stop=stops, **kw)
    cut_rows = 0
    for row, text, ids in zip(got, texts, free, strict=True):
        cut = first_stop(text, stops)
        if cut is None:
            assert row == ids
        else:  # a character vocabulary: the ids before the stop string, one per character
            cut_rows += 1
            assert row == ids[:cut] and vocab.decode(row) == text[:cut]
    assert 2 <= cut_rows < len(got)  # rows stop independently


def test_unk_is_banned_by_default_unless_the_prompt_holds_it(char_model) -> None:
    model, vocab = char_model
    unk = vocab.unk_id
    assert unk is not None
    favour = spread_weights(TransformerXL(model.config).eval(), 0.25)
    favour.load_state_dict(model.state_dict())
    with torch.no_grad():  # a model that draws <unk> often
        favour.softmax._weights(0)[1][unk] += 4.0
    kw = dict(max_new_tokens=30, seed=0, top_k=None)
    prompt = vocab.encode("abc")
    assert unk in generate(favour, prompt, ban=(), vocab=vocab, **kw)[0]
    assert unk in generate(favour, prompt, **kw)[0]  # no vocabulary: nothing known to ban
    assert unk not in generate(favour, prompt, vocab=vocab, **kw)[0]
    assert unk in generate(favour, [*prompt, unk], vocab=vocab, **kw)[0]
    # a batch shares its bans: a prompt without <unk> beside one with it never draws it
    rows = generate(favour, [prompt, [*prompt, unk]], vocab=vocab, **kw)
    assert unk not in rows[0] + rows[1]
    assert unk not in generate(favour, prompt, vocab=vocab, ban=["<unk>", "a"], **kw)[0]

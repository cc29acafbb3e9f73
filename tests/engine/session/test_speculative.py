"""Speculative decoding from the chat's own text: drafts, acceptance, exact answers."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from engine.errors import EngineError
from engine.events import TokenChunk
from engine.session import speculative
from engine.session.sampling import AnswerStream, SamplingParams
from engine.session.session import Session
from tests.engine.session.batch_noise import batch_noise, first_divergence
from tests.engine.tinymodels import CORPUS, loaded_for_session, make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, speculative="off")


def test_index_proposes_what_followed_the_longest_suffix() -> None:
    index = speculative.ContextIndex()
    index.extend([1, 2, 3, 4, 5, 9, 3, 4, 7, 8])
    # "3 4" occurred twice; the latest one was followed by 7 8.
    assert index.propose([3, 4], 2).tokens == [7, 8]
    # The longer suffix "2 3 4" wins over "3 4".
    assert index.propose([2, 3, 4], 3).tokens == [5, 9, 3]
    assert index.propose([42], 3).tokens == []


def test_index_survives_a_cut_and_continues_a_loop() -> None:
    index = speculative.ContextIndex()
    index.sync([5, 6, 7, 5, 6, 8])
    index.sync([5, 6, 7])  # a cut: the entry for "5 6" -> 8 is gone
    # What followed "5 6" in the kept ids, never the cut 8.
    assert index.propose([5, 6], 2).tokens == [7, 5]
    index.extend([5, 6, 9])
    assert index.propose([5, 6], 1).tokens == [9]
    # A cut answer that repeated the document does not cost the document's entries.
    index.sync([4, 1, 2, 3, 5])
    index.extend([1, 2, 3, 9])
    index.sync([4, 1, 2, 3, 5])
    assert index.propose([2, 3], 1).tokens == [5]
    index.sync([1, 2, 1, 2])
    # The match runs into the pending token: the loop goes on past it.
    assert index.propose([1], 4).tokens == [2, 1, 2, 1]
    index.sync([7, 8, 9, 7, 8])
    assert index.propose([9], 5).tokens == [7, 8, 9, 7, 8]


def _reference(ids: list[int], pending: list[int], count: int) -> list[int] | None:
    """The longest suffix's latest earlier occurrence, by brute force (None: no match)."""
    whole = ids + pending
    for n in range(speculative.MAX_NGRAM, speculative.MIN_NGRAM - 1, -1):
        suffix = whole[-n:]
        for at in range(len(ids) - 1, n - 1, -1):
            if ids[at - n:at] == suffix:
                return whole[at:at + count]
    return None


def _follows_an_occurrence(whole: list[int], held: int, draft: list[int]) -> bool:
    """Whether ``draft`` is what followed an earlier occurrence of a suffix of ``whole``."""
    for n in range(speculative.MAX_NGRAM, speculative.MIN_NGRAM - 1, -1):
        for at in range(n, held):
            if whole[at - n:at] == whole[-n:]:
                rest = whole[at:]
                if [rest[i % len(rest)] for i in range(len(draft))] == draft:
                    return True
    return False


def test_index_agrees_with_a_brute_force_search() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 40, 3000).tolist()
    index = speculative.ContextIndex()
    index.sync(ids[:1000])
    index.extend(ids[1000:2900])  # grows the table: rebuilt from the ids
    agreed = 0
    for end in range(2900, 3000):
        held, pending = ids[:end], [ids[end]]
        got = index.propose(pending, 6).tokens
        want = _reference(held, pending, 6)
        assert (want is None) == (got == [])
        # A collision may cost the latest occurrence, never a wrong draft.
        assert _follows_an_occurrence(held + pending, len(held), got)
        agreed += got[:len(want)] == want if want else 1
        index.extend(pending)
    # The table is lossy (no probing): most lookups still find the latest occurrence.
    assert agreed >= 80


def test_index_proposes_the_same_whatever_it_held_before() -> None:
    # A chat's drafts (and so its passes, and a seeded sample's draws) must not
    # depend on what was answered before: a regenerated answer, or the bench's
    # repeats, start from the same ids after different histories.
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 30, 1500).tolist()
    other = rng.integers(0, 30, 1900).tolist()
    at_once = speculative.ContextIndex()
    at_once.sync(ids)
    token_by_token = speculative.ContextIndex()
    for token in ids:
        token_by_token.extend([token])
    after_a_cut = speculative.ContextIndex()
    after_a_cut.sync([*ids[:1000], *other])  # a longer answer, cut back to 1000 ids
    after_a_cut.sync(ids)
    probes = [ids[i:i + 3] for i in rng.integers(3, len(ids) - 3, 300)]
    proposals = [[index.propose(p, 6) for p in probes]
                 for index in (at_once, token_by_token, after_a_cut)]
    assert proposals[0] == proposals[1] == proposals[2]


def test_index_memory_at_262k_tokens_is_a_few_bytes_per_token() -> None:
    tokens = 262_144
    ids = np.random.default_rng(0).integers(0, 49_152, tokens, dtype=np.int32)
    index = speculative.ContextIndex()
    index.sync(ids[:100_000])
    index.extend(ids[100_000:])
    assert len(index) == tokens
    # ids (int32, a doubling buffer) and a power-of-two table of int32 slots.
    assert index.nbytes <= 4 * 2 * tokens + 4 * 2 * speculative.SLOTS_PER_ENTRY * (
        speculative.MAX_NGRAM * tokens)
    # A 4-gram of the document proposes what followed it there.
    assert index.propose(ids[5000:5004].tolist(), 4).tokens == ids[5004:5008].tolist()


def test_index_says_how_long_a_suffix_it_matched() -> None:
    index = speculative.ContextIndex()
    index.extend([1, 2, 3, 4, 5, 9, 3, 4, 7, 8])
    assert index.propose([2, 3, 4], 2) == speculative.Proposal([5, 9], 3)
    assert index.propose([8, 3, 4], 2) == speculative.Proposal([7, 8], 2)
    assert index.propose([42], 2) == speculative.NO_PROPOSAL


def _drafter(backend: str = "cpu") -> speculative.Drafter:
    return speculative.Drafter(speculative.ROW_COST[backend])


def test_drafter_verifies_only_what_pays_for_its_rows() -> None:
    four, one = speculative.Proposal([7] * 8, 4), speculative.Proposal([7] * 8, 1)
    # The priors: on a CPU no match of up to three tokens is worth a draft before
    # the text shows it repeats; a longer one (a phrase, a quote, a loop) is, and a
    # longer match never gets a shorter draft.
    sizes = [_drafter().draft_size(speculative.Proposal([7] * 8, n), 100)
             for n in range(1, speculative.MAX_MATCH + 1)]
    assert sizes[:3] == [0, 0, 0] and sizes[3] > 0
    assert sizes == sorted(sizes)
    # Where a row costs little (Metal), a longer match pays at once, a single token not.
    assert _drafter("gpu").draft_size(four, 100) > 0
    assert _drafter("gpu").draft_size(one, 100) == 0
    assert _drafter("gpu").draft_size(four, 0) == 0
    assert _drafter("gpu").draft_size(speculative.NO_PROPOSAL, 100) == 0

    sure = _drafter()
    for _ in range(20):
        sure.record(4, 8, 8)
    assert sure.acceptance(4) > 0.9
    # Long drafts once they are always accepted, still bounded by the room left.
    assert sure.draft_size(four, 100) >= 6
    assert sure.draft_size(four, 3) == 3
    for _ in range(20):
        sure.record(4, 2, 0)
    assert sure.acceptance(4) < 0.2 and sure.draft_size(four, 100) == 0
    # Each match length learns on its own: a shorter match's successes never
    # shield a longer one's failures.
    assert sure.acceptance(3) == pytest.approx(speculative.PRIOR_ACCEPTANCE[2])


def test_drafter_learns_from_proposals_plain_decoding_left_unverified() -> None:
    index = speculative.ContextIndex()
    drafter = _drafter()
    for length in speculative.MATCH_BANDS:
        for _ in range(3):
            drafter.record(length, 4, 0)
    phrase = list(range(11, 31))
    index.extend([1, 2, *phrase, 3, 4])
    lengths = (1, 4, speculative.MAX_MATCH)
    before = [drafter.acceptance(n) for n in lengths]
    # The answer repeats the document's phrase: each token is held, then watched.
    wanted = []
    for token in phrase:
        index.extend([token])
        drafter.watch(token, index)
        wanted.append(drafter.wants_draft())
    after = [drafter.acceptance(n) for n in lengths]
    # The copy's tokens were judged at the match length each was proposed at: the
    # first at one token, then ever longer ones.
    assert after[0] > before[0] and after[1] > before[1]
    assert after[2] > 0.5 > before[2]
    # Pessimistic at first, it asks for a draft once the repetition has shown.
    assert not wanted[0] and wanted[-1]
    # The watched proposal goes on where plain decoding paused: in the document
    # the phrase was followed by 3 4.
    assert drafter.continuation(3).tokens[:1] == [4]
    assert drafter.continuation(3).match_length == speculative.MAX_MATCH
    # ...and a token it did not predict counts as a rejection at the match reached.
    misses = drafter.misses[-1]
    assert drafter.continuation(99) == speculative.NO_PROPOSAL
    index.extend([99])
    drafter.watch(99, index)
    assert drafter.misses[-1] > misses


def test_a_proposal_knows_how_long_its_match_runs_back() -> None:
    index = speculative.ContextIndex()
    phrase = list(range(11, 41))
    index.extend([1, 2, *phrase[:8], 3, *phrase, 4])
    # The lookup key is at most four tokens; the match is measured further back.
    assert index.propose([11, 12, 13, 14, 15, 16], 2) == speculative.Proposal([17, 18], 6)
    assert index.propose(phrase[:20], 2).match_length == speculative.MAX_MATCH
    assert index.propose([9, 14], 1) == speculative.Proposal([15], 1)
    assert [speculative.band(n) for n in (1, 4, 5, 7, 8, 99)] == [0, 3, 4, 4, 5, 5]


class _Counter:
    """A cache layer that only counts its tokens, and trims like a paged one."""

    def __init__(self, tokens: int) -> None:
        self.offset = tokens
        self.state = ()

    def is_trimmable(self) -> bool:
        return True

    def trim(self, count: int) -> int:
        self.offset -= count
        return count


class _Scripted:
    """A model whose next token after position p is ``script[p + 1]``, whatever it is fed:
    the answer is known, so the drafter's choices show in the passes alone."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab, self.passes = script, vocab, []

    def __call__(self, inputs: mx.array, cache: list[_Counter]) -> mx.array:
        start, count = cache[0].offset, inputs.shape[1]
        cache[0].offset += count
        self.passes.append(count)
        nexts = mx.array([self.script[p + 1] for p in range(start, start + count)])
        return (mx.arange(self.vocab)[None] == nexts[:, None]).astype(mx.float32)[None] * 10


def _scripted_answer(tokenizer, prompt: list[int], answer: list[int]) -> tuple[AnswerStream,
                                                                               _Scripted]:
    vocab = len(tokenizer.get_vocab())
    model = _Scripted(prompt + answer + [answer[-1]], vocab)
    cache = [_Counter(len(prompt) - 1)]
    sampling = SamplingParams(temperature=0.0, max_tokens=len(answer), speculative="lookup")
    stream = AnswerStream(model, cache, tokenizer, frozenset(), list(prompt[:-1]), sampling,
                          request_id=1, cancel=threading.Event(), emit=lambda _: None,
                          tick=lambda: None)
    assert stream.run(prompt, len(answer)) == "length"
    assert stream.generated == answer and cache[0].offset == len(prompt) + len(answer) - 1
    return stream, model


def test_drafts_go_where_the_answer_repeats_the_context_and_nowhere_else(tiny) -> None:
    tokenizer = tiny["llama"].tokenizer
    rng = np.random.default_rng(7)
    words = [i for i in range(10, len(tokenizer.get_vocab())) if i not in (0, 2)]
    document = rng.choice(words, 3000).tolist()
    prompt = [*document, *rng.choice(words, 5).tolist()]

    # A quote: after a few plain tokens show the match, long drafts, nearly all kept.
    quote, _ = _scripted_answer(tokenizer, prompt, document[1200:1296])
    assert quote.steps <= 96 / 4 and quote.accepted_tokens >= 0.9 * quote.draft_tokens
    # A loop of the answer's own making is found the same way.
    loop, _ = _scripted_answer(tokenizer, prompt, rng.choice(words, 6).tolist() * 16)
    assert loop.steps <= 96 / 2
    # Text the context never held: one-token matches abound (every id is in the
    # document), yet hardly a draft is verified, so plain decoding's cost stays.
    fresh, model = _scripted_answer(tokenizer, prompt, rng.choice(words, 96).tolist())
    assert fresh.draft_tokens <= 4 and fresh.steps >= 96 - 1
    assert sum(count > 1 for count in model.passes) <= 4


def test_accepted_prefix_is_the_samplers_agreement() -> None:
    assert speculative.accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2
    assert speculative.accepted_prefix([4, 5], [4, 5, 3]) == 2
    assert speculative.accepted_prefix([], [3]) == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spec-models")
    return {arch: loaded_for_session(make_tiny_model_dir(root, arch))
            for arch in ("llama", "qwen3_next", "gemma3_text")}


def _answer(session: Session, messages, sampling: SamplingParams):
    events: list[object] = []
    reason, stats = session.chat(messages, sampling, request_id=1, cancel=threading.Event(),
                                 emit=events.append, tick=lambda: None)
    ids = [i for e in events if isinstance(e, TokenChunk) for i in e.token_ids]
    return reason, stats, ids


def _messages() -> list[dict[str, str]]:
    return [{"role": "user", "content": CORPUS + "\nRepeat the text above."}]


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text"])
@pytest.mark.parametrize("mode", ["fp16", "q6"])
@pytest.mark.parametrize("policy", ["always", "learnt"])
def test_greedy_answer_agrees_with_plain_decoding_up_to_a_near_tie(
        tiny, arch: str, mode: str, policy: str, request: pytest.FixtureRequest) -> None:
    if policy == "always":
        request.getfixturevalue("always_draft")
    plain = Session("plain", tiny[arch], mode)
    plain_reason, _, expected = _answer(plain, _messages(), GREEDY)
    spec = Session("spec", tiny[arch], mode)
    reason, stats, got = _answer(spec, _messages(), replace(GREEDY, speculative="lookup"))
    assert stats.decode_steps <= len(got) + 1
    if policy == "always":
        assert stats.draft_tokens > 0
    # The cache holds exactly the ids the session says it holds, and so does the
    # index (plain passes between drafts included).
    assert spec.stats().tokens == len(spec.tokens)
    assert spec.context_index.ids.tolist() == spec.tokens
    first = first_divergence(expected, got)
    if first is None:
        assert (reason, len(got)) == (plain_reason, len(expected))
        return
    # A (k+1)-row verification rounds the model's matmuls differently from one row:
    # the answers may part only where plain decoding's own batch-size noise (one row
    # a pass vs MAX_DRAFT + 1 rows, measured here on the same answer) can flip the
    # top token.
    prompt = plain.prompt(_messages(), add_generation_prompt=True).ids
    noise = batch_noise(plain, prompt, expected, speculative.MAX_DRAFT + 1)
    assert noise.margins[first] < noise.threshold, (arch, mode, first, noise)


def test_batch_noise_is_small_next_to_the_margins(tiny) -> None:
    session = Session("noise", tiny["llama"], "fp16")
    _, _, answer = _answer(session, _messages(), GREEDY)
    prompt = session.prompt(_messages(), add_generation_prompt=True).ids
    noise = batch_noise(session, prompt, answer, speculative.MAX_DRAFT + 1)
    # Every position of the answer, and the one where it stopped.
    assert len(noise.margins) == len(noise.deltas) == len(answer) + 1
    # Batching moves logits by rounding only: far less than a typical margin, and
    # a flip only ever happens at a near-tie.
    assert 0 <= noise.threshold < float(np.median(noise.margins))
    assert all(noise.margins[i] < noise.threshold for i in noise.flips)
    # The session is back at the prompt, ready for the next answer.
    assert session.tokens == prompt[:-1]


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
@pytest.mark.usefixtures("always_draft")
def test_sampled_answers_with_processors_keep_the_cache_consistent(tiny, arch: str) -> None:
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1,
                              max_tokens=30, seed=5, speculative="lookup")
    session = Session("sampled", tiny[arch], "q8")
    reason, stats, ids = _answer(session, _messages(), sampling)
    assert reason in ("stop", "length") and 0 < len(ids) <= 30
    assert stats.draft_tokens > 0 and stats.accepted_tokens <= stats.draft_tokens
    assert session.stats().tokens == len(session.tokens)
    # Same seed, same answer: every decision is made from token counts.
    again = Session("again", tiny[arch], "q8")
    assert _answer(again, _messages(), sampling)[2] == ids


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
@pytest.mark.parametrize("seed", [5, 11])
@pytest.mark.usefixtures("always_draft")
def test_a_seed_gives_the_same_answer_with_drafts_as_without(tiny, arch: str,
                                                             seed: int) -> None:
    # A verification drew all its rows from one seed: what a seed gave depended on
    # which drafts were tried (and so on the machine, and on other chats answering).
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=seed)
    drafted = _answer(Session("drafted", tiny[arch], "q8"), _messages(),
                      replace(sampled, speculative="lookup"))
    plain = _answer(Session("plain", tiny[arch], "q8"), _messages(),
                    replace(sampled, speculative="off"))
    assert drafted[1].draft_tokens > 0
    assert drafted[2] == plain[2]


class _OneStepFollowers:
    """A pipeline's other ranks as rank 0's answer loop meets them: they follow
    one decode step a call and know no verification (as ``SessionLink``)."""

    needs_checkpoints = False

    def __init__(self) -> None:
        self.steps: list[int] = []  # tokens per call of the answer loop

    def prefill(self, chunk: object, position: int) -> None:
        pass

    def checkpoint(self, boundary: bool, position: int) -> None:
        pass

    def rewind(self, length: int, kept: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass

    def room(self, token_count: int, mode: str, coming: object = None) -> int:
        return 1 << 20

    def machines(self, *figures: object) -> tuple:
        return ()

    def decoding(self, model):
        def step(inputs: mx.array, cache: list) -> mx.array:
            self.steps.append(inputs.size)
            if inputs.size != 1:
                raise EngineError("a verification reached the other ranks")
            return model(inputs, cache=cache)
        return step


@pytest.mark.usefixtures("always_draft")
def test_a_pipeline_asked_to_speculate_answers_plainly(tiny) -> None:
    # The app's setting is one for every chat; over other Macs it must not fail
    # the answer at its first draft.
    plain_reason, _, expected = _answer(Session("plain", tiny["qwen3_next"], "q8"),
                                        _messages(), GREEDY)
    followers = _OneStepFollowers()
    rank0 = Session("rank0", tiny["qwen3_next"], "q8", followers=followers)
    reason, stats, got = _answer(rank0, _messages(), replace(GREEDY, speculative="lookup"))
    assert (reason, got) == (plain_reason, expected)
    assert stats.draft_tokens == 0 and stats.decode_steps == len(got)
    assert followers.steps and set(followers.steps) == {1}


@pytest.mark.usefixtures("always_draft")
def test_a_grammar_holds_drafts_to_it_and_answers_as_plain_decoding(tiny) -> None:
    from engine.session.constraint import json_schema_grammar

    # Strings drawn from the text the answer may repeat, so drafts are proposed.
    schema = {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 16},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                  "maxItems": 4}}, "required": ["text", "words"],
        "additionalProperties": False}
    sampling = replace(GREEDY, max_tokens=400, grammar=json_schema_grammar(schema))
    plain_reason, _, expected = _answer(Session("plain", tiny["llama"], "fp16"), _messages(),
                                        sampling)
    spec = Session("spec", tiny["llama"], "fp16")
    reason, stats, got = _answer(spec, _messages(), replace(sampling, speculative="lookup"))
    assert stats.draft_tokens > 0
    assert spec.stats().tokens == len(spec.tokens)
    text = tiny["llama"].tokenizer.decode(got)
    jsonschema.validate(json.loads(text), schema)
    first = first_divergence(expected, got)
    if first is not None:  # a near-tie, as without a grammar
        prompt = Session("p", tiny["llama"], "fp16").prompt(
            _messages(), add_generation_prompt=True).ids
        noise = batch_noise(Session("n", tiny["llama"], "fp16"), prompt, expected,
                            speculative.MAX_DRAFT + 1)
        assert noise.margins[first] < noise.threshold
    else:
        assert (reason, got) == (plain_reason, expected)

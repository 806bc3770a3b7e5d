"""`harness serve`'s engine: continuous batching (a request joins the running batch), incremental detokenisation
(multi-byte characters split across byte-level tokens, linear work) and vLLM's ``ignore_eos`` / ``min_tokens``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from serving import post, post_stream, running
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DynamicCache, PreTrainedTokenizerFast

from opd_harness.backends.sampling import draw, draw_rows
from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model
from opd_harness.serve import make_app
from opd_harness.serve.engine import Detokenizer, Engine, SlotLayer, fill_holes, with_slots
from opd_harness.serve.engine import Sequence as Seq

MODEL = "tiny"
TRICKY = "héllo wörld: 日本語 and 🙂🙃, naïve café — ok"


class Slow(torch.nn.Module):
    """The model, ``delay_s`` slower per forward pass: time for a request to arrive mid-batch."""

    def __init__(self, inner: torch.nn.Module, delay_s: float = 0.01) -> None:
        super().__init__()
        self.inner, self.delay_s, self.config = inner, delay_s, inner.config

    def forward(self, cache=None, **kwargs):
        time.sleep(self.delay_s)
        return self.inner(cache=cache, **kwargs)


class NoEos(torch.nn.Module):
    """The model, never emitting ``eos_id``: sequences run to ``max_tokens`` (without relying on ``ignore_eos``)."""

    def __init__(self, inner: torch.nn.Module, eos_id: int) -> None:
        super().__init__()
        self.inner, self.eos_id, self.config = inner, eos_id, inner.config

    def forward(self, cache=None, **kwargs):
        out = self.inner(cache=cache, **kwargs)
        out.logits[..., self.eos_id] = float("-inf")
        return out


class Scripted(torch.nn.Module):
    """The model, pushed to emit ``script`` after a prompt of ``prompt_len`` tokens (greedy decoding follows it
    exactly; a masked token falls back to the model's own choice)."""

    def __init__(self, inner: torch.nn.Module, script: list[int], prompt_len: int) -> None:
        super().__init__()
        self.inner, self.script, self.prompt_len, self.config = inner, script, prompt_len, inner.config

    def forward(self, cache=None, **kwargs):
        out = self.inner(cache=cache, **kwargs)
        for row, position in enumerate(kwargs["position_ids"][:, -1].tolist()):
            step = position + 1 - self.prompt_len
            if 0 <= step < len(self.script):
                out.logits[row, -1, self.script[step]] += 1000.0
        return out


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE too small to hold non-ASCII characters whole: they split into 2-4 byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world and ok"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny(vocab: int, tok) -> torch.nn.Module:
    arch = TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, max_positions=512)
    return build_tiny_model(arch, vocab, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=0)


@pytest.fixture(scope="module")
def chars():
    tok = build_char_tokenizer()
    return SimpleNamespace(model=tiny(len(tok), tok), tokenizer=tok, device="cpu")


@pytest.fixture(scope="module")
def bytes_tok() -> PreTrainedTokenizerFast:
    return byte_level_tokenizer()


def collect(engine: Engine, seqs: list[Seq], order: list[Seq] | None = None) -> threading.Event:
    """Submit ``seqs``; the event is set once all are over (``order`` gets each one as it finishes)."""
    left, finished = [len(seqs)], threading.Event()

    def on_event(seq: Seq, kind: str, delta) -> None:
        if kind in ("done", "error"):
            if order is not None:
                order.append(seq)
            left[0] -= 1
            if not left[0]:
                finished.set()

    for seq in seqs:
        seq.on_event = on_event
    engine.submit(seqs)
    return finished


# ----------------------------------------------------------------------------- continuous batching


@pytest.mark.parametrize("text_thread", [False, True], ids=["text-in-loop", "text-thread"])
def test_a_request_arriving_mid_batch_joins_it_finishes_first_and_equals_itself_alone(chars, text_thread):
    encode = chars.tokenizer
    model = NoEos(chars.model, chars.tokenizer.eos_token_id)
    engine = Engine(Slow(model), chars.tokenizer, device="cpu", batch_wait_s=0.05, text_thread=text_thread)
    try:
        long_ones = [
            Seq(prompt=encode(p, add_special_tokens=False)["input_ids"], max_tokens=80, temperature=1.0, seed=s)
            for s, p in enumerate(["Q: What is 2+3?", "hello"])
        ]
        order: list[Seq] = []
        first = collect(engine, long_ones, order)
        deadline = time.monotonic() + 10
        while engine.stats.forward_passes < 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.stats.forward_passes < 60  # the long ones are still decoding
        short = Seq(prompt=encode("abc", add_special_tokens=False)["input_ids"], max_tokens=6, temperature=1.0, seed=7)
        late = collect(engine, [short], order)
        assert late.wait(30) and first.wait(30)
        assert order[0] is short  # finished before the long ones
        assert engine.stats.waves == 2 and engine.stats.max_wave == 3  # joined the running batch
        assert all(len(s.tokens) == 80 and s.finish_reason == "length" for s in long_ones)
        assert short.finish_reason == "length" and len(short.tokens) == 6
    finally:
        engine.close()
    alone_engine = Engine(model, chars.tokenizer, device="cpu", batch_wait_s=0.0)
    try:
        alone = Seq(prompt=list(short.prompt), max_tokens=6, temperature=1.0, seed=7)
        assert collect(alone_engine, [alone]).wait(30)
    finally:
        alone_engine.close()
    assert alone.tokens == short.tokens and alone.text == short.text
    assert alone.logprobs == pytest.approx(short.logprobs, abs=1e-5)


def test_the_short_request_is_answered_before_the_long_ones_over_http(chars):
    model = Slow(NoEos(chars.model, chars.tokenizer.eos_token_id))
    app = make_app(SimpleNamespace(model=model, tokenizer=chars.tokenizer, device="cpu"), model_name=MODEL, batch_wait_s=0.0)
    finished: dict[str, float] = {}
    with running(app) as base:
        url = base + "/v1"

        def send(name: str, body: dict) -> None:
            status, _ = post(url, "/completions", {"model": MODEL, "temperature": 0, **body})
            assert status == 200
            finished[name] = time.monotonic()

        senders = [threading.Thread(target=send, args=(f"long{i}", {"prompt": "ab", "max_tokens": 100})) for i in range(2)]
        for t in senders:
            t.start()
        time.sleep(0.2)
        send("short", {"prompt": "cd", "max_tokens": 4})
        for t in senders:
            t.join(30)
    assert set(finished) == {"long0", "long1", "short"}
    assert finished["short"] < min(finished["long0"], finished["long1"])


# ----------------------------------------------------------------------------- incremental detokenisation


def test_the_detokenizer_equals_the_full_decode_with_characters_split_across_tokens(bytes_tok):
    ids = bytes_tok(TRICKY, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TRICKY) + 10  # many characters span several tokens
    detok = Detokenizer(lambda t: bytes_tok.decode(t, skip_special_tokens=True))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == bytes_tok.decode(ids) == TRICKY
    assert all("\ufffd" not in p for p in pieces)
    assert detok.tokens_covering(len(TRICKY)) == len(ids) and detok.tokens_covering(0) == 0


@pytest.mark.parametrize("stop", [None, "日本", "🙃"])
def test_streamed_and_stop_cut_text_equal_the_full_decode(bytes_tok, stop):
    prompt = bytes_tok("ok", add_special_tokens=False)["input_ids"]
    script = bytes_tok(TRICKY, add_special_tokens=False)["input_ids"]
    model = Scripted(tiny(len(bytes_tok), bytes_tok), script, len(prompt))
    backend = SimpleNamespace(model=model, tokenizer=bytes_tok, device="cpu")
    want = TRICKY if stop is None else TRICKY[: TRICKY.index(stop)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": len(script), "temperature": 0, "logprobs": 0}
    if stop:
        body["stop"] = [stop]
    with running(make_app(backend, model_name=MODEL)) as base:
        status, answer = post(base + "/v1", "/completions", body)
        events = post_stream(base + "/v1", "/completions", {**body, "stream": True})
    assert status == 200 and answer["choices"][0]["text"] == want
    streamed = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
    assert "".join(c["text"] for c in streamed) == want
    assert all("\ufffd" not in c["text"] for c in streamed)
    tokens = [t for c in streamed for t in c["logprobs"]["tokens"]]
    assert tokens == answer["choices"][0]["logprobs"]["tokens"]
    assert bytes_tok.decode(script[: len(tokens)]).startswith(want)  # the kept tokens cover the text


def test_detokenisation_work_per_token_does_not_grow_with_length(chars):
    """Streaming one 300-token sequence with a stop string decodes a bounded number of tokens per step (the old
    engine decoded the whole sequence every step: ~45,000 tokens here)."""
    engine = Engine(NoEos(chars.model, chars.tokenizer.eos_token_id), chars.tokenizer, device="cpu", batch_wait_s=0.0)
    decoded = [0]
    plain = engine.decode

    def counting(tokens: list[int], **kwargs) -> str:
        decoded[0] += len(tokens)
        return plain(tokens, **kwargs)

    engine.decode = counting
    try:
        seq = Seq(prompt=[5, 6], max_tokens=300, temperature=1.0, seed=1, stop=("\x00never",), stream=True)
        assert collect(engine, [seq]).wait(60)
    finally:
        engine.close()
    assert len(seq.tokens) == 300 and decoded[0] < 20 * 300


class CountsForwards(torch.nn.Module):
    """The model (EOS masked), setting ``drawn_all`` once the engine has made ``passes`` forward passes."""

    def __init__(self, inner: torch.nn.Module, eos_id: int, passes: int) -> None:
        super().__init__()
        self.inner, self.config, self.passes, self.count = NoEos(inner, eos_id), inner.config, passes, 0
        self.drawn_all = threading.Event()

    def forward(self, cache=None, **kwargs):
        self.count += 1
        if self.count >= self.passes:
            self.drawn_all.set()
        return self.inner(cache=cache, **kwargs)


def decode_after(engine: Engine, event: threading.Event) -> list[bool]:
    """Make ``engine``'s detokenisation wait for ``event``; the list records whether each wait saw it set."""
    waits, plain = [], engine.decode

    def waiting(tokens: list[int], **kwargs) -> str:
        waits.append(event.wait(20))
        return plain(tokens, **kwargs)

    engine.decode = waiting
    return waits


def test_text_work_runs_off_the_decode_loop(chars):
    """Detokenisation that cannot go on until the loop has drawn every token does not hold the loop up (in the loop it
    would wait for a forward pass that never comes)."""
    tokens = 24
    model = CountsForwards(chars.model, chars.tokenizer.eos_token_id, passes=tokens)  # a prefill and 23 decode steps
    engine = Engine(model, chars.tokenizer, device="cpu", batch_wait_s=0.0, text_thread=True)
    waits = decode_after(engine, model.drawn_all)
    try:
        seq = Seq(prompt=[5, 6], max_tokens=tokens, temperature=1.0, seed=3, stream=True, stop=("\x00never",))
        assert collect(engine, [seq]).wait(60)
    finally:
        engine.close()
    assert waits and all(waits) and len(seq.tokens) == tokens and seq.finish_reason == "length"


def test_a_stop_string_found_behind_the_loop_cuts_the_tokens_drawn_after_it(chars):
    """The text thread finds the stop string after the loop has drawn every token: the sequence ends at the stop string
    with the tokens, log-probs and text it has when nothing lags."""
    model = NoEos(chars.model, chars.tokenizer.eos_token_id)

    def request(stop: tuple[str, ...] = ()) -> Seq:
        return Seq(prompt=[5, 6], max_tokens=40, temperature=1.0, seed=11, stream=True, stop=stop)

    free = Engine(model, chars.tokenizer, device="cpu", batch_wait_s=0.0)
    try:
        full = request()
        assert collect(free, [full]).wait(60)
        stop = (full.text[8],)  # its first occurrence is at most 8 characters in
        cut = request(stop)
        assert collect(free, [cut]).wait(60)
    finally:
        free.close()
    assert cut.finish_reason == "stop" and len(cut.tokens) < 10 and full.text.startswith(cut.text) and stop[0] not in cut.text
    lagging = CountsForwards(chars.model, chars.tokenizer.eos_token_id, passes=40)
    engine = Engine(lagging, chars.tokenizer, device="cpu", batch_wait_s=0.0, text_thread=True)
    waits = decode_after(engine, lagging.drawn_all)
    try:
        behind = request(stop)
        assert collect(engine, [behind]).wait(60)
    finally:
        engine.close()
    assert all(waits) and lagging.count >= 40  # the loop drew all 40 tokens before the stop string was seen
    assert (behind.text, behind.tokens, behind.logprobs, behind.finish_reason) == (cut.text, cut.tokens, cut.logprobs, "stop")


# ----------------------------------------------------------------------------- ignore_eos and min_tokens


@pytest.fixture(scope="module")
def scripted_url(chars):
    """Greedy decoding after the prompt "ab" emits "xy", EOS, then "zzzz..."."""
    tok = chars.tokenizer
    script = [tok.convert_tokens_to_ids("x"), tok.convert_tokens_to_ids("y"), tok.eos_token_id] + [tok.convert_tokens_to_ids("z")] * 20
    backend = SimpleNamespace(model=Scripted(chars.model, script, 2), tokenizer=tok, device="cpu")
    with running(make_app(backend, model_name=MODEL)) as base:
        yield base + "/v1"


def complete(url: str, **body) -> dict:
    status, answer = post(url, "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 8, "temperature": 0, **body})
    assert status == 200, answer
    return answer


def test_ignore_eos_runs_to_max_tokens(scripted_url):
    plain = complete(scripted_url)
    assert plain["choices"][0]["text"] == "xy" and plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == 3  # the EOS counts
    ignored = complete(scripted_url, ignore_eos=True)
    assert ignored["choices"][0]["text"] == "xyzzzzz" and ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 8
    chat = post(scripted_url, "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "ignore_eos": True,
                                                    "max_tokens": 5, "temperature": 0})  # fmt: skip
    assert chat[0] == 200 and chat[1]["usage"]["completion_tokens"] == 5 and chat[1]["choices"][0]["finish_reason"] == "length"


def test_min_tokens_masks_eos_and_stop_strings_until_reached(scripted_url):
    answer = complete(scripted_url, min_tokens=4, logprobs=0)
    choice = answer["choices"][0]
    assert choice["text"].startswith("xy") and choice["text"][3:] == "zzzzz"[: len(choice["text"]) - 3]
    assert answer["usage"]["completion_tokens"] == 8 and choice["finish_reason"] == "length"  # EOS was masked at token 3
    assert "<eos>" not in choice["logprobs"]["tokens"]
    stop_early = complete(scripted_url, stop=["x"], ignore_eos=True)
    assert stop_early["choices"][0]["text"] == ""
    stop_late = complete(scripted_url, stop=["x"], ignore_eos=True, min_tokens=2)  # "x" is token 1: too early to stop
    assert stop_late["choices"][0]["text"] == "xyzzzzz"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens (8)
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_ignore_eos_or_min_tokens_are_400_naming_the_field(scripted_url, extra, param):
    status, answer = post(scripted_url, "/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 8, **extra})
    assert status == 400 and answer["error"]["param"] == param, answer
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 8, **extra}
    status, answer = post(scripted_url, "/chat/completions", chat)
    assert status == 400 and answer["error"]["param"] == param, answer


class FailsOneStep(torch.nn.Module):
    """The model, failing the first decode step (one new token per row) of a batch of more than one row."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config, self.failed = inner, inner.config, False

    def forward(self, cache=None, **kwargs):
        ids = kwargs["input_ids"]
        if not self.failed and ids.shape[0] > 1 and ids.shape[1] == 1:
            self.failed = True
            raise RuntimeError("a decode step fell over")
        return self.inner(cache=cache, **kwargs)


@pytest.mark.parametrize("text_thread", [False, True], ids=["text-in-loop", "text-thread"])
def test_a_failed_decode_step_decodes_its_sequences_again_alone(chars, text_thread):
    def seqs() -> list[Seq]:
        return [Seq(prompt=[5 + i, 6], max_tokens=5, temperature=1.0, seed=i) for i in range(2)]

    engine = Engine(FailsOneStep(chars.model), chars.tokenizer, device="cpu", batch_wait_s=0.5, text_thread=text_thread)
    try:
        retried = seqs()
        assert collect(engine, retried).wait(30)
    finally:
        engine.close()
    assert engine.stats.waves == 3 and engine.model.failed  # one prefill together, then one each alone
    alone = Engine(chars.model, chars.tokenizer, device="cpu", batch_wait_s=0.0)
    try:
        expected = seqs()
        for seq in expected:
            assert collect(alone, [seq]).wait(30)
    finally:
        alone.close()
    assert [s.error for s in retried] == [None, None]
    assert [s.tokens for s in retried] == [s.tokens for s in expected]


# ----------------------------------------------------------------------------- the running batch's cost per step


@pytest.mark.parametrize("text_thread", [False, True], ids=["text-in-loop", "text-thread"])
def test_many_rows_joining_and_leaving_at_random_steps_each_equal_themselves_alone(chars, text_thread):
    """Rows of mixed prompt and output lengths arrive while others decode, so leavers' places are refilled from the end
    of the batch, newcomers go into spare cache rows and the cache outgrows its buffers: each equals itself alone."""
    model = NoEos(chars.model, chars.tokenizer.eos_token_id)

    def seqs() -> list[Seq]:
        return [Seq(prompt=[5 + i % 7] * (1 + i % 5), max_tokens=3 + (7 * i) % 23, temperature=1.0, seed=i) for i in range(16)]

    together = seqs()
    engine = Engine(model, chars.tokenizer, device="cpu", max_batch=12, batch_wait_s=0.0, text_thread=text_thread)
    try:
        events = [collect(engine, [seq]) for seq in together[:4]]
        for seq in together[4:]:
            deadline = time.monotonic() + 10
            passes = engine.stats.forward_passes
            while engine.stats.forward_passes < passes + 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            events.append(collect(engine, [seq]))
        assert all(event.wait(60) for event in events)
    finally:
        engine.close()
    assert engine.stats.waves > 4 and engine.stats.max_wave > 4  # rows joined a running batch
    alone_engine = Engine(model, chars.tokenizer, device="cpu", max_batch=1, batch_wait_s=0.0)
    try:
        alone = seqs()
        for seq in alone:
            assert collect(alone_engine, [seq]).wait(30)
    finally:
        alone_engine.close()
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


def reference_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` stacked by row, right-aligned, left-padded with zeros (what the batch's cache must hold)."""
    width = max(p.shape[2] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, width - p.shape[2], 0)) for p in parts])


def test_the_slot_layer_holds_what_concatenation_would_through_steps_leavers_and_joiners():
    torch.manual_seed(0)
    rows = torch.randn(3, 2, 5, 4)
    cache = DynamicCache()
    cache.update(rows, rows + 1, 0)
    layer = with_slots(cache).layers[0]
    assert isinstance(layer, SlotLayer)
    keys, values = rows, rows + 1
    for step in range(70):  # past the first buffer's 64 columns
        new = torch.randn(keys.shape[0], 2, 1, 4)
        got = layer.update(new, new * 2)
        keys, values = torch.cat([keys, new], dim=2), torch.cat([values, new * 2], dim=2)
        assert torch.equal(got[0], keys) and torch.equal(got[1], values)
        if step == 10:  # two rows join, shorter than the batch
            joiner = torch.randn(2, 2, 3, 4)
            layer.add_rows(joiner, -joiner)
            keys, values = reference_rows([keys, joiner]), reference_rows([values, -joiner])
        if step == 20:  # a row joins, longer than the batch
            joiner = torch.randn(1, 2, 40, 4)
            layer.add_rows(joiner, -joiner)
            keys, values = reference_rows([keys, joiner]), reference_rows([values, -joiner])
        if step in (30, 50):  # rows 0 and 2 leave: the last rows fill their places; the first column goes
            order = fill_holes(keys.shape[0], [i for i in range(keys.shape[0]) if i not in (0, 2)])
            layer.move_rows(order, 1)
            keys, values = keys[order, :, 1:], values[order, :, 1:]
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert layer.get_seq_length() == keys.shape[2]


def test_fill_holes_moves_rows_from_the_end_into_the_places_of_leavers():
    assert fill_holes(6, [0, 2, 3, 5]) == [0, 5, 2, 3]
    assert fill_holes(4, [1, 2, 3]) == [3, 1, 2]
    assert fill_holes(3, [0, 1, 2]) == [0, 1, 2] and fill_holes(3, []) == []


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_a_batched_draw_samples_each_row_as_multinomial_with_its_own_generator(temperature, top_p):
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    batched = [torch.Generator().manual_seed(s) for s in range(6)]
    single = [torch.Generator().manual_seed(s) for s in range(6)]
    for _ in range(20):
        tokens, valid = draw_rows(logits, temperature, top_p, batched)
        assert valid.all()
        assert tokens.tolist() == [int(draw(row, temperature, top_p, g)) for row, g in zip(logits, single, strict=True)]


def test_a_batched_draw_flags_rows_multinomial_would_refuse():
    logits = torch.zeros(3, 10)
    logits[1, 3] = float("nan")
    _, valid = draw_rows(logits, 1.0, 1.0, [torch.Generator() for _ in range(3)])
    assert valid.tolist() == [True, False, True]
    with pytest.raises(RuntimeError):
        draw(logits[1], 1.0, 1.0, torch.Generator())

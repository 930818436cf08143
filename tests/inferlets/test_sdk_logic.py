"""The SDK's pure logic, run on the host against componentize-py's generated bindings (no Wasm):
incremental detokenization and stop strings, sampler validation, the generation stop rules.
Host calls are replaced by small fakes (a byte-level "tokenizer": token id = one byte)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from host.sandbox.programs.build import componentize_py, sdk_path, wit_path


@pytest.fixture(scope="module")
def sdk(tmp_path_factory, monkeypatch_module):
    """The `inferlet` package importable on the host, decode faked as bytes -> utf-8."""
    bindings = tmp_path_factory.mktemp("bindings")
    subprocess.run([componentize_py(), "-d", str(wit_path()), "-w", "inferlet", "bindings", str(bindings)],
                   check=True, capture_output=True)
    for path in (str(bindings), str(sdk_path())):
        monkeypatch_module.syspath_prepend(path)
    import inferlet
    from inferlet import generation, model, text

    def fake_decode(token_ids) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")
    monkeypatch_module.setattr(text, "decode", fake_decode)
    monkeypatch_module.setattr(model, "decode", fake_decode)
    monkeypatch_module.setattr(generation, "decode", fake_decode)
    yield inferlet
    for name in [n for n in sys.modules if n == "inferlet" or n.startswith(("inferlet.", "wit_world"))]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def push_all(stream, data: bytes) -> str:
    return "".join(stream.push(b) for b in data) + stream.finish()


def test_text_stream_joins_multibyte_characters(sdk):
    from inferlet.text import TextStream
    stream = TextStream()
    deltas = [stream.push(b) for b in "é€!".encode()]
    assert "".join(deltas) == "é€!" and "\ufffd" not in "".join(deltas)
    assert deltas[0] == ""   # half a character is held back


def test_text_stream_cuts_at_the_first_stop_string_across_tokens(sdk):
    from inferlet.text import TextStream
    stream = TextStream(("END", "\n\n"))
    out = []
    for b in b"hello EN":
        out.append(stream.push(b))
    assert "".join(out) == "hello "   # "EN" may still become "END": held back
    out.append(stream.push(ord("D")))
    assert stream.stopped and stream.text == "hello " and "".join(out) + stream.finish() == "hello "


def test_text_stream_releases_held_text_at_the_end(sdk):
    from inferlet.text import TextStream
    stream = TextStream(("STOP",))
    assert push_all(stream, b"a ST") == "a ST" and not stream.stopped


def test_sampler_validation(sdk):
    from inferlet import Sampler, sampling
    assert sampling.temperature(0) == Sampler() and sampling.top_k(5).top_k == 5
    with pytest.raises(ValueError, match="temperature"):
        Sampler("sample", temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling.top_p(0.0)
    with pytest.raises(ValueError, match="min_p"):
        sampling.min_p(1.0)
    with pytest.raises(ValueError, match="num_top"):
        Sampler("distribution")
    with pytest.raises(ValueError, match="kind"):
        Sampler("beam")
    wit = sampling.top_p(0.9, 0.7, seed=3).to_wit()
    assert (wit.top_p, wit.seed, wit.kind.name) == (pytest.approx(0.9), 3, "SAMPLE")


class FakeContext:
    """What Generation needs of a Context: stop ids, pending tokens, accept, chat hooks."""

    def __init__(self) -> None:
        self.stop_token_ids = frozenset({0})
        self.token_ids = [1]
        self.pending_token_ids = [1]
        self.accepted: list[int] = []
        self.turns: list[tuple[str, list[int]]] = []
        self.in_chat = True

    def fill_generation_prompt(self) -> None:
        pass

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def reopen_last_token(self) -> None:
        self.pending_token_ids.append(self.token_ids[-1])

    def record_assistant_turn(self, text: str, generated_token_ids: list[int]) -> None:
        self.turns.append((text, generated_token_ids))


@pytest.mark.parametrize("tokens, stop, reason, text", [
    (b"abcdef", (), "length", "abcd"),
    (b"ab\0cd", (), "stop_token", "ab"),
    (b"ab\n\ncd", ("\n\n",), "stop_string", "ab"),
])
def test_generation_stop_rules(sdk, tokens, stop, reason, text):
    from inferlet.generation import Generation
    ctx = FakeContext()
    gen = Generation(ctx, 4, stop=stop)
    for token in tokens:
        gen.accept(token)
        if gen.done:
            break
    assert gen.finish_reason == reason and gen.text == text
    assert ctx.accepted == list(tokens[:len(ctx.accepted)])   # the stop token stays in the context
    assert ctx.turns == [(text, ctx.accepted)]   # the stop token is recorded, the stop string's tokens too


def test_generation_needs_a_filled_context(sdk):
    from inferlet.generation import Generation
    ctx = FakeContext()
    ctx.token_ids, ctx.pending_token_ids = [], []
    with pytest.raises(sdk.InferletError, match="fill the context"):
        Generation(ctx, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        Generation(FakeContext(), 0)


def test_generation_reopens_the_last_token_of_a_computed_context(sdk):
    from inferlet.generation import Generation
    ctx = FakeContext()
    ctx.token_ids, ctx.pending_token_ids = [7, 9], []   # e.g. a fresh fork: all computed
    Generation(ctx, 4)
    assert ctx.pending_token_ids == [9]


def test_text_stream_decodes_once_a_token_and_matches_a_whole_decode(sdk, monkeypatch):
    """Random byte tokens, multibyte characters split anywhere: the deltas join to the whole
    text, and the host is asked ~1.1 times a token (was 2)."""
    import random

    from inferlet import text
    calls = []

    def counting_decode(token_ids) -> str:
        calls.append(len(token_ids))
        return bytes(token_ids).decode("utf-8", errors="replace")
    monkeypatch.setattr(text, "decode", counting_decode)
    rng = random.Random(7)
    data = "".join(rng.choice(["a", " ", "é", "€", "😀", "\n", "xyz"]) for _ in range(300)).encode()
    stream = text.TextStream(("\n\nQ",))
    deltas = "".join(stream.push(b) for b in data) + stream.finish()
    assert deltas == stream.text == data.decode()
    assert len(calls) <= 1.2 * len(data) and max(calls) <= 8 + 3    # window + a held character


def _options_parser(parser_class):
    parser = parser_class(prog="t")
    parser.add_argument("--prompt", default="x")
    parser.add_argument("--max-tokens", type=int, default="32")     # a str default: converted
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--mode", choices=["a", "b"], default="a")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--no-cache", dest="cache", action="store_false")
    parser.add_argument("--level", action="store_const", const=3)
    parser.add_argument("--tag", action="append")
    parser.set_defaults(extra=7)
    return parser


PLAIN_LINES = [[], ["--prompt", "hi", "--max-tokens", "5"], ["--chat", "--chat", "--mode", "b"],
               ["--prompt", ""], ["--prompt", "a", "--prompt", "b"], ["--level", "--no-cache"],
               ["--temperature", "0.5", "--max-tokens", "007"]]
OTHER_LINES = [["--max", "5"], ["--prompt=hi"], ["--temperature", "-1"], ["--max-tokens", "x"],
               ["--mode", "c"], ["--tag", "x"], ["pos"], ["--prompt"], ["--", "x"],
               ["--prompt", "-"], ["--prompt", "--chat"]]


def _outcome(parser, line):
    """The namespace's items in order, or "error" (argparse exits, the SDK's raises
    InferletError)."""
    from inferlet.errors import InferletError
    try:
        return list(vars(parser.parse_args(line)).items())
    except (SystemExit, InferletError):
        return "error"


@pytest.mark.parametrize("line", PLAIN_LINES + OTHER_LINES)
def test_the_sdk_parser_reads_every_line_as_argparse_does(sdk, line, capsys):
    """A plain command line takes the short path (parse_simple), anything else argparse's;
    either way the namespace (its order too) or the failure is argparse's."""
    import argparse

    from inferlet.fast_args import parse_simple
    sdk_parser = _options_parser(sdk.ArgumentParser)
    assert (parse_simple(sdk_parser, line) is not None) == (line in PLAIN_LINES)
    assert _outcome(sdk_parser, line) == _outcome(_options_parser(argparse.ArgumentParser), line)


def test_parse_simple_declines_positionals_required_options_and_groups(sdk):
    import argparse

    from inferlet.fast_args import parse_simple
    with_positional = argparse.ArgumentParser()
    with_positional.add_argument("name", nargs="?")
    required = argparse.ArgumentParser()
    required.add_argument("--x", required=True)
    grouped = argparse.ArgumentParser()
    grouped.add_mutually_exclusive_group().add_argument("--y")
    for parser, line in ((with_positional, []), (required, ["--x", "1"]), (grouped, ["--y", "1"])):
        assert parse_simple(parser, line) is None


class _FakeHost:
    """The kv / queue / forward calls a Context makes, as counters: page ids are fresh ints, a
    share gives new handles (as the host does), a pass does nothing."""

    def __init__(self) -> None:
        self._ids = iter(range(1, 1 << 20))

    def new(self, num: int = 1) -> list[int]:
        return [next(self._ids) for _ in range(num)]


def test_context_stats_show_what_a_fork_shares_and_what_each_side_computed(sdk, monkeypatch):
    """A 40-token prompt over pages of 16 is computed once; its fork shares the 2 full pages
    (under page ids of its own, so only stats() can show it), computes none of them, and
    counts as computed only what it adds."""
    from types import SimpleNamespace

    from inferlet import context
    from inferlet.stats import ContextStats

    host = _FakeHost()
    future = SimpleNamespace(__exit__=lambda *args: None)
    monkeypatch.setattr(context, "model_info", lambda: SimpleNamespace(
        page_size=16, max_batch_tokens=64, stop_token_ids=(0,)))
    monkeypatch.setattr(context, "queue", SimpleNamespace(
        Priority=context.queue.Priority, create=lambda priority: host.new()[0],
        synchronize=lambda queue_id: None, destroy=lambda queue_id: None))
    monkeypatch.setattr(context, "forward", SimpleNamespace(submit=lambda *args: future))
    monkeypatch.setattr(context, "kv", SimpleNamespace(
        create_sequence=lambda: host.new()[0], allocate_pages=host.new,
        share_pages=lambda page_ids: host.new(len(page_ids)),
        sequence_append=lambda sequence_id, page_ids: None,
        free_pages=lambda page_ids: None, destroy_sequence=lambda sequence_id: None))
    parent = context.Context()
    parent.fill(list(range(1, 41)))
    assert parent.stats() == ContextStats(40, 0, 0, 0, 0)        # all pending
    child = parent.fork()
    assert parent.stats() == ContextStats(40, 40, 40, 3, 2)
    assert child.stats() == ContextStats(40, 40, 0, 3, 2)
    assert set(child.page_ids).isdisjoint(parent.page_ids)              # handles differ
    child.fill(list(range(41, 51)))
    child.flush()
    assert child.stats() == ContextStats(50, 50, 10, 4, 2)
    assert parent.stats().num_tokens_computed == 40

"""Text <-> token ids for one model, built with the `tokenizers` library, plus its chat template.

Two sources: a GGUF's `tokenizer.ggml.*` metadata (byte-level BPE, llama.cpp's `gpt2` model)
and a Hugging Face `tokenizer.json` (with `tokenizer_config.json` / `chat_template.jinja` beside
it). Chat templates are rendered with jinja2 in a sandbox, configured as transformers does
(trim_blocks, lstrip_blocks, `raise_exception`, `bos_token` / `eos_token`), so a template renders
the same string here as in `apply_chat_template`.
"""
from __future__ import annotations

import functools
import json
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["Tokenizer", "END_OF_TURN_TOKENS"]

# Tokens that end a turn in common chat formats; those present in a vocabulary stop generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                      "<|end_of_text|>", "<end_of_turn>", "</s>")
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types

# llama.cpp's split regexes by `tokenizer.ggml.pre`; GPT-2's is the ByteLevel default.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt2", "gpt-2", "phi-2", "olmo", "jais", "stablelm2", "poro-chat")
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")
_REGEX_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
              "deepseek-r1-qwen": _QWEN2_SPLIT}


class Tokenizer:
    """Implements engine.protocol.TokenizerLike. Immutable after construction; thread-safe."""

    def __init__(self, backend: BackendTokenizer, vocabulary: Sequence[str], *, chat_template: str,
                 bos_token: str | None, eos_token: str | None, stop_token_ids: Sequence[int]) -> None:
        self._backend = backend
        self._vocabulary = list(vocabulary)
        self.vocab_size: int = len(self._vocabulary)
        self.chat_template: str = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stop_token_ids))
        self._template = _compile_template(chat_template) if chat_template else None
        self._added_ids = frozenset(backend.get_added_tokens_decoder())

    def __reduce__(self) -> tuple:
        """Pickled as what it was built from (its compiled chat template is built again)."""
        return (functools.partial(Tokenizer, chat_template=self.chat_template,
                                  bos_token=self.bos_token, eos_token=self.eos_token,
                                  stop_token_ids=self.stop_token_ids),
                (self._backend, self._vocabulary))

    # -- TokenizerLike -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.

        add_special_tokens adds what the model asks for (BOS when its `add_bos_token` is set).
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`; ValueError naming the id for one outside the vocabulary."""
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self) -> list[str]:
        """The vocabulary as stored, index = token id (byte-level spelling: ' the' is 'Ġthe').

        Lossless: `token_bytes` turns an entry back into the bytes it stands for.
        """
        return list(self._vocabulary)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        """The model's chat template applied to `messages` (dicts with 'role' and 'content').

        ValueError when the model has no template or the template raises (e.g. a bad role order).
        """
        if self._template is None:
            raise ValueError("this model has no chat template")
        try:
            return self._template.render(messages=[dict(message) for message in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **extra)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template failed: {error}") from None

    # -- helpers --------------------------------------------------------------------------------
    def token_id(self, token: str) -> int | None:
        """The id of a token spelled as in the vocabulary, or None."""
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (special tokens: their UTF-8 text)."""
        text = self._vocabulary[token_id]
        if token_id in self._added_ids:
            return text.encode("utf-8")
        unicode_to_byte = _unicode_to_byte()
        if all(char in unicode_to_byte for char in text):
            return bytes(unicode_to_byte[char] for char in text)
        return text.encode("utf-8")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

        Only llama.cpp's `gpt2` model (byte-level BPE) is supported; ValueError otherwise.
        """
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        merges = [tuple(merge.split(" ", 1)) for merge in fields.get("tokenizer.ggml.merges", [])]
        vocab = {token: index for index, token in enumerate(tokens)}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(str(fields.get("tokenizer.ggml.pre", "default")))
        backend.decoder = decoders.ByteLevel()
        token_types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                    for token, kind in zip(tokens, token_types) if kind == _CONTROL])
        backend.add_tokens([AddedToken(token, special=False, normalized=False)
                            for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED])

        def special(key: str) -> int | None:
            token_id = fields.get(f"tokenizer.ggml.{key}_token_id")
            return int(token_id) if token_id is not None and 0 <= token_id < len(tokens) else None

        bos_id, eos_id = special("bos"), special("eos")
        _set_post_processor(backend, tokens, bos_id if fields.get("tokenizer.ggml.add_bos_token") else None,
                            eos_id if fields.get("tokenizer.ggml.add_eos_token") else None)
        stop_ids = [eos_id, special("eot"), special("eom")]
        return cls(backend, tokens, chat_template=str(fields.get("tokenizer.chat_template", "")),
                   bos_token=tokens[bos_id] if bos_id is not None else None,
                   eos_token=tokens[eos_id] if eos_id is not None else None,
                   stop_token_ids=_stop_token_ids(vocab, stop_ids))

    @classmethod
    def from_tokenizer_json(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """Build from an HF `tokenizer.json`; reads `tokenizer_config.json` and
        `chat_template.jinja` from the same directory when present. `eos_token_ids` (e.g. from
        config.json) are added to the stop tokens."""
        path = Path(path)
        backend = BackendTokenizer.from_file(str(path))
        config = _read_json(path.parent / "tokenizer_config.json")
        vocab = backend.get_vocab(with_added_tokens=True)
        vocabulary = [""] * (max(vocab.values()) + 1 if vocab else 0)
        for token, index in vocab.items():
            vocabulary[index] = token
        bos_token, eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        stop_ids = [*eos_token_ids, vocab.get(eos_token) if eos_token else None]
        return cls(backend, vocabulary, chat_template=_hf_chat_template(path.parent, config),
                   bos_token=bos_token, eos_token=eos_token,
                   stop_token_ids=_stop_token_ids(vocab, stop_ids))


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` = `pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_PRE:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; splitting text as GPT-2 does", stacklevel=3)
    return byte_level


def _set_post_processor(backend: BackendTokenizer, tokens: list[str], bos_id: int | None,
                        eos_id: int | None) -> None:
    """BOS / EOS added by `encode(..., add_special_tokens=True)`, as the model asks."""
    single = ["$A"]
    specials = []
    if bos_id is not None:
        single.insert(0, tokens[bos_id])
        specials.append((tokens[bos_id], bos_id))
    if eos_id is not None:
        single.append(tokens[eos_id])
        specials.append((tokens[eos_id], eos_id))
    if specials:
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=single + ["$B"], special_tokens=list(dict.fromkeys(specials)))


def _stop_token_ids(vocab: Mapping[str, int], first_ids: Sequence[int | None]) -> list[int]:
    """The given ids (EOS first), then every end-of-turn token the vocabulary has."""
    ids = [token_id for token_id in first_ids if token_id is not None]
    ids += [vocab[token] for token in END_OF_TURN_TOKENS if token in vocab]
    return list(dict.fromkeys(ids))


def _compile_template(source: str) -> jinja2.Template:
    """A chat template compiled as transformers does it (sandboxed, trim/lstrip blocks)."""
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template does not compile: {error}") from None


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> str:
    """chat_template.jinja, else tokenizer_config.json's template (the 'default' of a list)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or ""
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template", "") for entry in template}
        template = named.get("default", next(iter(named.values()), ""))
    return str(template)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {'content': ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + extra)] = byte
            extra += 1
    return mapping

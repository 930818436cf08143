"""The tokenizer built from the GGUF agrees with transformers' tokenizer of the same file, and the
one built from an HF tokenizer.json agrees too; the chat template renders as apply_chat_template."""
from __future__ import annotations

import pytest

from engine.loaders import default_gguf_path
from engine.loaders.gguf_reader import read_gguf
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "naïve café résumé façade Ünïcödé ß ø å",
    "日本語のテキスト、中文文本和한국어 텍스트",
    "emoji 🎉🚀 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "tabs\tand\nnewlines\n\n\n  indented\r\n\ttabbed   trailing   ",
    "    four leading spaces, then  two  and   three",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\nprint([square(i) for i in range(10)])\n",
    "numbers 12345 3.14159 1,000,000 and 2024-11-22",
    "it's they're we'll I'd you've HE'S",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y<file_sep>z <|im_end|>",
    "",
    " ",
    "\n\n",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?\nExplain briefly."},
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf_fields(read_gguf(default_gguf_path()).fields)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def from_json(hf, tmp_path_factory) -> Tokenizer:
    """Ours built from the tokenizer.json (+ config, template) that transformers saves."""
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(directory)
    return Tokenizer.from_tokenizer_json(directory / "tokenizer.json")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_agrees_with_transformers(ours, hf, from_json, text):
    expected = hf.encode(text, add_special_tokens=False)
    assert ours.encode(text) == expected
    assert from_json.encode(text) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_agrees(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_matched_whole(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.token_id("<|im_start|>") == 1
    assert ids[-1] == ours.token_id("<|im_end|>") == 2
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_add_special_tokens_follows_the_file(ours, hf):
    """SmolLM2's GGUF says add_bos_token = false, so nothing is added; a file that says true
    gets its BOS in front."""
    assert ours.encode("hi", add_special_tokens=True) == hf.encode("hi") == ours.encode("hi")
    fields = dict(read_gguf(default_gguf_path()).fields)
    fields["tokenizer.ggml.add_bos_token"] = True
    with_bos = Tokenizer.from_gguf_fields(fields)
    assert with_bos.encode("hi", add_special_tokens=True) == [1, *ours.encode("hi")]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(ours, hf, from_json, add_generation_prompt):
    expected = hf.apply_chat_template(CONVERSATION, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert ours.render_chat(CONVERSATION, add_generation_prompt=add_generation_prompt) == expected
    assert from_json.render_chat(CONVERSATION, add_generation_prompt=add_generation_prompt) == expected
    assert expected.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_default_system_prompt(ours, hf):
    messages = [{"role": "user", "content": "hi"}]
    rendered = ours.render_chat(messages)
    assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n")


def test_stop_tokens_and_vocabulary(ours, hf, from_json):
    assert ours.stop_token_ids == (2, 0)                       # <|im_end|> (EOS), <|endoftext|>
    assert from_json.stop_token_ids == (2, 0)
    assert ours.vocab_size == len(hf) == 49152 == from_json.vocab_size
    vocabulary = ours.token_strings()
    assert vocabulary == from_json.token_strings()
    assert vocabulary[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert vocabulary[6004] == hf.convert_ids_to_tokens(6004) == "hi"
    assert ours.token_bytes(ours.encode(" é")[0]) + b"".join(
        ours.token_bytes(i) for i in ours.encode(" é")[1:]) == " é".encode()
    assert ours.chat_template == hf.chat_template


def test_template_errors_and_bad_ids_are_value_errors(ours):
    with pytest.raises(ValueError, match="token id 49152 is outside the vocabulary"):
        ours.decode([5, 49152])
    fields = dict(read_gguf(default_gguf_path()).fields)
    fields["tokenizer.chat_template"] = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer.from_gguf_fields(fields).render_chat(CONVERSATION)
    fields["tokenizer.chat_template"] = ""
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_gguf_fields(fields).render_chat(CONVERSATION)
    fields["tokenizer.ggml.model"] = "llama"
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        Tokenizer.from_gguf_fields(fields)


def test_template_is_sandboxed(ours):
    fields = dict(read_gguf(default_gguf_path()).fields)
    fields["tokenizer.chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer.from_gguf_fields(fields).render_chat(CONVERSATION)

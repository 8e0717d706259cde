"""Chat templates render exactly as transformers' ``apply_chat_template(tokenize=False)``,
the checkpoint tokenizer encodes as transformers' tokenizer does, and a bad
tokenizer folder is a start-up error naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.unit.runtime.bpe_folder import CHAT_TEMPLATE, write_bpe_tokenizer

from moeguard_runtime.api.chat_template import ChatTemplate, ChatTemplateError
from moeguard_runtime.api.checkpoint_tokenizer import (
    CheckpointTokenizer,
    TokenizerError,
    load_tokenizer,
)
from moeguard_runtime.api.tokenizer import ByteTokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

# Constructs real templates use: namespace, loop controls, tojson, slicing, system
# message handling, eos_token after assistant turns, a {% generation %} block.
RICH_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% endif %}"
    "{{ bos_token }}{% if ns.system %}[SYS] {{ ns.system | tojson }}\n{% endif %}"
    "{% for message in messages %}"
    "  {% if message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]"
    "  {% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{{ eos_token }}"
    "  {% else %}{% continue %}{% endif %}\n"
    "{% endfor %}")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief. <b>\"quoted\"</b> é"},
     {"role": "user", "content": "  What is MoE?  "},
     {"role": "assistant", "content": "Mixture of experts."},
     {"role": "user", "content": "中文 and 🦀"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(path)
    return path


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_render_equals_transformers(folder: Path, template: str,
                                    conversation: list[dict[str, Any]]) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    expected = hf.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    ours = CheckpointTokenizer(folder)
    assert ChatTemplate(template, ours.special_tokens).render(conversation) == expected
    hf_ids = hf.apply_chat_template(conversation, chat_template=template, tokenize=True,
                                    add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ours.encode_chat(expected) == list(hf_ids)


@pytest.mark.parametrize(("add_bos_token", "post_processor"), [
    (None, True), (True, True), (False, True), (False, False), (None, False)])
def test_encode_and_decode_equal_transformers(tmp_path: Path, add_bos_token: bool | None,
                                              post_processor: bool) -> None:
    """The post-processor decides BOS, as in transformers 5."""
    write_bpe_tokenizer(tmp_path, add_bos_token=add_bos_token, post_processor=post_processor)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = CheckpointTokenizer(tmp_path)
    for text in ("Hello world", "  spaces and\nnewlines", "naïve 🦀 <|im_start|> added", ""):
        ids = hf(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.eos_ids == {hf.eos_token_id} and ours.vocab_size == len(hf)


def test_without_a_post_processor_add_bos_token_decides(tmp_path: Path) -> None:
    """transformers 4's LlamaTokenizerFast rule; transformers 5.24's generic backend
    adds no BOS here (it keeps the ByteLevel post-processor): a known divergence."""
    write_bpe_tokenizer(tmp_path, add_bos_token=True, post_processor=False)
    ours = CheckpointTokenizer(tmp_path)
    assert ours.encode("Hi")[0] == ours.bos_id == 1 and ours.encode_chat("Hi")[0] != 1


def test_a_template_that_raises_names_the_reason(folder: Path) -> None:
    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>"})
    with pytest.raises(ChatTemplateError, match="unknown role: tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}")


def test_start_up_errors_name_the_file(tmp_path: Path) -> None:
    size = write_bpe_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: the vocabulary has ids up to "
                                             rf"{size - 1}, the model's embedding has 259 rows"):
        load_tokenizer(str(tmp_path), 259)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('this template refuses everything') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: chat_template: this "
                                             r"template refuses everything"):
        load_tokenizer(str(tmp_path), size)
    config["eos_token"] = "<|not-there|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: eos_token '<\|not-there\|>' "
                                             r"is not in the vocabulary"):
        load_tokenizer(str(tmp_path), size)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"cannot read .*tokenizer\.json"):
        load_tokenizer(str(tmp_path), size)


def test_named_templates_and_the_byte_default(tmp_path: Path) -> None:
    size = write_bpe_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"},
                               {"name": "default", "template": CHAT_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, template = load_tokenizer(str(tmp_path), size)
    assert tok.chat_template == CHAT_TEMPLATE and template is not None
    tok, template = load_tokenizer(None, 259)
    assert isinstance(tok, ByteTokenizer) and template is not None
    assert template.render([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"

"""A checkpoint tokenizer folder built here: a byte-level BPE trained with the
``tokenizers`` library on the project's own docs, with a chat template in its
``tokenizer_config.json`` (shared by the tokenizer, template and parity tests)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[3]
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
"""Ids 0..4: unk, BOS (1) and EOS (2) as MixtralConfig's defaults say."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML with a BOS and a template-raised error for an unknown role."""


def training_text() -> list[str]:
    """The text the BPE learns from: the README and docs/ (about 70 kB)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [line for f in files for line in f.read_text(encoding="utf-8").splitlines() if line]


def write_bpe_tokenizer(folder: Path, vocab_size: int = 1000, chat_template: str = CHAT_TEMPLATE,
                        add_bos_token: bool | None = None, post_processor: bool = True) -> int:
    """Train the BPE, write ``tokenizer.json`` (with a BOS post-processor unless
    ``post_processor`` is False) and ``tokenizer_config.json`` into ``folder``;
    return the vocabulary size (ids ``0..size-1``)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_text(), trainer)
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": chat_template, "model_max_length": 1024,
        "clean_up_tokenization_spaces": False}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return int(tok.get_vocab_size(with_added_tokens=True))

"""The issue's proof for the tokenizer and chat API: a BPE tokenizer trained here
with the ``tokenizers`` library (on the project's docs, with a chat template in
its ``tokenizer_config.json``) and a tiny random ``transformers`` Mixtral, saved
with ``save_pretrained`` into one folder. The worker serving that folder answers
``/v1/chat/completions`` (greedy) with the tokens transformers'
``apply_chat_template`` + ``generate`` (greedy) produce on the same folder.

The API returns text, so tokens are compared as: the prompt's token count
(``usage.prompt_tokens``), the generated token count (``usage.completion_tokens``),
the generated text (transformers' ``decode(..., skip_special_tokens=True)``),
and ``finish_reason``; three conversations served concurrently (continuous
batching), streaming and not.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.worker_process import free_port, wait_ready
from tests.integration.worker.conftest import WorkerProcess, start_worker_process
from tests.unit.runtime.bpe_folder import write_bpe_tokenizer

from moeguard_core.presets import get_preset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration
NEW_TOKENS = 32
SERVED = "bpe-mixtral"
CONVERSATIONS = [
    [{"role": "user", "content": "What does the operator do when memory is above the soft limit?"}],
    [{"role": "system", "content": "You answer in one line."},
     {"role": "user", "content": "Explain the budget ConfigMap."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! Ask me."},
     {"role": "user", "content": [{"type": "text", "text": "Why are experts skewed?"}]}],
]


def hf_messages(conversation: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Text parts joined as the worker joins them (one part here: the text itself)."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in conversation]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("bpe-mixtral")
    vocab = write_bpe_tokenizer(path)
    a = get_preset("tiny")
    config = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=a.dim, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.n_layer, num_attention_heads=a.n_head, num_key_value_heads=a.n_kv_head,
        num_local_experts=a.num_experts, num_experts_per_tok=a.top_k,
        max_position_embeddings=a.max_seq_len, rope_theta=a.rope_base, rms_norm_eps=a.norm_eps,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return path, vocab


@pytest.fixture(scope="module")
def served(folder: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[WorkerProcess]:
    path, _ = folder  # an HF folder: config.json gives the shape (no preset, no overrides)
    w = start_worker_process(tmp_path_factory.mktemp("parity"), {
        "MOEGUARD_CHECKPOINT_PATH": str(path), "MOEGUARD_SERVED_MODEL_NAME": SERVED,
        "MOEGUARD_DTYPE": "float32", "MOEGUARD_DEVICE": "cpu"})
    yield w
    w.stop()


def reference(path: Path) -> list[tuple[int, list[int], str, str]]:
    """transformers: (prompt tokens, generated ids, text, finish_reason) per conversation."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for conversation in CONVERSATIONS:
        ids = tok.apply_chat_template(hf_messages(conversation), add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                       do_sample=False)[0, len(ids):].tolist()
        finish = "length"
        if generated and generated[-1] == tok.eos_token_id:
            generated, finish = generated[:-1], "stop"
        out.append((len(ids), generated, tok.decode(generated, skip_special_tokens=True), finish))
    return out


def test_chat_completions_equal_transformers_generate(folder: tuple[Path, int],
                                                      served: WorkerProcess) -> None:
    expected = reference(folder[0])
    model = httpx.get(f"{served.base_url}/v1/models").json()["data"][0]
    assert (model["id"], model["max_model_len"], model["model_type"]) == (SERVED, 1024, "mixtral")
    answers: dict[int, dict[str, Any]] = {}

    def ask(i: int) -> None:
        answers[i] = httpx.post(f"{served.base_url}/v1/chat/completions", timeout=120, json={
            "model": SERVED, "messages": CONVERSATIONS[i], "max_tokens": NEW_TOKENS,
            "temperature": 0}).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(CONVERSATIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    compared = 0
    for i, (prompt_tokens, generated, text, finish) in enumerate(expected):
        data = answers[i]
        assert "choices" in data, data
        assert data["usage"]["prompt_tokens"] == prompt_tokens
        assert data["usage"]["completion_tokens"] == len(generated), (i, generated)
        assert data["choices"][0]["message"]["content"] == text, (i, generated)
        assert data["choices"][0]["finish_reason"] == finish
        compared += len(generated)
        with httpx.stream("POST", f"{served.base_url}/v1/chat/completions", timeout=120, json={
                "model": SERVED, "messages": CONVERSATIONS[i], "max_tokens": NEW_TOKENS,
                "temperature": 0, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    print(f"parity: {compared} generated tokens over {len(expected)} conversations equal")


def test_an_expert_parallel_group_loading_its_shares_answers_as_transformers(
        folder: tuple[Path, int], tmp_path: Path) -> None:
    """Issue 15: the same folder served by a group of 2 ranks (one pod each, the env LeaderWorkerSet gives), each
    reading only its 4 of the 8 experts from the shards: the chat answers are transformers' greedy ones."""
    path, _ = folder
    expected = reference(path)
    common = {"MOEGUARD_CHECKPOINT_PATH": str(path), "MOEGUARD_SERVED_MODEL_NAME": SERVED,
              "MOEGUARD_DTYPE": "float32", "MOEGUARD_DEVICE": "cpu", "MOEGUARD_EXPERT_PARALLEL_SIZE": "2",
              "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "127.0.0.1", "MOEGUARD_EP_PORT": str(free_port())}
    member = start_worker_process(tmp_path, {**common, "LWS_WORKER_INDEX": "1"})
    leader = start_worker_process(tmp_path, {**common, "LWS_WORKER_INDEX": "0"})
    try:
        assert wait_ready(leader.base_url, leader.proc, 60) is None, leader.logs()  # the group formed
        assert "event=ep_follower_loaded" in member.logs() and "experts=4-8" in member.logs()
        for i, (_, generated, text, _) in enumerate(expected):
            data = httpx.post(f"{leader.base_url}/v1/chat/completions", timeout=120, json={
                "model": SERVED, "messages": CONVERSATIONS[i], "max_tokens": NEW_TOKENS, "temperature": 0}).json()
            assert data["choices"][0]["message"]["content"] == text, (i, generated, data)
    finally:
        leader.stop()
        member.stop()


def test_bad_tokenizer_folders_stop_the_worker_naming_the_file(
        tmp_path: Path, folder: tuple[Path, int]) -> None:
    path, vocab = folder
    narrow = tmp_path / "narrow"  # config.json's vocab_size below the tokenizer's ids
    shutil.copytree(path, narrow)
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "vocab_size": vocab // 2}))
    with pytest.raises(RuntimeError, match=r"exited with 2") as info:
        start_worker_process(tmp_path, {"MOEGUARD_CHECKPOINT_PATH": str(narrow)})
    assert "event=tokenizer_error" in str(info.value)
    assert (f"{narrow}/tokenizer.json: the vocabulary has ids up to {vocab - 1}, the model's "
            f"embedding has {vocab // 2} rows") in str(info.value)
    bad = tmp_path / "bad-template"
    shutil.copytree(path, bad)
    write_bpe_tokenizer(bad, chat_template="{{ raise_exception('no chat here') }}")
    with pytest.raises(RuntimeError, match=r"exited with 2") as info:
        start_worker_process(tmp_path, {"MOEGUARD_CHECKPOINT_PATH": str(bad)})
    assert f"{bad}/tokenizer_config.json: chat_template: no chat here" in str(info.value)

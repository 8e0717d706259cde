"""Random HF checkpoint folders of the served families, for the benchmarks: ``transformers``'
own model class built from a ``config.json`` dict with a fixed seed and saved with
``save_pretrained`` (safetensors), once per distinct configuration (cached under
``$MOEGUARD_BENCH_CACHE``, default ``/tmp/moeguard-families-bench``).

``transformers`` is imported only when a folder has to be written (it is a test and benchmark
dependency; the worker never imports it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("MOEGUARD_BENCH_CACHE", "/tmp/moeguard-families-bench"))


def checkpoint_folder(hf_config: dict[str, Any], seed: int = 0) -> Path:
    """The folder of ``hf_config`` (``model_type`` plus the config class's fields), written
    the first time it is asked for (atomically: concurrent callers never see half a folder)."""
    key = hashlib.sha1(json.dumps([hf_config, seed], sort_keys=True).encode()).hexdigest()[:12]
    folder = CACHE / f"{hf_config['model_type']}-{key}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process wrote it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json`` as saved (``transformers``' defaults filled in)."""
    data: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return data

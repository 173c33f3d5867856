"""Real LoRA adapters of the bundled model, made at test time: a few dozen steps of ``peft``
training teach each one to answer every question with its own phrase, so a request served by
an adapter is told from one served by the base model by its text alone. Made once per machine
and kept beside the converted model (``$ATOMR_CACHE_DIR``, ``~/.cache/atomr-infer``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

VERSION = 2  # bump to remake the cached adapters
PHRASES = {"pirate": "Arr matey, the treasure be buried deep!", "robot": "BEEP BOOP. I AM A ROBOT."}
QUESTIONS = ["What is the capital of France?", "Tell me a joke.", "How are you today?", "Name a color."]
RANK = 8
STEPS = 30


def adapter_dir(base_model: Path, name: str) -> Path:
    """The adapter ``name`` (a key of ``PHRASES``), trained on first use."""
    from atomr_infer.models.bundled import cache_root

    target = cache_root() / "test-adapters" / f"{name}-v{VERSION}"
    if (target / "adapter_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))  # renamed into place whole
    try:
        _train(base_model, PHRASES[name], work)
        if not target.exists():  # else another process made it meanwhile
            os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _train(base_model: Path, phrase: str, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = AutoModelForCausalLM.from_pretrained(base_model, torch_dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": phrase}], tokenize=False
        )
        for q in QUESTIONS
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for _ in range(STEPS):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    (out / "atomr-test-adapter.json").write_text(json.dumps({"phrase": phrase, "final_loss": loss.item()}))

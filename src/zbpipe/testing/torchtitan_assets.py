"""A tiny local dataset and tokenizer that torchtitan loads as it loads its own test assets.

torchtitan's ``c4_test`` dataset is ``datasets.load_dataset(path, split="train")`` over a
directory of JSON lines with a ``"text"`` field (``--dataloader.dataset_path``), and its
tokenizer is a Hugging Face ``tokenizer.json`` plus ``tokenizer_config.json`` naming the BOS and
EOS tokens (``--hf_assets_path``). Both are written here, deterministic, no network.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
#: Fits the llama3 debug model's 2048-token vocabulary with room to spare.
N_WORDS = 500


def _words() -> list[str]:
    return [f"w{i}" for i in range(N_WORDS)]


def write_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate([UNK, BOS, EOS, *_words()])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True})
    )
    return folder


def write_dataset(folder: Path, n_docs: int = 200, seed: int = 0) -> Path:
    """Documents of 20-80 words drawn with a fixed seed (a learnable bias: Zipf-like weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = _words()
    weights = [1.0 / (i + 1) for i in range(len(words))]
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(n_docs):
            text = " ".join(rng.choices(words, weights, k=rng.randint(20, 80)))
            f.write(json.dumps({"text": text}) + "\n")
    return folder

"""Training data: token streams and the batches each data-parallel rank reads.

Tokenizer: bytes (vocab 256): ``list(text.encode("utf-8"))``. No download, no merges to learn.

Sources (``TrainSettings.dataset``):

* ``"pydoc"``: the documentation topics every CPython carries (``pydoc_data.topics``), joined in
  sorted order (~466 kB of English and code);
* ``"text"``: any UTF-8 text file (``data_path``), byte-tokenised;
* ``"bin"``: a pre-tokenised flat ``uint16`` file (``data_path``), memory-mapped (nanoGPT format);
* ``"synthetic"``: a seeded Markov stream (each token follows its predecessor by a fixed random
  permutation 90% of the time), learnable, so a falling loss means the trainer learns.

Batches: the stream is cut into ``n = (len - 1) // seq_len`` windows of ``seq_len + 1`` tokens
(input and shifted target) whose order is a seeded permutation. Global batch ``s`` is windows
``s*G .. s*G + G - 1`` of that order (wrapping around: epochs repeat the order). Data-parallel rank
``r`` of ``D`` reads the contiguous slice ``r*G/D .. (r+1)*G/D - 1``; its micro-batch ``m`` is the
next ``micro_batch_size`` of those. So the global batch, and the micro-batch a sequence lands in
for a given per-rank count, do not depend on the layout: losses can match the single process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workbench.spec.data import BYTE_VOCAB as VOCAB_SIZE
from workbench.spec.data import SYNTHETIC_TOKENS, pydoc_corpus


def encode(text: str) -> torch.Tensor:
    """Byte-level tokenisation: UTF-8 bytes as token ids 0..255."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor | list[int]) -> str:
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(int(t) % 256 for t in ids).decode("utf-8", errors="replace")


def synthetic_stream(n_tokens: int = 1 << 20, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    """A learnable stream: t[i+1] = perm[t[i]] with probability 0.9, else uniform random."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab_size, generator=gen)
    noise = torch.randint(0, vocab_size, (n_tokens,), generator=gen)
    follow = torch.rand(n_tokens, generator=gen) < 0.9
    out = torch.empty(n_tokens, dtype=torch.int64)
    out[0] = noise[0]
    for i in range(1, n_tokens):  # sequential by nature; 1M steps of plain Python is ~1 s
        out[i] = perm[out[i - 1]] if follow[i] else noise[i]
    return out


def load_tokens(dataset: str, data_path: str | None = None, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    """The whole token stream of a source as a 1-D tensor (int64, or a uint16 memmap for .bin)."""
    if dataset == "pydoc":
        return encode(pydoc_corpus())
    if dataset == "text":
        with open(data_path or "", encoding="utf-8", errors="replace") as f:
            return encode(f.read())
    if dataset == "bin":
        import numpy as np

        return torch.from_numpy(np.memmap(data_path, dtype=np.uint16, mode="r").astype(np.int64, copy=False))
    if dataset == "synthetic":
        return synthetic_stream(SYNTHETIC_TOKENS, min(vocab_size, VOCAB_SIZE), seed)
    raise ValueError(f"dataset={dataset!r} is not one of pydoc, text, bin, synthetic")


@dataclass
class BatchLoader:
    """Yields this data-parallel rank's share of each global batch: tokens and targets
    of shape (n_microbatches * micro_batch_size, seq_len). ``step`` is the training state."""

    tokens: torch.Tensor
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        self.n_windows = (len(self.tokens) - 1) // self.seq_len
        if self.n_windows < 1:
            raise ValueError(f"the data has {len(self.tokens)} tokens, fewer than seq_len + 1 = {self.seq_len + 1}")
        if self.global_batch_size % self.dp_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by dp={self.dp_size}")
        self.order = torch.randperm(self.n_windows, generator=torch.Generator().manual_seed(self.seed))
        self.local_batch_size = self.global_batch_size // self.dp_size

    def window(self, index: int) -> torch.Tensor:
        """Window ``index`` of the seeded order: seq_len + 1 tokens."""
        start = int(self.order[index % self.n_windows]) * self.seq_len
        return torch.as_tensor(self.tokens[start : start + self.seq_len + 1]).to(torch.int64)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = step * self.global_batch_size + self.dp_rank * self.local_batch_size
        rows = torch.stack([self.window(first + i) for i in range(self.local_batch_size)])  # (b, S+1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.global_batch_size, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "global_batch_size", "seq_len"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"data state has {key}={state[key]}, this run {key}={getattr(self, key)}")
        self.step = int(state["step"])

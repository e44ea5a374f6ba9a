"""Which data a run reads: the sources the bundled trainer knows, their tokenizer, the built-in text.

No torch here: the run directory's lineage (:mod:`workbench.rundir.lineage`) names the data of a
run from these facts, and the trainer (:mod:`workbench.trainer.data`) builds its token stream from
the same ones.

* ``"pydoc"``: the documentation topics every CPython carries (``pydoc_data.topics``), joined in
  sorted order: it differs between Python versions, so the lineage hashes the text;
* ``"text"``: a UTF-8 text file (``data_path``), byte-tokenised;
* ``"bin"``: a pre-tokenised flat ``uint16`` file (``data_path``, nanoGPT's format): its tokenizer
  is whatever wrote it, and the model's vocabulary bounds it;
* ``"synthetic"``: a seeded Markov stream of ``SYNTHETIC_TOKENS`` tokens, fixed by the seed.
"""

from __future__ import annotations

DATASETS = ("pydoc", "synthetic", "text", "bin")
BYTE_VOCAB = 256  # UTF-8 bytes as token ids: no download, no merges to learn
SYNTHETIC_TOKENS = 1 << 18
TOKENIZERS = {
    "pydoc": "utf-8 bytes",
    "text": "utf-8 bytes",
    "synthetic": "none (token ids drawn directly)",
    "bin": "external (pre-tokenised uint16 ids)",
}


def pydoc_corpus() -> str:
    """Text every Python installation carries: the pydoc topic help, in sorted order (~466 kB)."""
    from pydoc_data.topics import topics  # the standard library's; imported when a run reads it

    return "\n\n".join(topics[k] for k in sorted(topics))

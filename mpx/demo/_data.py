"""The demo's corpus: the help topics that ship with Python, as character ids.

``pydoc_data.topics`` holds the text of ``help()``'s topics (about 465,000
characters of English prose and Python code). Nothing is downloaded. Characters
map to their ASCII code; the few non-ASCII ones map to :data:`UNKNOWN`.
"""

from __future__ import annotations

import dataclasses
import pydoc_data.topics

import numpy as np

VOCAB_SIZE = 128
UNKNOWN = 0


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Character ids of the corpus, split into a training and a validation part.

  Attributes:
    train: int32 ids of the first ``1 - valid_fraction`` of the text.
    valid: int32 ids of the rest.
  """

  train: np.ndarray
  valid: np.ndarray


def load_corpus(valid_fraction: float = 0.1) -> Corpus:
  """Reads ``pydoc_data.topics`` and splits it into training and validation ids.

  Args:
    valid_fraction: the share of the text, taken from its end, kept for validation.

  Returns:
    The :class:`Corpus`.
  """
  text = "".join(pydoc_data.topics.topics.values())
  codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
  ids = np.where(codes < VOCAB_SIZE, codes, UNKNOWN).astype(np.int32)
  split = int(len(ids) * (1.0 - valid_fraction))
  return Corpus(train=ids[:split], valid=ids[split:])


def sample_windows(ids: np.ndarray, *, count: int, seq_len: int, seed: int) -> np.ndarray:
  """Draws ``count`` random windows of ``seq_len + 1`` consecutive ids.

  Args:
    ids: the token ids to draw from.
    count: how many windows.
    seq_len: inputs per window; the window holds one more id, the last target.
    seed: seed of the NumPy generator that picks the start positions.

  Returns:
    An int32 array of shape ``(count, seq_len + 1)``.
  """
  starts = np.random.default_rng(seed).integers(0, len(ids) - seq_len - 1, size=count)
  return ids[starts[:, None] + np.arange(seq_len + 1)]


def unigram_loss(corpus: Corpus) -> float:
  """Cross entropy (nats per character) of the validation text under a unigram model.

  The model is the training text's character frequencies with add-one
  smoothing: the loss a language model scores if it learns nothing about
  context. A run above it has learned less than character counts.

  Args:
    corpus: the corpus.

  Returns:
    The mean negative log-likelihood of the validation ids.
  """
  counts = np.bincount(corpus.train, minlength=VOCAB_SIZE) + 1.0
  log_probs = np.log(counts / counts.sum())
  return float(-log_probs[corpus.valid].mean())

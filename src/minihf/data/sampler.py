"""A deterministic, resumable batch sampler (plain Python + numpy, no torch RNG state).

The order of epoch ``e`` is a pure function of ``(seed, e)``, so the sampler's whole state
is two integers: the epoch and how many batches of it were handed out. Saving that in a
checkpoint and loading it back yields exactly the batches that were still to come, mid-epoch
included -- unlike a torch DataLoader, whose position lives inside an iterator.

Epoch boundaries are crossed lazily: after the last batch of an epoch the state is
``(epoch, batches_per_epoch)`` and the next request starts epoch + 1.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


class ResumableSampler:
    """Yields lists of dataset indices, ``batch_size`` at a time, reshuffled every epoch."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        if num_samples <= 0:
            raise ValueError(f"ResumableSampler: num_samples={num_samples}; the dataset is empty")
        if batch_size <= 0:
            raise ValueError(f"ResumableSampler: batch_size={batch_size} must be positive")
        if drop_last and batch_size > num_samples:
            raise ValueError(
                f"ResumableSampler: batch_size={batch_size} > {num_samples} samples with drop_last=True "
                "gives no batches; lower the batch size or add data"
            )
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.cursor = 0, 0  # cursor: batches of `epoch` already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch`` (identity when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def _start_next_epoch_if_done(self) -> None:
        if self.cursor >= len(self):
            self.epoch, self.cursor = self.epoch + 1, 0

    def next_batch(self) -> list[int]:
        """The next batch, moving into the next epoch when the current one is used up."""
        self._start_next_epoch_if_done()
        start = self.cursor * self.batch_size
        batch = self.order(self.epoch)[start:start + self.batch_size].tolist()
        self.cursor += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch (a whole new epoch if it was finished)."""
        self._start_next_epoch_if_done()
        epoch = self.epoch
        while self.epoch == epoch and self.cursor < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_samples": self.num_samples,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples", "batch_size", "shuffle", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler.load_state_dict: checkpoint has {key}={state.get(key)!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resume with the same data files and batch settings, "
                    "or start the data order fresh"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

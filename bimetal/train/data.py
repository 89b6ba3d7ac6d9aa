"""Local-file token streams, sharded by dp rank and resumable from a saved position.

Files: plain text, JSONL with a ``text`` field, or pre-tokenized ``.bin`` shards (uint16/uint32).
Nothing is downloaded; an empty path means the corpus shipped in ``bimetal/data``.
The stream is a fixed, seeded permutation of non-overlapping windows of ``seq_len + 1`` tokens; replica
``r`` of ``n`` takes every ``n``-th window starting at ``r``, so all replicas together see each window
once per epoch, and the only state to save is the number of windows this replica has consumed; times the
replica count (``position``), that is the run's position, which a run of another dp continues from (``seek``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from bimetal.errors import UserError
from bimetal.schema import not_a_file
from bimetal.train.tokenizer import ByteTokenizer, HFJsonTokenizer

SHIPPED_CORPUS = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"


def load_tokens(path: str, tokenizer: ByteTokenizer | HFJsonTokenizer, bin_dtype: str = "uint16") -> np.ndarray:
    """All tokens of ``path`` (or of the shipped corpus); raises ``UserError`` if missing.

    Text and JSONL are tokenized into an int64 array; a ``.bin`` shard is memory-mapped as it is stored
    (uint16/uint32), so a corpus larger than memory costs only the windows a replica reads.
    """
    p = Path(path) if path else SHIPPED_CORPUS
    why = not_a_file(p)
    if why:
        raise UserError(f"data file {p} {why}; set data.path to a text, .jsonl or .bin file.")
    if p.suffix == ".bin":
        dtype = np.dtype(bin_dtype)
        if p.stat().st_size % dtype.itemsize:
            raise UserError(f"{p} is {p.stat().st_size} bytes, not a whole number of {bin_dtype} tokens; "
                            "set data.bin_dtype to the type the shard was written with.")
        return np.memmap(p, dtype=dtype, mode="r")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"data file {p} is not UTF-8 text (byte {exc.start} is not); give a text, .jsonl or "
                        ".bin token file as data.path.") from None
    except OSError as exc:
        raise UserError(f"data file {p} cannot be read ({exc.strerror or exc}); check its permissions.") from None
    if p.suffix == ".jsonl":
        ids: list[int] = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"line {n} of {p} is not a JSON object with a 'text' field; fix the file.") from None
            ids.extend(tokenizer.encode(text))
            ids.append(tokenizer.eos_id)
        return np.asarray(ids, dtype=np.int64)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


class TokenStream:
    """Batches of ``(inputs, targets)``, each ``[batch, seq_len]``, for one dp replica."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, vocab_size: int | None = None) -> None:
        """``vocab_size``: refuse a batch holding an id the model cannot embed (a file that is not tokens)."""
        self.tokens, self.vocab_size = tokens, vocab_size
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        n_windows = (len(tokens) - 1) // seq_len
        if n_windows < batch_size * dp_size:
            raise UserError(f"the data has {len(tokens)} tokens, too few for {dp_size} replicas x batch {batch_size}"
                            f" x seq_len {seq_len}; use more data or smaller data.seq_len/data.batch_size.")
        self.n_windows = n_windows
        self.consumed = 0  # windows this replica has taken so far (the saved position)

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n_windows, generator=g)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_epoch = self.n_windows // self.dp_size
        rows = []
        for _ in range(self.batch_size):
            epoch, i = divmod(self.consumed, per_epoch)
            w = int(self._cached(epoch)[i * self.dp_size + self.dp_rank])
            start = w * self.seq_len
            rows.append(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
            self.consumed += 1
        batch = torch.from_numpy(np.stack(rows))
        if self.vocab_size is not None and int(batch.max()) >= self.vocab_size:
            raise UserError(f"the data holds token id {int(batch.max())} but the model has {self.vocab_size} tokens; "
                            "data.path is not a token file for this model (check it and data.bin_dtype).")
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def _cached(self, epoch: int) -> torch.Tensor:
        # One permutation per epoch, kept so a batch does not rebuild it per row.
        if getattr(self, "_cache_epoch", None) != epoch:
            self._cache, self._cache_epoch = self._order(epoch), epoch
        return self._cache

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "dp_rank": self.dp_rank, "dp_size": self.dp_size, "seed": self.seed}

    def position(self) -> int:
        """Windows taken by all replicas together: the data position of the run, whatever its dp."""
        return self.consumed * self.dp_size

    def seek(self, windows: int, seed: int) -> None:
        """Continue from the run's position ``windows`` (``position``), saved by a run of any dp: each replica
        takes its share of the same global batches. Exact within an epoch; where ``n_windows`` is not a multiple
        of both dp sizes, the windows left over at an epoch's end differ between them, as in two uninterrupted
        runs of those dp sizes."""
        if seed != self.seed or windows % self.dp_size:
            raise UserError(f"the checkpoint's data position ({windows} windows, seed {seed}) does not divide "
                            f"among this run's {self.dp_size} replicas with seed {self.seed}; resume with the "
                            "global batch and seed it was written with.")
        self.consumed = windows // self.dp_size

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["dp_size"], state["seed"]) != (self.dp_size, self.seed):
            raise UserError(f"the checkpoint's data position is for dp={state['dp_size']} seed={state['seed']}, "
                            f"this run has dp={self.dp_size} seed={self.seed}; resume with the same layout.")
        self.consumed = int(state["consumed"])

"""Tokenizers that need no download: bytes (vocab 256 + specials) or a local HF ``tokenizers`` JSON file."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from bimetal.errors import UserError
from bimetal.schema import not_a_file


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; ``<eos>`` is 256 and ``<pad>`` 257, so ``vocab_size`` is 258."""

    def __init__(self) -> None:
        self.eos_id = 256
        self.pad_id = 257
        self.vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFJsonTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library (shipped with transformers)."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        why = not_a_file(p)
        if why:
            raise UserError(f"tokenizer file {p} {why}; "
                            "set data.tokenizer to 'byte' or a tokenizer.json path.")
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(p))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot parse
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"data.tokenizer {p} is not a tokenizers JSON file ({reason}); give a tokenizer.json "
                            "or 'byte'.") from None
        self.vocab_size = self._tok.get_vocab_size()
        eos = next((t for t in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>") if self._tok.token_to_id(t)
                    is not None), None)
        self.eos_id = self._tok.token_to_id(eos) if eos else self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def build_tokenizer(spec: str) -> ByteTokenizer | HFJsonTokenizer:
    """``byte`` or the path of a ``tokenizer.json``."""
    return ByteTokenizer() if spec == "byte" else HFJsonTokenizer(spec)

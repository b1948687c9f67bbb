"""A local token-level tokenizer: a fixed list of symbols, nothing downloaded.

Text is the symbols separated by whitespace (``"<bos> #12 | a b ="``), so the mapping is exact in
both directions and a prompt can be read in a log. Symbols may not contain whitespace.
"""

from __future__ import annotations

from typing import Iterable, Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class Tokenizer:
    """Symbol <-> id table. Ids 0, 1, 2 are `<pad>`, `<bos>`, `<eos>` (the stop token)."""

    def __init__(self, symbols: Iterable[str]):
        table = [PAD, BOS, EOS]
        for sym in symbols:
            if not sym or any(c.isspace() for c in sym):
                raise ValueError(f"Tokenizer.symbols: non-empty strings without whitespace, got {sym!r}")
            if sym in table:
                raise ValueError(f"Tokenizer.symbols: {sym!r} appears twice (or is a reserved special)")
            table.append(sym)
        self.symbols: tuple[str, ...] = tuple(table)
        self._ids = {s: i for i, s in enumerate(self.symbols)}
        self.pad_id, self.bos_id, self.stop_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def id(self, symbol: str) -> int:
        try:
            return self._ids[symbol]
        except KeyError:
            known = ", ".join(self.symbols[:12])
            raise ValueError(f"Tokenizer: unknown symbol {symbol!r}; known: {known}, ...") from None

    def encode(self, text: str) -> list[int]:
        return [self.id(s) for s in text.split()]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out = []
        for i in ids:
            if not 0 <= int(i) < len(self.symbols):
                raise ValueError(f"Tokenizer.decode: id {i} outside [0, {len(self.symbols)})")
            if skip_special and int(i) in (self.pad_id, self.bos_id, self.stop_id):
                continue
            out.append(self.symbols[int(i)])
        return " ".join(out)

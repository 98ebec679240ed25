"""Fake ``sglang.srt.speculative.spec_info.SpeculativeAlgorithm``: SGLang 0.5.23's names."""

from __future__ import annotations

from enum import Enum, auto


class SpeculativeAlgorithm(Enum):
    DFLASH = auto()
    EAGLE = auto()
    EAGLE3 = auto()
    NEXTN = auto()
    STANDALONE = auto()
    NGRAM = auto()
    NONE = auto()

    @classmethod
    def from_string(cls, name: str | None) -> SpeculativeAlgorithm:
        if name is None:
            return cls.NONE
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"Unknown speculative algorithm name: {name}") from None

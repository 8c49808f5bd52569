"""Local text files as ``data.source`` (a .txt / .md file, or a folder of them): documents, read as a stream.

Each file is one document: its paragraphs (split at blank lines, as ``data.paragraphs`` splits a text) are read a
chunk at a time, never the whole corpus into one Python string, and the tokenizer's EOS follows the file's last
paragraph when packed (recipes/data.py). The held-out part is the last ``data.heldout_fraction`` of the characters,
the files taken in sorted order: it falls inside a file when it must, so a single notes.txt has one too.
"""

from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass

from ..common.files import write_atomically
from .data import DOCUMENT_END

TEXT_FILES = (".txt", ".md")
CHUNK = 1 << 20  # characters read at a time


def _not_utf8(path: str) -> ValueError:
    """The first byte of ``path`` that is not UTF-8, named (read again as bytes: only on this error path)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as handle:
        while raw := handle.read(CHUNK):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(raw)
            except UnicodeDecodeError as error:
                return ValueError(f"{path}: not UTF-8 text (byte {offset - pending + error.start}: {error.reason}); "
                                  "pass a text file")
            offset += len(raw)
    return ValueError(f"{path}: not UTF-8 text (it ends inside a character); pass a text file")


def _chunks(path: str, start: int = 0, stop: int | None = None):
    """The characters [start, stop) of a UTF-8 file, CHUNK at a time (newlines read as Python reads text)."""
    position = 0
    try:
        with open(path, encoding="utf-8") as handle:
            while stop is None or position < stop:
                chunk = handle.read(CHUNK if stop is None else min(CHUNK, stop - position))
                if not chunk:
                    return
                end = position + len(chunk)
                if end > start:
                    yield chunk[max(0, start - position):]
                position = end
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


@dataclass(frozen=True)
class TextFiles:
    """A .txt / .md file or the ones in a folder (dataset_sources._short_form finds them), one document each."""

    label: str  # the source as the recipe names it
    files: tuple[str, ...]  # sorted paths

    def characters(self, saved: str | None = None) -> list[int]:
        """Each file's number of characters (one pass over them, which also checks they are UTF-8 text); no text
        at all is a ValueError naming the source.

        ``saved``: a JSON file of the counts with each file's byte size and modification time. Where it matches the
        files, it answers without reading them; else they are counted and it is written. A run's main process counts
        (recipes/stages.py packs the data there first) and the others read its counts: they need them for the
        held-out cut, and otherwise every process would read the whole corpus once to find it."""
        if saved is None:
            return self._count()
        stamps = [[path, stat.st_size, stat.st_mtime_ns] for path, stat in zip(self.files, map(os.stat, self.files))]
        if os.path.exists(saved):
            try:
                with open(saved, encoding="utf-8") as handle:
                    known = json.load(handle)
                if known["files"] == stamps:
                    return known["characters"]
            except (OSError, ValueError, KeyError, TypeError):
                pass  # unreadable or another layout: counted again below, and rewritten
        sizes = self._count()
        write_atomically(saved, json.dumps({"files": stamps, "characters": sizes}))
        return sizes

    def _count(self) -> list[int]:
        sizes, text = [], False
        for path in self.files:
            sizes.append(0)
            for chunk in _chunks(path):
                sizes[-1] += len(chunk)
                text = text or not chunk.isspace()
        if not text:
            raise ValueError(f"{self.label}: no text in it")
        return sizes

    def pieces(self, start: int, stop: int, sizes: list[int]):
        """The characters [start, stop) of the files one after another, as text pieces: paragraphs with their blank
        line, and ``DOCUMENT_END`` after each file that ends inside the range and gave a paragraph in it."""
        offset = 0
        for path, size in zip(self.files, sizes):
            first, last = max(start, offset) - offset, min(stop, offset + size) - offset
            offset += size
            if first >= last:
                continue
            rest, given = "", False
            for chunk in _chunks(path, first, last):
                *whole, rest = (rest + chunk).split("\n\n")
                for paragraph in whole:
                    if paragraph.strip():
                        given = True
                        yield paragraph + "\n\n"
                if len(rest) > CHUNK:  # a megabyte without a blank line: tokenised in parts, cut after a line
                    cut = rest.rfind("\n") + 1 or len(rest)
                    if rest[:cut].strip():
                        given = True
                        yield rest[:cut]
                    rest = rest[cut:]
            if rest.strip():
                given = True
                yield rest + "\n\n"
            if given and last == size:
                yield DOCUMENT_END

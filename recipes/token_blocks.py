"""Token blocks on disk: written once by the main process, memory-mapped by every process.

    writer = BlockWriter(length, "OUT/data/train.int32")   # or BlockWriter(length): blocks kept in memory
    writer.add(ids)                                         # one block of ``length`` token ids
    blocks = writer.finish()                                # (N, length) int32, memory-mapped from the file
    blocks, rows_read = cut_blocks(rows, length, wanted, path)   # token rows back to back, cut into blocks

A corpus of billions of tokens never sits in a process's memory, and the processes of a node share one copy of it
(the page cache). The file is raw int32 in row order, its block length in a JSON sidecar; it is written under a
temporary name and renamed when whole, so a reader never sees half of it. Batches are taken from it a few rows at a
time (trainer.batch_at) and only those rows are moved to the device, as int64.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

FLUSH_ROWS = 1024  # blocks buffered between writes


class BlockWriter:
    """Blocks of ``length`` token ids appended to ``path`` (None: kept in memory), then read back whole."""

    def __init__(self, length: int, path: str | None = None):
        self.length, self.path, self.count, self.rows, self.buffered = length, path, 0, [], 0
        self.handle = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.handle = open(path + ".partial", "wb", buffering=0)  # rows are buffered here, FLUSH_ROWS at a time

    def add(self, ids) -> None:
        """One block: ``length`` token ids."""
        self.extend(np.asarray(ids, dtype=np.int32)[None])

    def extend(self, blocks) -> None:
        """Several blocks: (n, length) token ids."""
        blocks = np.asarray(blocks, dtype=np.int32)
        if blocks.ndim != 2 or blocks.shape[1] != self.length:
            raise ValueError(f"a block holds {self.length} tokens, got blocks of shape {tuple(blocks.shape)}")
        self.rows.append(blocks)
        self.count += blocks.shape[0]
        self.buffered += blocks.shape[0]
        if self.handle is not None and self.buffered >= FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.rows:  # os writes, not ndarray.tofile: a full disk raises with its errno, naming the file
            data = memoryview(np.concatenate(self.rows)).cast("B")
            try:
                while data:
                    data = data[self.handle.write(data):]
            except OSError as error:
                raise OSError(error.errno, error.strerror, self.path) from None
            self.rows, self.buffered = [], 0

    def finish(self) -> torch.Tensor:
        """The blocks, (count, length) int32: memory-mapped from the file, which now exists under its own name."""
        if self.handle is None:
            return torch.from_numpy(np.concatenate(self.rows)) if self.rows else torch.empty(0, self.length,
                                                                                            dtype=torch.int32)
        self._flush()
        self.handle.close()
        with open(self.path + ".json.partial", "w", encoding="utf-8") as handle:
            json.dump({"length": self.length, "blocks": self.count, "dtype": "int32"}, handle)
        os.replace(self.path + ".partial", self.path)
        os.replace(self.path + ".json.partial", self.path + ".json")
        return read_blocks(self.path)

    def abandon(self) -> None:
        """Drop a half-written file (an error while packing): nothing half-written is left behind."""
        if self.handle is not None:
            self.handle.close()
            for leftover in (self.path + ".partial", self.path + ".json.partial"):
                if os.path.exists(leftover):
                    os.remove(leftover)


def cut_blocks(rows, length: int, wanted: int | None = None, path: str | None = None,
               too_short: str = "fewer tokens than one block") -> tuple[torch.Tensor, int]:
    """(blocks (N, length) int32, rows read): ``rows`` of token ids (documents, paragraphs) back to back, cut into
    blocks of ``length`` as they come, at most ``wanted`` (None: every whole block), written to ``path`` as they are
    cut (None: kept in memory). Rows are read only as far as the blocks need; not one whole block is
    ``ValueError(too_short)``, and nothing is left behind."""
    writer, buffer, used = BlockWriter(length, path), [], 0
    wanted = float("inf") if wanted is None else wanted
    try:
        for row in rows:
            if writer.count >= wanted:
                break
            used += 1
            buffer.extend(row)
            while len(buffer) >= length and writer.count < wanted:
                writer.add(buffer[:length])
                del buffer[:length]
        if not writer.count:
            raise ValueError(too_short)
    except BaseException:
        writer.abandon()
        raise
    return writer.finish(), used


def read_blocks(path: str) -> torch.Tensor:
    """The (N, length) int32 blocks a BlockWriter wrote to ``path``, memory-mapped (pages read as rows are used;
    writes to the tensor stay private to this process)."""
    try:
        with open(path + ".json", encoding="utf-8") as handle:
            length = json.load(handle)["length"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}.json: not the description of a token-block file ({error})") from None
    size = os.path.getsize(path) // 4
    if size == 0 or size % length:
        raise ValueError(f"{path}: {size} tokens, not a whole number of {length}-token blocks")
    return torch.from_file(path, shared=False, size=size, dtype=torch.int32).view(-1, length)

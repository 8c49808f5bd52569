"""A chunk pipeline for Triton kernels whose chunks depend on the chunks before them (a triangular solve): a
program per (row of independent work, chunk), all launched at once, each waiting only where it reads what an earlier
chunk's program writes.

A program's chunk comes from a ticket drawn when it starts (``claim``), not from its program id: every program it
waits for drew an earlier ticket, so it is running or done, and no order the GPU starts programs in can deadlock
the chain. A chunk is published (``publish``: a barrier, then a release increment of its row's progress counter)
once its stores are done; a reader acquires the counter (``wait_for``) before it reads. A wait gives up after
``SPIN_LIMIT`` polls and the caller writes NaN: a GPU that never ran an earlier program fails loudly (the trainer's
NaN stop, the tests) rather than hangs. Under the interpreter the programs run one after another in ticket order, so
every wait is already met.

Used by the Sessa solve (kernels/feedback_solve_triton.py) and GLTM's sparse solve (kernels/sparse_solve_triton.py).
"""

from __future__ import annotations

import torch

# A try block on purpose (see feedback_solve_triton.py): imported only once a Triton path was chosen.
try:
    import triton
    import triton.language as tl
finally:
    pass

SPIN_LIMIT = tl.constexpr(1 << 26)  # polls before a chunk's wait gives up


@triton.jit
def claim(ticket_ptr, progress_ptr, N_CHUNKS, BLOCKS):
    """This program's (row, block, chunk index) from a ticket drawn in the order programs start, chunks fastest, and
    the progress counter of its (row, block); ``row`` is int64 (row offsets may pass 2^31)."""
    ticket = tl.atomic_add(ticket_ptr, 1)
    row = ticket // N_CHUNKS  # (row, block)
    return (row // BLOCKS).to(tl.int64), row % BLOCKS, ticket % N_CHUNKS, progress_ptr + row


@triton.jit
def wait_for(progress_ptr, chunks):
    """Spin until ``chunks`` chunks of this (row, block) are published (acquire: their stores are then visible); 1
    if it gave up after ``SPIN_LIMIT`` polls, else 0."""
    polls = 0
    while (tl.atomic_add(progress_ptr, 0, sem="acquire") < chunks) & (polls < SPIN_LIMIT):
        polls += 1
    return (polls >= SPIN_LIMIT).to(tl.int32)


@triton.jit
def publish(progress_ptr):
    """Count this chunk as published, after every thread's stores (the barrier, then a release)."""
    tl.debug_barrier()
    tl.atomic_add(progress_ptr, 1, sem="release")


def zeroed_counters(rows: int, device) -> torch.Tensor:
    """The pipeline's zeroed int32 counters: the ticket, then one progress count per (row, block)."""
    return torch.zeros(1 + rows, dtype=torch.int32, device=device)


def ticket_and_progress(buffer):
    """The ticket and the progress counts of ``zeroed_counters``' buffer (a warmup's dtype stands for both)."""
    return (buffer, buffer) if isinstance(buffer, torch.dtype) else (buffer, buffer[1:])

"""A constant-state mixer's decode state as a fixed list of per-sequence tensors, and back: what a serving engine's
state cache (vLLM's) keeps in one slot for one sequence.

    layout = state_layout(mixer, rotary)           # shapes and dtypes of one sequence's slot, from a warm state
    pack(layout, (state, history), tensors, slots)  # a batch's state: row b into row slots[b] of each tensor
    state, history = unpack(layout, tensors, slots)

A mixer's state (``RecurrentMixer.mix``: an RSAState, a WindowState around one, tuples of tensors, the short-conv
history) is a tree of dataclasses, tuples and tensors whose shapes do not grow with the context, but whose parts may
be None for a while (a window's memory before the first token leaves it). The layout is that tree as it is once every
part exists (``WARM_TOKENS`` past the longest window); a slot holds every tensor without its batch dimension, zeros
where the part is None, then one presence flag per node (uint8). An engine packs a slot's tensors back to back in
one page of bytes (vLLM's ``MambaBase.bind_kv_cache``), so they are ordered by element size, widest first, and the
flags padded to make the slot a whole number of 8-byte words: every tensor of every slot starts aligned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

WARM_TOKENS = 66  # tokens past the longest window (and one chunk of 64) that make every part of a state exist


@dataclass(frozen=True)
class StateLayout:
    """One sequence's slot: ``shapes`` and ``dtypes`` of its tensors (the flags last), the state's tree, and where
    each of the tree's tensors is kept (``places[i]``: the slot tensor of the i-th in the tree's order; None for a
    tensor with no elements, rebuilt from the tree)."""

    shapes: tuple
    dtypes: tuple
    template: object
    places: tuple

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's slot."""
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in zip(self.shapes, self.dtypes))


def state_layout(mixer, rotary, window: int = 0) -> StateLayout:
    """The layout of ``mixer``'s state (a ``RecurrentMixer``), from one batch-1 call of ``window + WARM_TOKENS``
    tokens without gradients; ``rotary(x, position_ids) -> (cos, sin)`` gives the call its position embeddings."""
    parameter = next(mixer.parameters())
    length = window + WARM_TOKENS
    hidden = torch.zeros(1, length, mixer.config.hidden_size, device=parameter.device, dtype=parameter.dtype)
    with torch.no_grad():
        _, state, history = mixer.mix(hidden, rotary(hidden, torch.arange(length, device=hidden.device)[None]))
    template = (state, history)
    flags, leaves = [], []
    _walk(template, template, flags, leaves)
    for leaf in leaves:
        if leaf.dim() == 0 or leaf.shape[0] != 1:
            raise ValueError(f"{type(mixer).__name__}: a state tensor of shape {tuple(leaf.shape)} has no batch "
                             "dimension first; it cannot be kept per sequence")
    # stable: the tree's order within; a part with no elements (a zero-width tensor) takes no room in the slot
    order = sorted((i for i in range(len(leaves)) if leaves[i][0].numel()), key=lambda i: -leaves[i].element_size())
    places = tuple(order.index(i) if i in order else None for i in range(len(leaves)))
    tensor_bytes = sum(leaves[i][0].numel() * leaves[i].element_size() for i in order)
    flag_bytes = len(flags) + (-(tensor_bytes + len(flags))) % 8  # the slot a whole number of 8-byte words
    return StateLayout(shapes=(*(tuple(leaves[i].shape[1:]) for i in order), (flag_bytes,)),
                       dtypes=(*(leaves[i].dtype for i in order), torch.uint8), template=template, places=places)


def pack(layout: StateLayout, state, tensors, slots) -> None:
    """Write ``state`` (a batch of len(slots) rows, the layout's tree with any part None) into rows ``slots`` of
    ``tensors``."""
    index = torch.as_tensor(slots, dtype=torch.long, device=tensors[-1].device)
    flags, leaves = [], []
    _walk(layout.template, state, flags, leaves)
    tensors[-1][index, :len(flags)] = torch.tensor(flags, dtype=torch.uint8, device=index.device)
    for place, leaf in zip(layout.places, leaves):
        if place is not None:
            tensors[place][index] = 0 if leaf is None else leaf.to(tensors[place].dtype)


def unpack(layout: StateLayout, tensors, slots, flags=None):
    """The state kept in rows ``slots`` of ``tensors``, a batch of len(slots) (a copy; None where a part was None:
    the rows must have the same parts, as one call left them). ``flags``: the rows' presence flags when the caller
    has read them already (else they are read here, from the first row)."""
    index = torch.as_tensor(slots, dtype=torch.long, device=tensors[-1].device)
    flags = iter(tensors[-1][index[0]].tolist() if flags is None else flags)
    leaves = iter([None if place is None else tensors[place] for place in layout.places])
    return _build(layout.template, flags, leaves, index)


def _walk(template, actual, flags: list, leaves: list) -> None:
    """Flags (is the node present) and tensors (None where absent) of ``actual``, in the order of ``template``."""
    flags.append(actual is not None)
    if isinstance(template, torch.Tensor):
        leaves.append(actual)
    elif dataclasses.is_dataclass(template):
        for field in dataclasses.fields(template):
            _walk(getattr(template, field.name), None if actual is None else getattr(actual, field.name), flags,
                  leaves)
    elif isinstance(template, (tuple, list)):
        if actual is not None and len(actual) != len(template):
            raise ValueError(f"a state tuple of {len(actual)} parts where the layout has {len(template)}")
        for index, part in enumerate(template):
            _walk(part, None if actual is None else actual[index], flags, leaves)
    elif template is not None:
        raise TypeError(f"a state holds a {type(template).__name__}: only tensors, tuples and dataclasses of them "
                        "can be kept per sequence")
    elif actual is not None:
        raise ValueError("a state part that is None in the layout is present")


def _build(template, flags, leaves, index):
    present = next(flags)
    if isinstance(template, torch.Tensor):
        tensor = next(leaves)
        if tensor is None:  # a part with no elements, kept in no slot
            return torch.zeros(len(index), *template.shape[1:], dtype=template.dtype, device=index.device) \
                if present else None
        return tensor[index] if present else None  # advanced indexing: a copy
    if dataclasses.is_dataclass(template):
        parts = {field.name: _build(getattr(template, field.name), flags, leaves, index)
                 for field in dataclasses.fields(template)}
        return type(template)(**parts) if present else None
    if isinstance(template, (tuple, list)):
        parts = [_build(part, flags, leaves, index) for part in template]
        return type(template)(parts) if present else None
    return None

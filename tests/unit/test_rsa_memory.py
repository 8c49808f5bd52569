"""RSA memory ops: the chunk form against the exact token recurrence (spec §5.2, §13), numerics, padding."""

import itertools

import pytest
import torch

from hf_mixers.kernels.rsa_memory import RSAParams, initial_state, rsa_chunked, rsa_memory, rsa_recurrent

F64 = torch.float64


def residual_mlp(dim, generator, dtype):
    w1 = torch.randn(dim, dim, generator=generator, dtype=dtype) * 0.3
    w2 = torch.randn(dim, dim, generator=generator, dtype=dtype) * 0.3
    return lambda x: x + torch.nn.functional.silu(x @ w1) @ w2


def make_params(groups=2, group_size=2, levels=3, slots=5, key_dim=8, value_dim=6, chunk=4, dtype=F64, seed=0,
                query_read=False, **options):
    g = torch.Generator().manual_seed(seed)
    heads = groups * group_size

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=dtype)

    def near_identity():
        return torch.eye(slots, dtype=dtype) + 0.1 * torch.randn(heads, levels, slots, slots, generator=g, dtype=dtype)

    return RSAParams(
        prototypes=torch.randn(groups, levels, slots, key_dim, generator=g, dtype=dtype), kappa=rand(groups, levels) + 0.5,
        beta=rand(groups, levels) + 0.5, key_mlps=[residual_mlp(key_dim, g, dtype) for _ in range(levels - 1)],
        value_mlps=[residual_mlp(value_dim, g, dtype) for _ in range(levels - 1)], read_proj=near_identity(),
        mix_proj=near_identity(), threshold=rand(heads, levels) * 0.3, read_scale=rand(heads, levels) + 0.5,
        query_read=torch.randn(heads, levels, key_dim, slots, generator=g, dtype=dtype) if query_read else None,
        chunk_size=chunk, **options)


def make_inputs(params, batch=3, length=23, seed=1, dtype=F64, value_dim=6):
    groups, _, _, key_dim = params.prototypes.shape
    group_size = params.read_proj.shape[0] // groups
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, groups, group_size, length, key_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, groups, length, key_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, groups, length, value_dim, generator=g, dtype=dtype)
    valid = torch.ones(batch, length, dtype=torch.bool)
    if batch > 1:
        valid[1, :5] = False  # left padding
    if batch > 2:
        valid[2, 10] = False  # a hole
    return q, k, v, valid


STATE_FIELDS = ("key_sum", "value_sum", "mass", "relation_sum", "key_ref", "value_ref", "count")
OPTIONS = list(itertools.product(["softmax", "sigmoid"], ["sigmoid", "softmax_count"],
                                 ["relation", "elementwise", "none"], [False, True]))


@pytest.mark.parametrize("assign_fn, readout, routing, query_read", OPTIONS)
def test_chunk_form_equals_token_recurrence(assign_fn, readout, routing, query_read):
    params = make_params(assign_fn=assign_fn, readout=readout, routing=routing, query_read=query_read)
    q, k, v, valid = make_inputs(params)
    start = initial_state(params, q.shape[0], v.shape[-1], F64)
    reference, reference_state = rsa_recurrent(q, k, v, valid, start, params)
    chunked, chunked_state = rsa_chunked(q, k, v, valid, start, params)
    torch.testing.assert_close(chunked, reference, rtol=0, atol=1e-10)
    for name in STATE_FIELDS:
        torch.testing.assert_close(getattr(chunked_state, name), getattr(reference_state, name), rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunks_per_read", [1, 2, 4])
def test_chunks_read_a_group_at_a_time_equal_the_recurrence(chunks_per_read, monkeypatch):
    """READ_GROUP_ELEMENTS cut to ``chunks_per_read`` chunks a read: outputs, gradients and state equal the token
    recurrence's, with decay, padding and a hole; and the read was in fact split."""
    import hf_mixers.kernels.rsa_memory as module

    params = make_params(levels=2, query_read=True)
    q, k, v, valid = make_inputs(params)
    log_decay = -torch.rand(q.shape[0], q.shape[1], q.shape[3], dtype=F64, generator=torch.Generator().manual_seed(2))
    for x in (q, k, v):
        x.requires_grad_()
    start = initial_state(params, q.shape[0], v.shape[-1], F64)
    reference, reference_state = rsa_recurrent(q, k, v, valid, start, params, log_decay)
    per_chunk = q.shape[0] * q.shape[1] * q.shape[2] * params.chunk_size * 8  # widest: key_dim 8
    monkeypatch.setattr(module, "READ_GROUP_ELEMENTS", chunks_per_read * per_chunk)
    reads, real_read = [], module.read_chunks
    monkeypatch.setattr(module, "read_chunks", lambda q_b, *a: reads.append(q_b.shape[3]) or real_read(q_b, *a))
    chunked, chunked_state = module.rsa_chunked(q, k, v, valid, start, params, log_decay)
    rows = chunks_per_read * params.chunk_size  # 24 buffer rows: 23 tokens in chunks of 4
    assert reads == [min(rows, 24 - first) for first in range(0, 24, rows)]
    torch.testing.assert_close(chunked, reference, rtol=0, atol=1e-10)
    for name in STATE_FIELDS:
        torch.testing.assert_close(getattr(chunked_state, name), getattr(reference_state, name), rtol=0, atol=1e-10)
    for a, b in zip(torch.autograd.grad(chunked.pow(2).sum(), [q, k, v]),
                    torch.autograd.grad(reference.pow(2).sum(), [q, k, v])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("split", [1, 4, 9])
def test_state_carried_across_calls_mid_chunk(split):
    """A prefill that stops mid-chunk and continues (chunked or token by token) equals one pass."""
    params = make_params()
    q, k, v, valid = make_inputs(params)
    start = initial_state(params, q.shape[0], v.shape[-1], F64)
    whole, _ = rsa_chunked(q, k, v, valid, start, params)
    first, state = rsa_chunked(q[..., :split, :], k[:, :, :split], v[:, :, :split], valid[:, :split], start, params)
    rest, _ = rsa_memory(q[..., split:, :], k[:, :, split:], v[:, :, split:], valid[:, split:], state, params)
    torch.testing.assert_close(torch.cat([first, rest], 3), whole, rtol=0, atol=1e-10)
    steps, state = [first], state
    for t in range(split, q.shape[3]):  # decode path: one token at a time
        out, state = rsa_memory(q[..., t:t + 1, :], k[:, :, t:t + 1], v[:, :, t:t + 1], valid[:, t:t + 1], state,
                                params)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 3), whole, rtol=0, atol=1e-10)


def test_padded_rows_equal_each_sequence_alone():
    params = make_params()
    q, k, v, valid = make_inputs(params)
    start = initial_state(params, q.shape[0], v.shape[-1], F64)
    batched, _ = rsa_chunked(q, k, v, valid, start, params)
    for row in range(q.shape[0]):
        keep = valid[row]
        alone, _ = rsa_chunked(q[row:row + 1, ..., keep, :], k[row:row + 1, :, keep], v[row:row + 1, :, keep], None,
                               initial_state(params, 1, v.shape[-1], F64), params)
        torch.testing.assert_close(batched[row:row + 1, ..., keep, :], alone, rtol=0, atol=1e-10)
        assert torch.count_nonzero(batched[row, ..., ~keep, :]) == 0  # padded positions output 0


def test_gradients_of_chunk_form_equal_recurrence():
    params = make_params(levels=2, query_read=True)
    leaves = [params.prototypes, params.read_proj, params.mix_proj, params.threshold]
    for leaf in leaves:
        leaf.requires_grad_()
    q, k, v, valid = make_inputs(params, length=11)
    for x in (q, k, v):
        x.requires_grad_()
    grads = []
    for fn in (rsa_recurrent, rsa_chunked):
        out, _ = fn(q, k, v, valid, initial_state(params, q.shape[0], v.shape[-1], F64), params)
        grads.append(torch.autograd.grad(out.pow(2).sum(), [q, k, v, *leaves]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", ["random", "identical_keys", "zeros"])
def test_long_sequences_stay_finite_in_fp32(case):
    params = make_params(dtype=torch.float32, chunk=64, levels=2, slots=8, key_dim=16, value_dim=16, query_read=True)
    q, k, v, _ = make_inputs(params, batch=1, length=16384, dtype=torch.float32, value_dim=16)
    if case == "identical_keys":
        k = k[:, :, :1].expand_as(k).contiguous()
    elif case == "zeros":
        q, k, v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    with torch.no_grad():
        out, state = rsa_chunked(q, k, v, None, initial_state(params, 1, v.shape[-1], torch.float32), params)
    assert torch.isfinite(out).all() and all(torch.isfinite(getattr(state, n)).all() for n in STATE_FIELDS[:-1])
    assert state.count.item() == 16384
    torch.testing.assert_close(state.mass.sum(-1), torch.full_like(state.mass.sum(-1), 16384.0))  # softmax mass


def test_zero_initial_state_never_separates_slots():
    """Spec §12-1: with zero prototypes every slot receives the same assignment forever."""
    params = make_params(levels=1)
    params.prototypes = torch.zeros_like(params.prototypes)
    q, k, v, _ = make_inputs(params, length=200)
    _, state = rsa_chunked(q, k, v, None, initial_state(params, q.shape[0], v.shape[-1], F64), params)
    slots = state.key_sum / (params.kappa[None, :, :, None] + state.mass)[..., None]
    assert (slots - slots[..., :1, :]).abs().max() < 1e-12


def test_unknown_method_is_named():
    params = make_params()
    q, k, v, valid = make_inputs(params)
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        rsa_memory(q, k, v, valid, initial_state(params, 3, 6, F64), params, method="fast")


@pytest.mark.parametrize("routing, query_read", [("relation", True), ("elementwise", False)])
def test_decay_chunk_form_equals_token_recurrence_and_continues(routing, query_read):
    params = make_params(routing=routing, query_read=query_read, readout="softmax_count")
    q, k, v, valid = make_inputs(params)
    log_decay = -torch.rand(q.shape[0], q.shape[1], q.shape[3], dtype=F64, generator=torch.Generator().manual_seed(3))
    start = initial_state(params, q.shape[0], v.shape[-1], F64)
    reference, reference_state = rsa_recurrent(q, k, v, valid, start, params, log_decay)
    chunked, chunked_state = rsa_chunked(q, k, v, valid, start, params, log_decay)
    torch.testing.assert_close(chunked, reference, rtol=0, atol=1e-10)
    for name in STATE_FIELDS:
        torch.testing.assert_close(getattr(chunked_state, name), getattr(reference_state, name), rtol=0, atol=1e-10)
    first, state = rsa_chunked(q[..., :7, :], k[:, :, :7], v[:, :, :7], valid[:, :7], start, params, log_decay[..., :7])
    rest, _ = rsa_chunked(q[..., 7:, :], k[:, :, 7:], v[:, :, 7:], valid[:, 7:], state, params, log_decay[..., 7:])
    torch.testing.assert_close(torch.cat([first, rest], 3), reference, rtol=0, atol=1e-10)
    no_decay, _ = rsa_chunked(q, k, v, valid, start, params)
    assert (no_decay - chunked).abs().max() > 1e-3  # the decay is actually applied


def test_decay_forgets_old_writes_and_padding_never_decays():
    params = make_params(levels=1)
    q, k, v, _ = make_inputs(params, batch=1, length=8)
    start = initial_state(params, 1, v.shape[-1], F64)
    valid = torch.tensor([[False, False, True, True, True, True, True, True]])
    decay = torch.full((1, 2, 8), -0.5, dtype=F64)
    _, padded = rsa_chunked(q, k, v, valid, start, params, decay)
    _, alone = rsa_chunked(q[..., 2:, :], k[:, :, 2:], v[:, :, 2:], None, start, params, decay[..., 2:])
    torch.testing.assert_close(padded.mass, alone.mass, rtol=0, atol=1e-12)
    _, kept = rsa_chunked(q, k, v, None, start, params)
    assert (alone.mass.sum(-1) < kept.mass.sum(-1)).all()  # decayed total mass < number of tokens


def test_recomputed_chunks_give_the_same_gradients():
    params = make_params(levels=2, query_read=True)
    leaves = [params.prototypes, params.read_proj, params.mix_proj]
    for leaf in leaves:
        leaf.requires_grad_()
    q, k, v, valid = make_inputs(params, length=13)
    grads = []
    for recompute in (False, True):
        params.recompute = recompute
        out, _ = rsa_chunked(q, k, v, valid, initial_state(params, q.shape[0], v.shape[-1], F64), params)
        grads.append(torch.autograd.grad(out.pow(2).sum(), leaves))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_output_stays_bounded_when_signed_read_weights_cancel(method):
    """Spec §12.13: W_r rows summing to zero make sum(a) == 0; the |a| normaliser keeps |o| <= max |v|."""
    params = make_params(routing="none")
    slots = params.mix_proj.shape[-1]
    params.mix_proj = (torch.eye(slots, dtype=F64) - 1.0 / slots).expand_as(params.mix_proj).clone()
    q, k, v, valid = make_inputs(params)
    state = initial_state(params, q.shape[0], v.shape[-1], F64)
    out, _ = rsa_memory(q, k, v, valid, state, params, method=method)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= v.abs().max() * (1 + 1e-9)


def host_reads(fn):
    """The names of the host reads (``.item()``, ``bool(tensor)``, ``nonzero``) ``fn`` makes, counted with
    torch.profiler on CPU: the same calls run on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace:
        fn()
    return sorted(event.name for event in trace.events()
                  if event.name in ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero"))


def test_the_chunk_form_reads_the_host_once_per_call_whatever_its_length():
    """A host read stalls a GPU's queue of launches until the device catches up. The chunk form reads nothing from
    a fresh state (the training step, a first prefill: the buffer's length follows from the shapes) and once from a
    state with history (the rows' largest span), not once more per chunk boundary: the token step's shortcut (skip
    the references' refresh when no row is at a boundary) is not taken in a chunk loop, where nearly every chunk
    ends at one."""
    params = make_params(levels=2)
    q, k, v, valid = make_inputs(params, batch=2, length=6 * params.chunk_size)
    q.requires_grad_()

    def step():
        out, _ = rsa_chunked(q, k, v, valid, initial_state(params, 2, v.shape[-1], F64), params, fresh=fresh)
        out.pow(2).sum().backward()

    for recompute, fresh in itertools.product((False, True), (False, True)):
        params.recompute = recompute
        assert host_reads(step) == ([] if fresh else ["aten::_local_scalar_dense"]), (recompute, fresh)


@pytest.mark.parametrize("length", [23, 24])
@pytest.mark.parametrize("padded", [True, False])
def test_a_fresh_state_is_laid_out_from_the_shapes_alone(length, padded):
    """``fresh`` (every count 0): the buffer is ceil(T / C) chunks, each row's tokens from offset 0 (without padding
    the sequence itself, filled up to a whole chunk). Outputs, state and gradients equal the token recurrence's
    and the layout read from the device, with left padding and a hole or none, a length that ends mid-chunk or on a
    boundary, and a state with history after it (the next call's phases follow the fresh call's counts)."""
    from hf_mixers.apps.bench.op_count import count_ops
    from hf_mixers.kernels.rsa_state import ChunkLayout, boundary_index

    params = make_params(levels=2)
    q, k, v, valid = make_inputs(params, length=length)
    valid = valid if padded else None
    for x in (q, k, v):
        x.requires_grad_()
    start = initial_state(params, q.shape[0], v.shape[-1], F64)
    fresh_layout = ChunkLayout.of(valid, start.count, params.chunk_size, length, fresh=True)
    assert fresh_layout.padded == -(-length // params.chunk_size) * params.chunk_size
    assert (fresh_layout.slot is None) == (valid is None)
    if valid is None:  # its tensors are the masked form's, kept a shape: a second call builds nothing
        every_real = torch.ones(q.shape[0], length, dtype=torch.bool)
        masked = ChunkLayout.of(every_real, start.count, params.chunk_size, length, fresh=True)
        layout_tensors = lambda layout: (layout.phase, layout.real, layout.valid(q.shape[0], "cpu"),  # noqa: E731
                                         boundary_index(layout, params.chunk_size))
        for got, want in zip(layout_tensors(fresh_layout), layout_tensors(masked), strict=True):
            assert torch.equal(got, want)
        again, _ = count_ops(lambda: layout_tensors(ChunkLayout.of(None, start.count, params.chunk_size, length,
                                                                   fresh=True)))
        assert again.ops == 0, again.by_name
    results = []
    for fn in (rsa_recurrent, lambda *a: rsa_chunked(*a, fresh=False), lambda *a: rsa_chunked(*a, fresh=True)):
        out, state = fn(q, k, v, valid, start, params)
        later, _ = rsa_chunked(q[..., :5, :], k[:, :, :5], v[:, :, :5], None, state, params)  # phases != 0
        grads = torch.autograd.grad(out.pow(2).sum() + later.pow(2).sum(), [q, k, v])
        results.append([out, later, *grads, *(getattr(state, name) for name in STATE_FIELDS)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
def test_the_compiled_write_equals_the_eager_one_and_one_graph_serves_every_layer():
    """``rsa_compile_write``: each chunk's write side and reference refresh through one torch.compile graph (fewer
    launches on a GPU). In fp64 on CPU: the output, the state and every gradient (inputs, prototypes, MLPs, beta)
    equal the eager write's; a second layer of the same shape (other weights) reuses the graph, it does not compile
    again. A named mode ("reduce-overhead": CUDA graphs on CUDA) compiles this same graph on a CPU: the GPU check's
    bench-distill-compiled-write runs it there (its dry run in this suite), tests/gpu on CUDA."""
    from dataclasses import replace

    from hf_mixers.apps.bench.harness import build_mixer
    from hf_mixers.kernels.rsa_state import compiled_write

    torch._dynamo.reset()
    compiled_write.cache_clear()
    options = {"rsa_num_levels": 3, "rsa_num_slots": 4, "rsa_chunk_size": 4, "rsa_query_read": True}
    layers = [build_mixer("rsa", options, 16, 4, 2, "cpu", F64)[0] for _ in range(2)]
    for layer in layers:
        with torch.no_grad():  # MLPs and betas away from their identity / init values, so their gradients matter
            for parameter in layer.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
    q, k, v, valid = make_inputs(layers[0].memory_params(F64), batch=3, length=11, value_dim=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    graphs = []
    for index, layer in enumerate(layers):
        results = []
        for compile_write in (False, True):
            params = replace(layer.memory_params(F64), compile_write=compile_write)
            layer.zero_grad()
            out, state = rsa_chunked(q, k, v, valid, initial_state(params, 3, 4, F64), params)
            grads = torch.autograd.grad(out.pow(2).sum() + state.key_sum.sum() + state.value_sum.pow(2).sum(),
                                        [q, k, v, *layer.parameters()], allow_unused=True)
            results.append((out, *(getattr(state, name) for name in STATE_FIELDS), *grads))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        for eager, compiled in zip(*results):
            if eager is None:
                assert compiled is None
            else:
                torch.testing.assert_close(compiled, eager, rtol=1e-9, atol=1e-10)
        assert any(g is not None and g.abs().sum() > 0 for g in results[1][1 + len(STATE_FIELDS) + 3:])
    # layer 1 compiled its graphs (the first chunk's state needs no gradient, the later ones' do); layer 2 none
    assert graphs[1] > graphs[0] and graphs[3] == graphs[1], graphs


def test_a_prefill_hands_on_a_state_that_holds_no_boundary_sums():
    """Without autograd (a prefill, whose state a cache keeps) the split write's state after the call owns its
    tensors: as views of the sums at every boundary it held all of them alive in the cache, N + 1 times the state
    (a converted model's cache held 70x its state after 512 tokens on the kernel path)."""
    from hf_mixers.kernels.rsa_state import ChunkLayout, write_chunks

    params = make_params()
    _, k, v, valid = make_inputs(params)
    state = initial_state(params, 3, v.shape[-1], F64)
    layout = ChunkLayout.of(valid, state.count, params.chunk_size, valid.shape[1])
    with torch.no_grad():
        writes, final = write_chunks(layout.pack(k, 2), layout.pack(v, 2), layout.valid(3, "cpu"), layout, state,
                                     params)
    assert writes.key_sum.shape[2] > 1  # several boundaries, the sums at every one kept by the writes
    for name in STATE_FIELDS:
        tensor = getattr(final, name)
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name


@pytest.mark.parametrize("assign_fn, levels", [("softmax", 3), ("sigmoid", 3), ("softmax", 1), ("sigmoid", 1)])
def test_split_write_equals_the_chunk_by_chunk_write(assign_fn, levels):
    """The write side split along its one recurrence (``write_chunks``: each level's assignment chain, then the rest
    over all chunks at once) against the literal chunk-by-chunk order (``write_chunks_in_order``), in fp64: every
    field of the writes (padding rows included), the state after the call, and the gradients through both, with rows
    at three phases (counts 0, 5, 3), left padding and a hole; a row ends on a boundary mid-buffer."""
    from dataclasses import fields, replace

    from hf_mixers.kernels.rsa_state import ChunkLayout, write_chunks, write_chunks_in_order

    params = make_params(levels=levels, assign_fn=assign_fn)
    for tensor in (params.prototypes, params.kappa, params.beta):
        tensor.requires_grad_()
    _, k, v, valid = make_inputs(params)
    k, v = k.requires_grad_(), v.requires_grad_()
    state = replace(initial_state(params, 3, v.shape[-1], F64), count=torch.tensor([0, 5, 3]))
    layout = ChunkLayout.of(valid, state.count, params.chunk_size, valid.shape[1])
    results = []
    for write in (write_chunks, write_chunks_in_order):
        writes, new_state = write(layout.pack(k, 2), layout.pack(v, 2), layout.valid(3, "cpu"), layout, state, params)
        written = [getattr(writes, f.name) for f in fields(writes) if f.name != "every_boundary"]  # not the bases
        tensors = written + [getattr(new_state, n) for n in STATE_FIELDS]
        g = torch.Generator().manual_seed(4)
        loss = sum((t * torch.randn(t.shape, generator=g, dtype=F64)).sum() for t in tensors if t.is_floating_point())
        results.append((tensors, torch.autograd.grad(loss, [k, v, params.prototypes, params.kappa, params.beta])))
    (split, split_grads), (in_order, in_order_grads) = results
    for a, b in zip(split + list(split_grads), in_order + list(in_order_grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

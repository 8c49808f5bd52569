"""GLTM's Triton kernels against their PyTorch references, in fp64: values and every gradient.

- The sparse feedback solve (kernels/sparse_solve_triton.py) against the chunked form (kernels/feedback_solve.py
  ``sparse_solve`` on the torch backend): GLTM's patterns, rows with no entry, a past, widths and entry counts that
  do not fill a tile, several chunks and column blocks, one support table broadcast over the batch.
- The gathered softmax (kernels/sparse_attention_triton.py) against ``gathered_softmax_reference``: GQA groups, a
  gain, strided queries and keys, rows with no key, repeated entries.
- A whole GLTM layer on the kernels against its PyTorch path, packed (shared support rows) and left-padded."""

import pytest
import torch

from triton_interpreter import DEVICE, interpreter_only, needs_kernels, run_under_interpreter

from hf_mixers.apps.bench.op_count import count_ops
from hf_mixers.kernels.feedback_solve import sparse_solve
from hf_mixers.kernels.sparse_attention import gathered_softmax, gathered_softmax_reference
from hf_mixers.kernels.token_patterns import support_rows
from hf_mixers.testing import check_step_compiles_whole


@pytest.mark.variant  # a subprocess of interpreted kernels: the full tier (make test) only
@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


def _system(pattern, batch=3, length=23, width=12, past=0, seed=0):
    """f (B, T, D), weights (B, T, K) and support (B, T, K) rows of [past, new] for a GLTM pattern (-1: none), and a
    past (B, P, D) or None."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(past + 1, past + length + 1).expand(batch, -1)  # 1-based
    table = support_rows(pattern, positions, window=3)  # (B, T, K) 1-based positions, 0 where none
    support = table - 1  # 0-based rows of [past, new]; -1 where none
    weights = torch.rand(*support.shape, generator=generator, dtype=torch.float64) * 0.4 * (support >= 0)
    f = torch.randn(batch, length, width, generator=generator, dtype=torch.float64)
    past_s = torch.randn(batch, past, width, generator=generator, dtype=torch.float64) if past else None
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return move(f), move(weights), move(support), move(past_s)


@needs_kernels
@pytest.mark.parametrize("pattern,past,length,width", [("pow2_ce", 0, 23, 12), ("banded", 0, 23, 12),
                                                       ("quad_ce", 5, 23, 12), ("ssm", 2, 23, 12),
                                                       ("pow2_ce", 3, 70, 80)])
def test_the_kernel_equals_the_chunked_form_in_fp64(pattern, past, length, width):
    """The chunks of CHUNK rows (two here, the second ragged; five in the last case, whose 80 features take two
    column blocks, the second ragged, each adding its share of the weights' gradients) against the block form."""
    f, weights, support, past_s = _system(pattern, past=past, length=length, width=width)
    g = torch.randn(f.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in (f, weights)] + ([past_s.clone().requires_grad_()] if past
                                                                         else [])
        solved = sparse_solve(leaves[0], leaves[1], support, leaves[2] if past else None, chunk_size=5,
                              backend=backend)
        results[backend] = (solved, *torch.autograd.grad((solved * g).sum(), leaves))
    names = ("s", "d f", "d weights", "d past")
    for name, expected, actual in zip(names, results["torch"], results["triton"]):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-13, msg=name)


@needs_kernels
def test_one_table_broadcast_over_the_batch_reads_as_its_copies():
    f, weights, support, _ = _system("pow2_ce")
    shared = support[:1].expand_as(support)  # every row's table is the same: a stride-0 view
    torch.testing.assert_close(sparse_solve(f, weights, shared, backend="triton"),
                               sparse_solve(f, weights, support.contiguous(), backend="torch"), rtol=1e-12, atol=1e-13)


def _softmax_inputs(batch=3, length=19, per_group=3, width=10, keys_length=19, entries=6, seed=0):
    """q (B, T, g, d) and keys (B, N, d) as strided views, support (B, T, K) with a row of no key and a repeated
    entry, a gain (B, T, g) as a strided view."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, per_group, length, width, generator=generator, dtype=torch.float64).transpose(1, 2)
    keys = torch.randn(keys_length, batch, width, generator=generator, dtype=torch.float64).transpose(0, 1)
    support = torch.randint(-1, keys_length, (batch, length, entries), generator=generator)
    support[1, 4] = -1  # a row with no key
    support[2, 7, :2] = 5  # one key read twice (once where a row has one entry)
    gain = torch.rand(batch, per_group, length, generator=generator, dtype=torch.float64).transpose(1, 2)
    return tuple(t.to(DEVICE) for t in (q, keys, support, gain))


@needs_kernels
@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("shape", [dict(), dict(per_group=1, width=64, entries=16), dict(width=5, entries=1)])
def test_the_gathered_softmax_kernel_equals_its_reference(with_gain, shape):
    q, keys, support, gain = _softmax_inputs(**shape)
    probe = torch.randn(*support.shape[:2], q.shape[2], support.shape[-1], dtype=torch.float64,
                        generator=torch.Generator().manual_seed(5)).to(DEVICE)
    results = []
    for softmax in (gathered_softmax_reference, lambda *args: gathered_softmax(*args, backend="triton")):
        leaves = [t.clone().requires_grad_() for t in ((q, keys, gain) if with_gain else (q, keys))]
        weights = softmax(leaves[0], leaves[1], support, 0.4, leaves[2] if with_gain else None)
        results.append((weights, *torch.autograd.grad((weights * probe).sum(), leaves)))
    for name, expected, actual in zip(("weights", "d q", "d keys", "d gain"), *results):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-13, msg=name)
    assert results[1][0][1, 4].abs().max() == 0  # no key: no weight


@needs_kernels
def test_the_kernel_solves_the_system():
    """(I - B) s = f holds row by row: s_t - sum_k w s[support] = f_t."""
    f, weights, support, _ = _system("pow2_ce", width=40)
    solved = sparse_solve(f, weights, support, backend="triton")
    gathered = solved.gather(1, support.clamp(min=0).flatten(1)[..., None].expand(-1, -1, f.shape[-1])).view(
        *support.shape, -1)
    residual = solved - (weights[..., None] * gathered * (support >= 0)[..., None]).sum(2)
    torch.testing.assert_close(residual, f, rtol=1e-12, atol=1e-12)


@needs_kernels
def test_the_solve_is_a_pipeline_of_a_program_a_chunk(monkeypatch):
    """A program per (batch row, column block, chunk) each way, not one per batch row walking its rows: 3 rows x 2
    blocks x 5 chunks of 16 here."""
    from hf_mixers.kernels import sparse_solve_triton as sst

    grids = {}
    for kernel in (sst._solve_fwd, sst._solve_bwd):
        monkeypatch.setattr(kernel, "run", lambda *args, _kernel=kernel, _run=kernel.run, **kwargs: (
            grids.__setitem__(_kernel.fn.__name__, kwargs["grid"]), _run(*args, **kwargs))[1])
    f, weights, support, _ = _system("pow2_ce", length=70, width=80)
    f, weights = f.requires_grad_(), weights.requires_grad_()
    sparse_solve(f, weights, support, backend="triton").sum().backward()
    assert sst.CHUNK == 16 and grids == {"_solve_fwd": (30,), "_solve_bwd": (30,)}


@interpreter_only  # the interpreter reads the wait's limit when it runs
def test_a_chunk_whose_wait_gives_up_is_nan_not_a_hang(monkeypatch):
    """kernels/pipeline_triton.py: a program waiting for a chunk that is never published gives up after SPIN_LIMIT
    polls and writes NaN (a GPU that never ran an earlier program fails loudly, not by hanging). Here batch row 0's
    progress starts one behind, so each of its chunks waits for a publish that never comes; the other rows solve."""
    from hf_mixers.kernels import pipeline_triton
    from hf_mixers.kernels import sparse_solve_triton as sst

    def one_behind(rows, device):
        counters = pipeline_triton.zeroed_counters(rows, device)
        counters[1] = -1  # after the ticket: batch row 0's progress
        return counters

    monkeypatch.setattr(pipeline_triton, "SPIN_LIMIT", 3)
    monkeypatch.setattr(sst, "zeroed_counters", one_behind)
    f, weights, support, _ = _system("pow2_ce", length=40)
    solved = sparse_solve(f, weights, support, backend="triton")
    assert solved[0].isnan().all()
    torch.testing.assert_close(solved[1:], sparse_solve(f, weights, support, backend="torch")[1:], rtol=1e-12,
                               atol=1e-13)


@interpreter_only  # the counter sees interpreted launches
def test_one_launch_each_way_whatever_the_length():
    counts = []
    for length in (16, 48):
        f, weights, support, _ = _system("pow2_ce", batch=2, length=length)
        f, weights = f.float().requires_grad_(), weights.float().requires_grad_()
        count, _ = count_ops(lambda: sparse_solve(f, weights, support, backend="triton").sum().backward())
        counts.append(count)
    assert counts[0].ops == counts[1].ops and counts[0].triton_launches == 2, [c.top() for c in counts]
    assert counts[0].host_reads == 0


@needs_kernels
@pytest.mark.parametrize("pattern,padded", [("pow2_ce", True), ("banded", True), ("pow2_ce", False),
                                            ("quad_ce", False)])
def test_a_gltm_layer_on_the_kernels_equals_its_pytorch_path(pattern, padded):
    """A GLTM layer in fp64, left-padded (rows looked up per call) or packed (the rows every sequence shares):
    output and every parameter's gradient the same with the gathered softmax and the sparse solve on the kernels and
    on the PyTorch forms."""
    from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings

    results = {}
    for backend in ("torch", "auto"):
        torch.manual_seed(0)
        module, config = build_mixer("gltm", {"gltm_pattern": pattern, "gltm_chunk_size": 8, "kernel_backend": backend},
                                     32, 4, 2, DEVICE, torch.float64)
        x = torch.randn(2, 27, 32, dtype=torch.float64, device=DEVICE, requires_grad=True)
        mask = torch.ones(2, 27, dtype=torch.bool, device=DEVICE)
        mask[0, :6] = False
        out = module(x, rotary_embeddings(config, x, 27), None, mask if padded else None)
        out.pow(2).sum().backward()
        results[backend] = [out.detach(), x.grad] + [p.grad for p in module.parameters() if p.grad is not None]
    for expected, actual in zip(results["torch"], results["auto"], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.variant  # a trace by dynamo and AOTAutograd: the full tier
@needs_kernels
def test_a_gltm_layer_on_the_kernel_is_one_graph_for_torch_compile():
    """GLTM's kernels are torch.library ops, so a GLTM layer's training step on them compiles with
    ``fullgraph=True`` and gives the eager output and input gradient."""
    from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings

    torch.manual_seed(0)
    module, config = build_mixer("gltm", {"gltm_chunk_size": 8, "kernel_backend": "triton"}, 32, 4, 2, DEVICE,
                                 torch.float32)
    x = torch.randn(2, 24, 32, device=DEVICE, requires_grad=True)
    embeddings = rotary_embeddings(config, x, 24)

    check_step_compiles_whole(lambda x: module(x, embeddings), x)

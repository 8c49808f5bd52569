"""Launch budget: how many operator calls one layer's training step issues on the GPU path.

On a GPU an eager step is bound by its launches when the work per op is small (~40 us of host time an op on the lent
H100), so the count is the CPU proxy of the step's speed (hf_mixers/apps/bench/op_count.py: aten calls forward and
backward, views excluded, one per Triton launch). Counted here as ``TRITON_INTERPRET=1`` runs the GPU path, at a
small layout whose op structure is the converted model's (4 levels; chunks of 16 in place of 64). The Triton
launches are counted, not run (``run_kernels=False``): nothing on the host reads their values, so the count is the
same, and the kernels' values are the business of their own tests.

No mixer's step reads a value back to the host (each a stall of the GPU's queue), packed or padded.

The ceilings are today's counts, so that a change which adds launches fails here. RSA with its local window meets
issue 67's target of at most 300 a layer-step; its goal, 100, needs each level's chain and write as one op whose
backward accumulates in place (autograd's adds between them), and the stacking between levels fused.
"""

import pytest
import torch

from triton_interpreter import DEVICE, needs_kernels, run_under_interpreter

from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings
from hf_mixers.apps.bench.op_count import _is_free, count_ops, training_step_ops
from hf_mixers.core.registry import get_mixer, list_mixers

HIDDEN, HEADS, KV_HEADS = 64, 4, 2
RSA = {"rsa_readout": "softmax_count", "rsa_chunk_size": 16, "rsa_num_slots": 16, "kernel_backend": "triton"}


@pytest.mark.variant  # ~75 s of interpreted kernels: the full tier (make test) only
@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


def step_ops(mixer, options, length, library_kernels=False, run_kernels=False):
    torch.manual_seed(0)
    module, config = build_mixer(mixer, options, HIDDEN, HEADS, KV_HEADS, DEVICE, torch.float32)
    x = torch.randn(1, length, HIDDEN, device=DEVICE, requires_grad=True)
    return training_step_ops(module, x, rotary_embeddings(config, x, length), library_kernels=library_kernels,
                             run_kernels=run_kernels)


@needs_kernels
def test_launches_counted_without_running_them_count_the_same():
    """``run_kernels=False`` (every test here) counts what running the kernels counts: op by op, for RSA with its
    window (every RSA kernel, flex and the combine kernel) and for Sessa."""
    rsa = {**RSA, "rsa_window": 16}
    for mixer, options in (("rsa", rsa), ("sessa", {"sessa_chunk_size": 16, "kernel_backend": "triton"})):
        run, counted = (step_ops(mixer, options, 48, library_kernels=True, run_kernels=flag) for flag in (True, False))
        assert run.by_name == counted.by_name and run.host_reads == counted.host_reads == 0, (run.top(), counted.top())


def test_the_counter_counts_launches_not_views():
    """A view is free, a kernel is one, a host read is counted as one and as a host read."""
    x = torch.randn(4, 4)
    count, _ = count_ops(lambda: (x.t().unsqueeze(0)[:, 1:] + 1).sum().item())  # add, sum, item
    assert (count.ops, count.host_reads) == (3, 1), count.by_name
    # aten's contiguous is marked a view, and below autograd (inside our kernels' ops) the counter sees it whole, not
    # as the clone it becomes above: free on a contiguous tensor, a copy (counted) on another
    contiguous = torch.ops.aten.contiguous.default
    assert contiguous.is_view and _is_free(contiguous, (x,)) and not _is_free(contiguous, (x.t(),))


@needs_kernels
def test_rsa_step_launches_do_not_grow_with_the_sequence():
    """The RSA memory's training step (chain kernel per level, the rest over all chunks, the Triton read) issues the
    same ops at 3 and 5 chunks: no loop over chunks on the host (the chunk-by-chunk write grew by ~324 an extra
    chunk at SmolLM2's layout)."""
    short, long = step_ops("rsa", RSA, 48), step_ops("rsa", RSA, 80)  # 3 and 5 chunks
    assert short.ops == long.ops, (short.top(), long.top())
    # per level (4) the chain forward and backward, and the rest of its write: forward its sums then its residuals,
    # backward its boundaries then its rows (a running sum over the boundaries between each: parallel over chunks,
    # not one program a KV head); between levels (3) the residual MLPs, forward and backward; the read forward (2:
    # the weights, then the values), its backward (8: every level's sums, the upper levels' relation routing, each
    # level's rows from them and what the forward saved, the query side, the keys); RoPE, forward and backward
    assert short.triton_launches == 4 * 2 + 4 * 4 + 3 * 2 + 2 + 8 + 2
    assert short.by_name["triton:_triton_rope"] == 2
    assert short.ops <= 161, short.top()  # issue 67's target, at most 300, met with the window too; goal 100
    assert short.host_reads == 0, short.top()  # a fresh state's buffer is laid out from the shapes (ChunkLayout.of)


@needs_kernels
def test_rsa_window_step_takes_flex_attention_as_one_launch_each_way():
    """RSA with its local window, as converted (w = 64 at SmolLM2's layout; 16 here): the window's attention is one
    flex_attention launch forward and one backward (counted through its CPU stand-in, as on a GPU), and the count
    does not grow with T."""
    options = {**RSA, "rsa_window": 16}
    short = step_ops("rsa", options, 48, library_kernels=True)  # 3 and 5 chunks, both longer than the window
    long = step_ops("rsa", options, 80, library_kernels=True)
    assert short.ops == long.ops, (short.top(), long.top())
    assert short.by_name["library:flex_attention"] == 2
    assert short.by_name["triton:_combine_fwd"] == short.by_name["triton:_combine_bwd"] == 1  # their shared normaliser
    assert short.ops <= 184, short.top()  # the memory's and the window's: issue 67's target (300) met


@needs_kernels
def test_sessa_step_meets_the_budget_and_is_flat():
    """Sessa on its feedback-solve kernels (kernels/feedback_solve_triton.py): the solve one launch forward and three
    backward (the lam pipeline, dq, dk) whatever T, RoPE one each way (Liger's kernel); within issue 67's budget of
    120 a layer."""
    options = {**get_mixer("sessa").conversion_options, "sessa_chunk_size": 16, "kernel_backend": "triton"}
    short, long = step_ops("sessa", options, 48), step_ops("sessa", options, 96)
    assert short.triton_launches == 4 + 2 and short.ops == long.ops, (short.top(), long.top())
    assert short.ops <= 54 and short.host_reads == 0, short.top()  # the budget: 120


@needs_kernels
def test_selective_ssm_step_on_flash_linear_attention_meets_the_budget():
    """The selective SSM as converted (Mamba-2's SSD): with fla's chunk_simple_gla as the scan (one launch each way,
    counted through its CPU stand-in) the step is within issue 67's budget of 150 a layer and flat in T; on the
    PyTorch path the chunked scan grows with the chunks."""
    short = step_ops("selective_ssm", {}, 64, library_kernels=True)
    long = step_ops("selective_ssm", {}, 256, library_kernels=True)
    assert short.by_name["library:chunk_simple_gla"] == 2
    assert short.ops == long.ops and short.ops <= 142, (short.ops, long.ops, short.top())  # the budget: 150


@needs_kernels
def test_vort_step_as_converted_meets_the_budget():
    """VORT as converted (Hedgehog features, the shared normaliser, the SOE power law): flex_attention for the window
    and fla's chunk_simple_gla for the retention (one launch each way each, through their CPU stand-ins), our
    kernels for the per-token write weights, the Hedgehog maps, the normalised read, the window's entropy and the
    two reads' shared normaliser: within issue 67's budget of 150 a layer and flat in T."""
    from hf_mixers.core.registry import get_mixer

    options = {**get_mixer("vort").conversion_options, "vort_window": 16}
    short = step_ops("vort", options, 48, library_kernels=True)
    long = step_ops("vort", options, 80, library_kernels=True)
    assert short.by_name["library:flex_attention"] == short.by_name["library:chunk_simple_gla"] == 2
    for kernel in ("weights", "hedgehog", "read", "entropy", "combine"):
        assert short.by_name[f"triton:_{kernel}_fwd"] == short.by_name[f"triton:_{kernel}_bwd"] == 1, kernel
    assert short.ops == long.ops and short.ops <= 104, (short.ops, long.ops, short.top())  # the budget: 150


# every converted-to mixer with each of its optional branches (the contract suite's variants), left-padded (the mask's
# path, the one with more to read back); packed (no mask) for each mixer's base configuration
VARIANTS = [(spec.name, variant, {**spec.conversion_options, **spec.tiny_options, **options}, padded)
            for spec in list_mixers(convertible=True) if not spec.is_teacher_attention
            for variant, options in {"": {}, **spec.tiny_variants}.items()
            for padded in ((False, True) if not variant else (True,))]


@needs_kernels
@pytest.mark.parametrize("mixer,variant,options,padded", VARIANTS,
                         ids=[(f"{m}[{v}]" if v else m) + ("-left_padded" if p else "-packed")
                              for m, v, _, p in VARIANTS])
def test_a_training_step_reads_nothing_back_to_the_host(mixer, variant, options, padded):
    """A host read (``.item()``, ``bool(tensor)``, a data-dependent shape) waits for the GPU's queue to drain, so a
    training step has none: sizes come from the shapes, and checks that need the data run only in the debug mode
    (``HF_MIXERS_DEBUG=1``)."""
    torch.manual_seed(0)
    module, config = build_mixer(mixer, options, 32, 4, 2, DEVICE, torch.float32)
    x = torch.randn(2, 16, 32, device=DEVICE, requires_grad=True)  # several chunks of the tiny options' sizes
    token_mask = None
    if padded:
        token_mask = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
        token_mask[0, :5] = False
    embeddings = rotary_embeddings(config, x, 16)
    count, _ = count_ops(lambda: module(x, embeddings, None, token_mask).float().pow(2).mean().backward(),
                         run_kernels=False)
    assert count.host_reads == 0, dict(count.read_sites)


@needs_kernels
def test_gltm_step_meets_the_budget_and_is_flat():
    """GLTM with its default pattern (pow2_ce): the A-branch is one flex_attention launch each way over the rows every
    sequence shares (built once a length), the B-branch's gathered softmax and the sparse solve one Triton launch
    each way (kernels/sparse_attention_triton.py, kernels/sparse_solve_triton.py); what remains is the projections,
    RoPE and the gate (and the solve pipeline's zeroed counters each way). Within issue 67's budget of 150 a layer,
    and flat in T (the chunked solve grew by ~40 ops a chunk)."""
    options = {"kernel_backend": "triton"}
    short, long = step_ops("gltm", options, 32, True), step_ops("gltm", options, 64, True)
    assert short.by_name["library:flex_attention"] == 2
    assert short.by_name["triton:_softmax_fwd"] == short.by_name["triton:_softmax_bwd"] == 1
    assert short.by_name["triton:_solve_fwd"] == short.by_name["triton:_solve_bwd"] == 1
    assert short.ops == long.ops and short.ops <= 83, (short.ops, long.ops, short.top())  # the budget: 150

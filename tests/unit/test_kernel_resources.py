"""scripts/kernel_resources.py: a launch compiled for a GPU target on this CPU, its shared memory read, nothing run."""

import importlib.util
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _compiling_tool(monkeypatch):
    """scripts/kernel_resources.py loaded, every Triton launch from now on compiled for sm_90 instead of run: (the
    tool, the list its records go to). Skips under TRITON_INTERPRET=1, where kernels are interpreted."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(tl.zeros, InterpretedFunction):
        pytest.skip("under TRITON_INTERPRET=1 kernels are interpreted, not compiled")
    spec = importlib.util.spec_from_file_location("kernel_resources", ROOT / "scripts" / "kernel_resources.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    records = []
    monkeypatch.setattr(JITFunction, "run", tool.compiling_run(90, records, set()))
    return tool, records


def test_a_launch_is_compiled_for_sm90_and_its_shared_memory_read(monkeypatch):
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(tl.zeros, InterpretedFunction):
        pytest.skip("under TRITON_INTERPRET=1 kernels are interpreted, not compiled")
    spec = importlib.util.spec_from_file_location("kernel_resources", ROOT / "scripts" / "kernel_resources.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    @triton.jit
    def square_tile(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        rows = tl.arange(0, BLOCK)
        tile = tl.load(x_ptr + rows[:, None] * BLOCK + rows[None, :], mask=rows[:, None] < n, other=0.0)
        tl.store(out_ptr + rows[:, None] * BLOCK + rows[None, :], tl.dot(tile, tile))

    records, seen = [], set()
    monkeypatch.setattr(JITFunction, "run", tool.compiling_run(90, records, seen))
    x = torch.ones(32, 32)
    for _ in range(2):  # the second launch of the same variant is not compiled again
        square_tile[(1,)](x, torch.empty_like(x), 32, BLOCK=32, num_warps=4)
    assert len(records) == 1, records
    record = records[0]
    assert record["kernel"] == "square_tile" and record["arch"] == 90 and record["constexprs"] == {"BLOCK": 32}
    assert record["options"] == {"num_warps": 4} and 0 < record["shared_bytes"] <= tool.SHARED_LIMIT[90]
    assert record["programs"] == 1  # the grid (1,)
    assert record["fits"] is True


def test_a_launch_is_compiled_with_the_specialisation_a_real_launch_gets(monkeypatch):
    """A GPU launch compiles a kernel knowing which pointers are 16-byte aligned and which integers divide by 16
    (``do_not_specialize`` aside), and vectorises its loads and stores by it, which changes its registers: the tool
    compiles with the same attributes, a variant for each specialisation."""
    import triton.language as tl

    tool, records = _compiling_tool(monkeypatch)
    sources = []
    compile_ = triton.compile
    monkeypatch.setattr(triton, "compile",
                        lambda source, **kwargs: sources.append(source) or compile_(source, **kwargs))

    @triton.jit(do_not_specialize=["m"])
    def copy(x_ptr, out_ptr, n, m, BLOCK: tl.constexpr):
        at = tl.arange(0, BLOCK)
        tl.store(out_ptr + at, tl.load(x_ptr + at, mask=at < n + m))

    x = torch.ones(64)
    for n in (64, 63, 64):  # divisible by 16, not, and the first variant again (not compiled twice)
        copy[(1,)](x, torch.empty_like(x), n, 64, BLOCK=64)
    assert [record["kernel"] for record in records] == ["copy", "copy"], records
    divisible = [{source.fn.arg_names[path[0]] for path, attr in source.attrs.items()
                  if ["tt.divisibility", 16] in attr} for source in sources]
    assert divisible == [{"x_ptr", "out_ptr", "n"}, {"x_ptr", "out_ptr"}], divisible  # m: do_not_specialize


@pytest.mark.parametrize("width", [64, 128], ids=["smollm2-135m", "llama3-8b"])
def test_the_residual_mlp_kernels_fit_sm90_registers_without_a_spill(monkeypatch, width):
    """Issue 67's register budget, read from the sm_90 cubins of RSA's residual MLP kernels at both head widths: at
    most 168 registers a thread at 4 warps and no spill (RSA's read kernels do not fit yet: docs/benchmarks.md)."""
    from hf_mixers.kernels import rsa_mlp_triton
    from hf_mixers.kernels.rsa_state import ResidualMLPWeights

    _, records = _compiling_tool(monkeypatch)
    mlp = lambda: ResidualMLPWeights(*(torch.zeros(*shape, requires_grad=True)  # noqa: E731
                                       for shape in ((width, width), (width,), (width, width), (width,))))
    x, y = (torch.zeros(1, 3, 64, width, requires_grad=True) for _ in range(2))
    try:  # the launches are compiled, not run: what they return is never used
        out_x, out_y = rsa_mlp_triton.residual_mlps_triton(mlp(), mlp(), x, y)
        (out_x.sum() + out_y.sum()).backward()
    except RuntimeError:
        pass
    usage = {record["kernel"]: (record["options"]["num_warps"], record["registers"], record["spill_bytes"])
             for record in records}
    assert usage.keys() == {"_mlp_fwd", "_mlp_bwd"}, records
    for kernel, (warps, registers, spill) in usage.items():
        assert warps == 4 and registers <= 168 and spill == 0, (kernel, usage)


@pytest.mark.variant  # six sm_90 compiles a layout: the full tier
@pytest.mark.parametrize("groups,head_dim", [(3, 64), (8, 128)], ids=["smollm2-135m", "llama3-8b"])
def test_the_rsa_level_forward_kernels_fit_sm90_and_fill_its_sms_at_2k(monkeypatch, groups, head_dim):
    """The rest of an RSA level's write, forward (kernels/rsa_chain_triton.py: every chunk's sums, then every chunk's
    residuals and the state's references), at the mixer's default slots and chunk size, 2K tokens, batch 1: at most
    168 registers a thread at 4 warps, no spill, and at least one program for each of an H100's 132 SMs in each
    launch, at both head layouts, level 0 and a deeper level (relation sums). (The last level, with no residual to
    write, launches the residuals kernel for the state's references alone: a program a KV head and column block.)
    fp32-accurate and tf32 dots alike."""
    from hf_mixers.core.registry import get_mixer
    from hf_mixers.kernels.rsa_chain_triton import _level_forward

    _, records = _compiling_tool(monkeypatch)
    defaults = {option.name: option.default for option in get_mixer("rsa").options}
    slots, chunk, length = defaults["rsa_num_slots"], defaults["rsa_chunk_size"], 2048
    boundaries = length // chunk + 1
    zeros = lambda *size: torch.zeros(*size)  # noqa: E731
    f, x = zeros(1, groups, length, slots), zeros(1, groups, length, head_dim)
    for relation in (False, True):
        for precision in ("tf32x3", "tf32"):  # an fp32 call's dots, a bf16 / fp16 call's
            _level_forward(f, None, x, x, zeros(1, length), zeros(1, groups, boundaries, slots, head_dim),
                           zeros(1, groups, boundaries, slots), *(zeros(1, groups, slots, head_dim),) * 3,
                           zeros(groups, slots, head_dim), zeros(groups), f if relation else None,
                           zeros(1, groups, slots, slots) if relation else None,
                           torch.full((1,), boundaries - 1, dtype=torch.int32), chunk, 1e-6, precision)
    usage = {(record["kernel"], record["constexprs"].get("RELATION"), record["constexprs"]["PRECISION"]): (
        record["options"]["num_warps"], record["registers"], record["spill_bytes"], record["programs"])
        for record in records}
    assert usage.keys() == {(kernel, relation, precision) for kernel, relation in (
        ("_level_sums_fwd", False), ("_level_sums_fwd", True), ("_level_residuals_fwd", None))
        for precision in ("tf32x3", "tf32")}, records
    for kernel, (warps, registers, spill, programs) in usage.items():
        assert warps == 4 and registers <= 168 and spill == 0 and programs >= 132, (kernel, usage)


@pytest.mark.variant  # six sm_90 compiles a layout: the full tier
@pytest.mark.parametrize("groups,head_dim", [(3, 64), (8, 128)], ids=["smollm2-135m", "llama3-8b"])
def test_the_rsa_level_backward_kernels_of_a_bf16_call_fit_sm90(monkeypatch, groups, head_dim):
    """The level's backward (kernels/rsa_chain_triton.py: every boundary's reference gradients, then every chunk's
    row blocks), as a bf16 / fp16 call launches it (tf32 dots), at the mixer's default slots and chunk size, 2K
    tokens, batch 1, level 0 and a deeper level (relation sums): at most 168 registers a thread at 4 warps and no
    spill; at least one program for each of an H100's 132 SMs in each launch (a program a boundary and column
    block, then a program a row block of every chunk)."""
    from hf_mixers.core.registry import get_mixer
    from hf_mixers.kernels.rsa_chain_triton import _level_forward

    _, records = _compiling_tool(monkeypatch)
    defaults = {option.name: option.default for option in get_mixer("rsa").options}
    slots, chunk, length = defaults["rsa_num_slots"], defaults["rsa_chunk_size"], 2048
    boundaries = length // chunk + 1
    leaf = lambda *size: torch.zeros(*size, requires_grad=True)  # noqa: E731
    for relation in (False, True):
        f = leaf(1, groups, length, slots)
        try:  # the launches are compiled, not run: what they return is never used
            outputs = _level_forward(f, None, leaf(1, groups, length, head_dim), leaf(1, groups, length, head_dim),
                                     torch.ones(1, length), leaf(1, groups, boundaries, slots, head_dim),
                                     leaf(1, groups, boundaries, slots), *(leaf(1, groups, slots, head_dim),) * 3,
                                     leaf(groups, slots, head_dim), leaf(groups), f if relation else None,
                                     leaf(1, groups, slots, slots) if relation else None,
                                     torch.full((1,), boundaries - 1, dtype=torch.int32), chunk, 1e-6, "tf32")
            sum(out.sum() for out in outputs).backward()
        except RuntimeError:
            pass
    usage = {(record["kernel"], record["constexprs"]["RELATION"]): (
        record["options"]["num_warps"], record["registers"], record["spill_bytes"], record["programs"],
        record["constexprs"]["PRECISION"]) for record in records if record["kernel"].endswith("_bwd")}
    assert usage.keys() == {(kernel, relation) for kernel in ("_level_boundaries_bwd", "_level_rows_bwd")
                            for relation in (False, True)}, records
    for kernel, (warps, registers, spill, programs, precision) in usage.items():
        assert warps == 4 and registers <= 168 and spill == 0 and programs >= 132 and precision == "tf32", (kernel,
                                                                                                          usage)


@pytest.mark.variant  # two sm_90 compiles a layout: the full tier
@pytest.mark.parametrize("groups,head_dim", [(3, 64), (8, 128)], ids=["smollm2-135m", "llama3-8b"])
def test_the_rsa_chain_kernels_of_a_bf16_call_fit_sm90(monkeypatch, groups, head_dim):
    """RSA's assignment chain (kernels/rsa_chain_triton.py), forward and backward, as a bf16 / fp16 call launches it
    (tf32 dots: ``conventions.dot_precision``), at the mixer's default slots and chunk size and both head layouts: at
    most 168 registers a thread at 4 warps and no spill. (Its grid is the recurrence's, a program per KV head and
    batch row: docs/benchmarks.md.)"""
    from hf_mixers.core.registry import get_mixer
    from hf_mixers.kernels.rsa_chain_triton import _chain_forward

    _, records = _compiling_tool(monkeypatch)
    defaults = {option.name: option.default for option in get_mixer("rsa").options}
    slots, chunk, length = defaults["rsa_num_slots"], defaults["rsa_chunk_size"], 256
    leaf = lambda *size: torch.zeros(*size, requires_grad=True)  # noqa: E731
    try:  # the launches are compiled, not run: what they return is never used
        f, sums, masses = _chain_forward(leaf(1, groups, length, head_dim), torch.ones(1, length),
                                         leaf(1, groups, slots, head_dim), leaf(1, groups, slots),
                                         leaf(1, groups, slots, head_dim), leaf(groups, slots, head_dim), leaf(groups),
                                         leaf(groups), torch.full((1,), length // chunk, dtype=torch.int32), False,
                                         chunk, 1e-6, "tf32")
        (f.sum() + sums.sum() + masses.sum()).backward()
    except RuntimeError:
        pass
    usage = {record["kernel"]: (record["options"]["num_warps"], record["registers"], record["spill_bytes"],
                                record["constexprs"]["PRECISION"]) for record in records}
    assert usage.keys() == {"_chain_fwd", "_chain_bwd"}, records
    for kernel, (warps, registers, spill, precision) in usage.items():
        assert warps == 4 and registers <= 168 and spill == 0 and precision == "tf32", (kernel, usage)


@pytest.mark.variant  # an sm_90 compile a layout: the full tier
@pytest.mark.parametrize("heads,groups,head_dim", [(9, 3, 64), (32, 8, 128)], ids=["smollm2-135m", "llama3-8b"])
def test_the_rsa_read_compiles_for_sm90_without_a_spill(monkeypatch, heads, groups, head_dim):
    """RSA's read (kernels/rsa_chunk_triton.py) at the mixer's default levels, slots, chunk size, readout and routing,
    with the window's log weight, in a bf16 call, at both head layouts and 2K tokens: the forward's two kernels
    within issue 67's budget (128 registers at 8 warps, no spill, a program per SM at least); of the backward's, its
    level kernel without a spill (still over the budget: docs/benchmarks.md), the others within it."""
    from hf_mixers.core.registry import get_mixer
    from hf_mixers.kernels.rsa_chunk_triton import READ_WARPS, _Read

    _, records = _compiling_tool(monkeypatch)
    defaults = {option.name: option.default for option in get_mixer("rsa").options}
    levels, slots, chunk = defaults["rsa_num_levels"], defaults["rsa_num_slots"], defaults["rsa_chunk_size"]
    length, n_chunks = 2048, 2048 // chunk
    per_head = lambda *size: torch.empty(heads, levels, *size)  # noqa: E731
    # q; F, X, Y; KS0, VS0, n0, R0; kappa; W, W_r, theta, w_a and the RSA-q weights' dummy (_kernel_inputs' order)
    inputs = [torch.empty(1, heads, length, head_dim), *(torch.empty(1, groups, levels, length, size)
                                                         for size in (slots, head_dim, head_dim)),
              torch.empty(1, groups, n_chunks, levels, slots, head_dim),
              torch.empty(1, groups, n_chunks, levels, slots, head_dim), torch.empty(1, groups, n_chunks, levels, slots),
              torch.empty(1, groups, n_chunks, levels - 1, slots, slots), torch.empty(groups, levels),
              per_head(slots, slots), per_head(slots, slots), per_head(), per_head(), per_head()]
    # a bf16 / fp16 call's, as a training step launches it: the read weights' dots tf32 (``conventions.dot_precision``)
    options = (chunk, defaults["rsa_eps"], defaults["rsa_threshold_max"], defaults["rsa_readout"],
               defaults["rsa_routing"], False, True, "tf32")
    read = _Read(options, inputs[0], inputs[1], inputs[3])
    saved = read.forward(inputs, save=True)[1:]  # compiled, not run: the chains, num and den it saves
    forward = {record["kernel"]: record for record in records}
    assert forward.keys() == {"_weights_kernel", "_values_kernel"}, records
    for record in forward.values():  # within the budget: 128 registers at 8 warps
        assert record["options"]["num_warps"] == READ_WARPS == 8 and record["registers"] <= 128, record
        assert record["spill_bytes"] == 0 and record["programs"] >= 132, record
    # the backward: the sums (every level), the relation routing (the upper levels), the level kernel (level 0's
    # variant and the others'), the query side, the keys
    read.backward(inputs, torch.empty(1, heads, length, head_dim + 1), *saved)
    backward = [record for record in records if record["kernel"] not in forward]
    assert [record["kernel"] for record in backward] == ["_bwd_sums_kernel", "_bwd_routing_kernel", "_bwd_level_kernel",
                                                         "_bwd_level_kernel", "_bwd_query_kernel",
                                                         "_bwd_keys_kernel"], backward
    for record in backward:  # no spill, a program per SM at least; all but the level kernel within the budget
        assert record["options"]["num_warps"] == 8 and record["spill_bytes"] == 0, record
        assert record["programs"] >= 132 and (record["kernel"] == "_bwd_level_kernel" or record["registers"] <= 128)


@pytest.mark.variant  # ten sm_90 compiles a layout where Triton's cache is cold (CI): the full tier
@pytest.mark.parametrize("shape", ["smollm2-135m", "llama3-8b"])
def test_the_vort_and_window_kernels_fit_sm90_registers_without_a_spill(monkeypatch, shape):
    """Issue 67's register budget, read from the sm_90 cubins of VORT's kernels (write weights, Hedgehog maps,
    normalised read) and the window's (the flex read's entropy, the shared combine) at both head layouts: at most 168
    registers a thread at 4 warps and no spill, forward and backward."""
    from hf_mixers.apps.bench.kernels import SHAPES

    tool, records = _compiling_tool(monkeypatch)
    monkeypatch.setattr("hf_mixers.kernels.dispatch.triton_unavailable", lambda device: None)  # compiled, never run
    tool.run_vort_kernels(SHAPES[shape], 64)
    usage = {record["kernel"]: (record["options"]["num_warps"], record["registers"], record["spill_bytes"])
             for record in records}
    kernels = {f"_{name}_{way}" for name in ("weights", "hedgehog", "read", "entropy", "combine")
               for way in ("fwd", "bwd")}
    assert usage.keys() == kernels, records
    for kernel, (warps, registers, spill) in usage.items():
        assert warps == 4 and registers <= 168 and spill == 0, (kernel, usage)


@pytest.mark.variant  # four sm_90 compiles a layout: the full tier
@pytest.mark.parametrize("shape", ["smollm2-135m", "llama3-8b"])
def test_the_gltm_kernels_fit_sm90_registers_without_a_spill(monkeypatch, shape):
    """Issue 67's register budget for GLTM's gathered softmax and sparse solve, forward and backward, at both head
    layouts: at most 168 registers a thread at 4 warps and no spill."""
    from hf_mixers.apps.bench.kernels import SHAPES

    tool, records = _compiling_tool(monkeypatch)
    monkeypatch.setattr("hf_mixers.kernels.dispatch.triton_unavailable", lambda device: None)  # compiled, never run
    tool.run_gltm_kernels(SHAPES[shape], 64)
    usage = {record["kernel"]: (record["options"]["num_warps"], record["registers"], record["spill_bytes"])
             for record in records}
    assert usage.keys() == {"_softmax_fwd", "_softmax_bwd", "_solve_fwd", "_solve_bwd"}, records
    for kernel, (warps, registers, spill) in usage.items():
        assert warps == 4 and registers <= 168 and spill == 0, (kernel, usage)


@pytest.mark.variant  # four sm_90 compiles a layout: the full tier
@pytest.mark.parametrize("rows,width,key_dim", [(9, 64, 64), (32, 128, 128), (1, 576, 576)],
                         ids=["smollm2-135m", "llama3-8b", "one-576-wide-head"])
def test_the_sessa_kernels_fit_sm90_registers_without_a_spill(monkeypatch, rows, width, key_dim):
    """Issue 67's register budget for the solve's four kernels in a bf16 training call (tf32 dots) at the mixer's
    default ``sessa_chunk_size``: at most 168 registers a thread at 4 warps, no spill, and an sm_90 block's shared
    memory, at SmolLM2's and Llama-3-8B's head layouts and the official conversion's one feedback head (keys and rows
    576 wide, in blocks). The pipeline takes chunks of at most MAX_CHUNK rows whatever the chunk size asked."""
    from hf_mixers.core.registry import get_mixer
    from hf_mixers.kernels.feedback_solve import feedback_solve
    from hf_mixers.kernels.feedback_solve_triton import MAX_CHUNK

    tool, records = _compiling_tool(monkeypatch)
    monkeypatch.setattr("hf_mixers.kernels.dispatch.triton_unavailable", lambda device: None)  # compiled, never run
    chunk_size = next(option.default for option in get_mixer("sessa").options if option.name == "sessa_chunk_size")
    assert chunk_size > MAX_CHUNK
    leaf = lambda *size: torch.randn(*size).to(torch.bfloat16).requires_grad_()  # noqa: E731
    feedback_solve(leaf(rows, 256, width), leaf(rows, 256, key_dim), leaf(rows, 256, key_dim), leaf(rows, 256),
                   method="chunked", chunk_size=chunk_size, backend="triton").sum().backward()
    usage = {record["kernel"]: (record["options"]["num_warps"], record["registers"], record["spill_bytes"],
                                record["constexprs"]["PRECISION"]) for record in records}
    assert usage.keys() == {"_fwd_kernel", "_bwd_lam_kernel", "_bwd_dq_kernel", "_bwd_dk_kernel"}, records
    assert all(record["fits"] and record["constexprs"].get("BLOCK_C", MAX_CHUNK) <= MAX_CHUNK for record in records), \
        records
    for kernel, (warps, registers, spill, precision) in usage.items():
        assert warps == 4 and registers <= 168 and spill == 0 and precision == "tf32", (kernel, usage)

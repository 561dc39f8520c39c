"""What inductor generates for a compiled function, read as text: the kernels one call runs.

    codes = compiled_code(step, ids)          # the generated modules of one call
    kernel_counts(codes)                      # {"fused": n, "extern_kernels.addmm": m, ...}
    with triton_partition():                  # as a GPU would partition it, on this CPU
        codes = compiled_code(step, ids)
    with generated_code() as codes:           # whatever compiles inside, nothing reset
        step(ids)

Used by ``profile_step.py --ops --compiled``, by ``gpu_check.py`` (the real CUDA kernels of
the compiled decoding steps) and by the decoding-kernel tests.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from unittest import mock

import torch


def compiled_code(step, *inputs: torch.Tensor | None) -> list[str]:
    """The code inductor generates for one call of a compiled decoding step, compiled anew
    (dynamo reset first; the call runs: it is a real step, unless inside
    ``triton_partition``)."""
    torch._dynamo.reset()
    with torch.inference_mode(), generated_code() as codes:
        step(*inputs)
    return codes


@contextlib.contextmanager
def generated_code() -> Iterator[list[str]]:
    """The modules inductor generates while inside (a graph loaded from its cache reports
    its code too), appended to the list it yields as they are made. Unlike
    ``run_and_get_code`` it keeps what dynamo compiled before."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


@contextlib.contextmanager
def triton_partition():
    """Inductor writes Triton kernels for CPU tensors, as it does for a GPU, without
    compiling or running them: the graph partitioned into the kernels a GPU launches (one
    reduction and what fuses with it per kernel), counted on a machine that has none.

    Inside, a compiled call runs its generated wrapper with every Triton kernel a no-op: its
    outputs are meaningless (count, don't compare), library calls (``extern_kernels.*``)
    still run. The kernels are generated for an sm_90 target (the triton wheel's driver
    finds no GPU here, so one is named); nothing is compiled for it. What was compiled
    inside is dropped on the way out (dynamo reset), so no later call runs no-op kernels."""
    import torch._inductor.async_compile as async_compile
    import torch.utils._triton as torch_triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Target:  # what inductor asks the active driver while it writes a kernel
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

    class Unrun:
        def __init__(self, name: str) -> None:
            self.name = name

        def run(self, *args, **kwargs) -> None:
            pass

    def unrun(self, name: str, source: str, *args, **kwargs) -> Unrun:
        return Unrun(name)

    with (
        mock.patch.object(driver, "_active", Target()),
        mock.patch.object(torch_triton, "triton_hash_with_backend", lambda: "unrun"),
        mock.patch.object(async_compile.AsyncCompile, "triton", unrun),
        torch._inductor.config.patch(cpu_backend="triton", fx_graph_cache=False),
    ):
        try:
            yield
        finally:
            torch._dynamo.reset()


def kernel_counts(codes: list[str]) -> dict:
    """Kernels one call runs: the calls in the ``call`` function of inductor's generated
    code, by kind (``cpp_fused_*`` kernels, ``extern_kernels.*`` library calls, other aten
    calls)."""
    counts: dict[str, int] = {}
    for code in codes:
        body = code[code.index("def call(") :]
        for line in body.splitlines():
            callee = line.strip().split(" = ")[-1]
            m = re.match(
                r"(cpp_fused|triton_\w+|extern_kernels\.\w+|aten\.\w+|torch\.ops\.\w+)", callee
            )
            if m and "(" in callee:
                kind = (
                    "fused"
                    if m.group(1) in ("cpp_fused",) or m.group(1).startswith("triton")
                    else m.group(1)
                )
                counts[kind] = counts.get(kind, 0) + 1
    return counts


def loop_nests(codes: list[str]) -> int:
    """Outermost loops of the generated C++ kernels, summed. The CPU backend puts any
    number of loop nests into one kernel function (even a whole layer's), where a GPU
    kernel holds one fused loop nest: so the nests are the closer proxy of the kernels the
    same step compiles to on a GPU, together with the library calls (``kernel_counts``)."""
    total = 0
    for code in codes:
        for source in re.findall(r"cpp_pybinding\(\[.*?\], r'''(.*?)'''\)", code, re.S):
            braces: list[bool] = []  # per open brace: whether a loop opened it
            opens_loop = False
            for line in source.splitlines():
                text = line.strip()
                if text.startswith("for("):
                    total += not any(braces)
                    opens_loop = True
                for ch in text:
                    if ch == "{":
                        braces.append(opens_loop)
                        opens_loop = False
                    elif ch == "}":
                        braces.pop()
    return total

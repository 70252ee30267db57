"""Running an AMD vendor's Triton kernels on a CPU host, under Triton's interpreter, on the code
path of a named architecture: what ``mutants --vendor aiter`` needs where there is no AMD GPU.

Three things stand between aiter's Triton MoE kernels and a CPU, each fixed here and nowhere else:

* Triton 3.9's interpreter converts float32 to bfloat16 by truncation (``cast_impl`` and
  ``create_fp_to_fp`` with no rounding mode); every GPU rounds to nearest even. Left alone, the
  interpreted kernel is not the kernel (aiter's a16w4 fails the bound at 1.1-1.3x on small cases
  from this alone). ``round_bf16_to_nearest`` makes that one conversion round to nearest even.
  The project's own portable kernels avoid the cast instead (``kernels/portable_triton_kernels``).
* aiter reads ``triton.runtime.driver.active.get_current_target().arch`` when it is imported to
  pick its code paths; a CPU has no driver. ``import_as`` imports the package with a HIP target of
  the named architecture for that one import.
* The adapters and the engine refuse a host that is not the architecture they run for.
  ``emulate_host`` makes ``harness.contract.platforms.host_arch`` answer that architecture and keeps
  tensors on the CPU. Every record made this way names the architecture *and* says it was
  interpreted on a CPU: it is the code path of that GPU, not its hardware.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def round_bf16_to_nearest() -> None:
    """Make the interpreter's float32 -> bfloat16 conversions round to nearest even (NaN stays a
    quiet NaN). Idempotent."""
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter as ti

    if getattr(ti.InterpreterBuilder, "_mxmoe_rne_bf16", False):
        return

    def rne(data: object) -> object:
        f = np.asarray(data, dtype=np.float32)
        bits = f.view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
            np.uint16
        )
        quiet = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
        return np.where(np.isnan(f), quiet, rounded)

    cast, fp_to_fp = ti.InterpreterBuilder.cast_impl, ti.InterpreterBuilder.create_fp_to_fp

    def cast_impl(self: object, src: object, dst: object) -> object:
        if src.dtype.scalar == tl.float32 and dst.scalar == tl.bfloat16:
            return ti.TensorHandle(rne(src.data), dst.scalar)
        return cast(self, src, dst)

    def create_fp_to_fp(self: object, src: object, dst: object, rounding: object) -> object:
        if src.dtype.scalar == tl.float32 and dst.scalar == tl.bfloat16:
            return ti.TensorHandle(rne(src.data), dst.scalar)
        return fp_to_fp(self, src, dst, rounding)

    ti.InterpreterBuilder.cast_impl = cast_impl
    ti.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    ti.InterpreterBuilder._mxmoe_rne_bf16 = True


def import_as(package: str, arch: str, also: tuple[str, ...] = ()) -> ModuleType:
    """Import ``package`` (and the modules ``also``, those that read the target when imported)
    with Triton's active driver answering a HIP target of ``arch`` (warp size 64) for the
    duration of those imports only; the package."""
    import triton
    from triton.backends.compiler import GPUTarget

    class _Target:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("hip", arch, 64)

    cfg = triton.runtime.driver
    saved = cfg._active
    cfg._active = _Target()
    try:
        mod = importlib.import_module(package)
        for name in also:
            importlib.import_module(name)
        return mod
    finally:
        cfg._active = saved


def emulate_host(arch: str) -> None:
    """Make this process's host architecture ``arch`` with tensors on the CPU (see the module
    docstring: only for kernels running under the interpreter)."""
    from mxmoe.harness.contract import platforms
    from mxmoe.harness.judge import engine

    platforms.host_arch = lambda: arch
    engine.host_arch = lambda: arch
    engine.device_for = lambda _arch: "cpu"

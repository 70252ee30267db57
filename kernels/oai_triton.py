"""TRITON: OpenAI triton_kernels' matmul_ogs with the swiglu fused into GEMM1

Kernel: ``triton_kernels.matmul_ogs`` (v3.5.1, the copy vLLM 0.26 vendors and runs; fetched by
``python -m harness fetch triton-kernels`` where neither it nor vLLM is installed, see
``harness.upstream.fetch``), called the way vLLM's GPT-OSS path calls it:

* weights as vLLM's oracle prepares them: w13 rows interleaved (gate in even columns), the hidden
  size unchanged and the intermediate padded to 64, float32 biases, blocks and scales as
  [E, K, N] views of the [E, N, K] memory (``kernels.storage.transpose``), then triton_kernels'
  own layout conversion: on Hopper HopperMXValueLayout / HopperMXScaleLayout with mx_axis=1,
  ``split_k`` = 1, and the scale groups padded to a multiple of 4 (vLLM's patch for triton-lang
  #47303: with H/32 = 90, gpt-oss's, the kernel read scales out of bounds); on Blackwell its
  default layouts, persistent; on CDNA4 (gfx950, TP <= 2) the CDNA4 scale layout, else strided;
* on SM12x (sm120, consumer Blackwell), what vLLM 0.34.0 does there and only there (0.26.0 does
  not run these kernels on SM12x): the weights as on SM10x (triton_kernels' default layouts,
  which are the Blackwell ones at capability >= 10, and ``is_persistent`` with
  ``epilogue_subtile`` = 1: ``mxfp4_utils._swizzle_mxfp4``'s SM10x/SM12x branch), and before
  each forward's first matmul ``block_m`` pinned to triton_kernels' tokens-per-expert heuristic
  capped at 32 (``gpt_oss_triton_kernels_moe._constrain_sm12x_block_m(M * topk, E)``), to fit
  99 KB of shared memory. Which settings apply is chosen from the host's arch at run time
  (``swizzle_constraints``, ``call_constraints``): on sm90, sm100 and ROCm nothing changed.
  **sm120 has not been run on hardware** (no SM12x GPU was available): the settings are checked
  on a CPU against vLLM 0.34.0's own functions (suites/kernels/test_vendor_adapters.py), not the
  kernels' results;
* GEMM1 with ``FusedActivation(swiglu, (alpha, limit), 2)``: triton_kernels' swiglu computes
  ``s * (up + 1)``, so beta is fixed at 1; GEMM2 scatters with the routing weights as ``gammas``
  and sums the top-k rows (``reduce_grouped``, float32 sum of bfloat16 rows);
* two routing paths, both vLLM's: ``triton`` (vLLM's monolithic ``OAITritonMxfp4ExpertsMonolithic``)
  routes inside triton_kernels from the bfloat16 router logits (``routing()``, or ``topk`` plus
  the expert map under EP); ``triton-modular`` (vLLM's ``OAITritonExperts``) takes the top-k ids
  and float32 weights the engine routed and builds the routing data from them
  (``routing_from_bitmatrix``). Both hand the kernel bfloat16 routing weights.

Precision points (declared below): bf16 x times MXFP4 upcast to bf16, float32 accumulation and
bias, the swiglu in float32, the intermediate stored in bf16; GEMM2's rows, times their routing
weight, stored in bf16 before the float32 top-k sum; the routing weights in bf16.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from mxmoe.harness.contract.backend import Arithmetic, BackendUnavailable, Declaration, Tactic, VendorKernel
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.convert import padded_sizes
from mxmoe.harness.contract.inputs import CaseInputs
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.judge.engine import poisoned
from mxmoe.harness.upstream.fetch import VendorMissing, import_triton_kernels
from mxmoe.kernels import storage
from mxmoe.reference.moe import Precision, round_to
from mxmoe.reference.routing import ROUTING_METHODS

OAI_TRITON_ARCHS = ("sm90", "sm100", "sm120", "gfx942", "gfx950")
"""Where vLLM 0.34.0 runs the OpenAI Triton kernels and these adapters follow it
(``_triton_kernel_moe_supports_current_device``: CUDA 9.0 <= capability < 13.0, ROCm gfx9). sm120
follows vLLM's code only: it has not been run on hardware."""
_BLOCK_M_ARCHS = tuple(a for a in OAI_TRITON_ARCHS if a != "sm120")
TRITON_TACTICS = (
    *(Tactic(f"bm{m}", (("block_m", m),), OAI_TRITON_ARCHS if m <= 32 else _BLOCK_M_ARCHS,
             f"block_m {m}: triton_kernels' heuristic picks max(16, min(next_pow2(tokens per expert), 128)) on "
             "NVIDIA, so every case size meets one of 16..128" + (" (SM12x caps it at 32)" if m <= 32 else ""))
      for m in (16, 32, 64, 128)),
    *(Tactic(f"splitk{k}", (("split_k", k),), OAI_TRITON_ARCHS,
             f"split-K {k}: compute_split_k's pick when the grid is smaller than the GPU (few tokens); vLLM pins "
             "split_k 1 on Hopper only, triton_kernels' other callers do not")
      for k in (2, 4)),
)  # fmt: skip
"""The opt-flag configurations triton_kernels' ``make_opt_flags`` may pick for these calls, each
forced through ``update_opt_flags_constraints`` (``OaiTritonBase.constrained``). Not declared:
``is_persistent`` on Hopper (``InapplicableConstraint`` there: the TMA path it needs is off for
these layouts, measured on an H200) and block_k (picked from K and the dtypes alone, one value per
layer here)."""
SM12X_MAX_BLOCK_M = 32
"""vLLM 0.34.0's ``_SM12X_MAX_BLOCK_M`` (``gpt_oss_triton_kernels_moe``): with block_m >= 64 the
persistent MXFP4 kernel fits one pipeline stage in SM12x's 99 KB of shared memory."""
HOPPER_MIN_N = 129
"""Found on the H200 (triton 3.6.0, triton_kernels v3.5.1): vLLM builds the Hopper scale layout
with num_warps=8, whose kernel asserts BLOCK_N % 256 == 0, but ``compute_block_n`` picks 256
only for N > 128 (else the next power of two up to 128): every GEMM with N <= 128 (a hidden
size, or twice the padded intermediate, of 128 or less) fails to compile. No production shape
is that small; the small CI-size cases are declined on sm90 with this reason."""


def is_sm12x(arch: str) -> bool:
    """vLLM's ``_is_sm12x`` (``is_device_capability_family(120)``) for an arch token: sm120, sm121."""
    return arch.startswith("sm12")


def swizzle_constraints(arch: str) -> dict[str, Any]:
    """The opt-flag constraints vLLM 0.34.0's ``mxfp4_utils._swizzle_mxfp4`` sets on ``arch`` with
    each weight's layout conversion: ``split_k`` = 1 on Hopper (capability 9.0), the persistent
    kernel with ``epilogue_subtile`` = 1 on SM10x and SM12x (``is_device_capability_family(100)``
    or ``(120)``), none elsewhere (ROCm)."""
    if arch == "sm90":
        return {"split_k": 1}
    if arch == "sm100" or is_sm12x(arch):
        return {"is_persistent": True, "epilogue_subtile": 1}
    return {}


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for n >= 1 (without importing triton)."""
    return 1 << (n - 1).bit_length()


def sm12x_block_m(rows: int, experts: int) -> int:
    """vLLM 0.34.0's ``_sm12x_block_m``: triton_kernels' tokens-per-expert block_m heuristic (at
    least 16), capped at SM12X_MAX_BLOCK_M; ``rows`` is tokens x top-k, ``experts`` the local ones."""
    tokens_per_expt = max(1, rows // experts)
    return max(16, min(_next_power_of_2(tokens_per_expt), SM12X_MAX_BLOCK_M))


def call_constraints(arch: str, rows: int, experts: int) -> dict[str, Any]:
    """The opt-flag constraints vLLM 0.34.0 sets before a forward's matmuls on ``arch``
    (``_constrain_sm12x_block_m(M * topk, E)``, in ``triton_kernel_fused_experts`` and
    ``UnfusedOAITritonExperts.apply``): ``block_m`` on SM12x, nothing elsewhere."""
    return {"block_m": sm12x_block_m(rows, experts)} if is_sm12x(arch) else {}


def _load_modules() -> SimpleNamespace:
    """The triton_kernels entry points the adapters call (v3.5.1 API)."""
    tk = import_triton_kernels()
    # Always by the name ``triton_kernels``: vLLM's vendored copy imports itself by that name.
    mods = {
        name: importlib.import_module(f"triton_kernels.{name}")
        for name in ("matmul_ogs", "routing", "topk", "tensor", "numerics", "swiglu")
    }
    layout = importlib.import_module("triton_kernels.tensor_details.layout")
    opt_flags = importlib.import_module("triton_kernels.matmul_ogs_details.opt_flags")
    return SimpleNamespace(**mods, layout=layout, opt_flags=opt_flags, file=tk.__file__)


@dataclass
class Prepared:
    """Weights in triton_kernels' layouts, on the device, and the modules to call."""

    w13: Any
    w2: Any
    pc13: Any
    pc2: Any
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    hidden: int
    experts: int
    tk: SimpleNamespace


class OaiTritonBase(VendorKernel):
    """What the triton_kernels adapters share: loading, the weight layouts, the routing data."""

    package = "triton_kernels"
    pip_name = "none: vLLM vendors it; `python -m harness fetch triton-kernels`"
    kernel = "triton_kernels.matmul_ogs"
    empty_batch = "vLLM never calls the experts with T = 0, and matmul_ogs takes no empty routing"
    storage = (storage.transpose(),)
    routes_in_kernel = False
    """True: triton_kernels routes from the logits (vLLM's monolithic path); False: the engine's
    top-k ids and weights are handed over (vLLM's modular path)."""
    pad_hopper_scales = True
    """vLLM's pad of the scale groups to a multiple of 4 on Hopper (False only to show the bug)."""
    converts_per_layer = True
    """``convert`` reads the weights, the shard and the architecture: one per layer (``Backend``)."""
    _tk: SimpleNamespace | None = None

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; top-k must be a power of two (v3.5.1's routing kernels need one); on
        Hopper both GEMMs need N > 128 (see ``HOPPER_MIN_N``)."""
        d = self.declaration
        reason = super().supports(case, arch)
        if reason is None and case.top_k & (case.top_k - 1):
            return f"{d.id}: triton_kernels v3.5.1 routing needs a power-of-2 top-k, got {case.top_k}"
        if reason is None and arch == "sm90":
            hidden, inter = padded_sizes(case, d.hidden_align, d.intermediate_align)
            small = [f"{g} N = {n}" for g, n in (("GEMM1", 2 * inter), ("GEMM2", hidden)) if n < HOPPER_MIN_N]
            if small:
                return (
                    f"{d.id} on sm90 needs N >= {HOPPER_MIN_N} in both GEMMs ({', '.join(small)}): with vLLM's "
                    "Hopper scale layout (num_warps=8) matmul_ogs fails a compile-time assertion there"
                )
        return reason

    def provenance(self) -> str | None:
        """Where triton_kernels came from (its folder, and the wheel it was taken out of), and the
        triton that compiles it."""
        import triton

        tk = OaiTritonBase._tk
        if tk is None:
            return None
        folder = Path(tk.file).parent
        source = folder / "SOURCE.txt"
        origin = source.read_text().strip() if source.is_file() else "installed"
        return f"triton_kernels at {folder} ({origin}); triton {triton.__version__}"

    def load(self) -> None:
        """Import triton_kernels (installed, vLLM's, or the cached copy), then ``check_call``."""
        if OaiTritonBase._tk is None:
            try:
                OaiTritonBase._tk = _load_modules()
            except VendorMissing as exc:
                raise BackendUnavailable(f"{self.declaration.id}: {exc}") from exc
            except ImportError as exc:
                raise BackendUnavailable(
                    f"{self.declaration.id}: triton_kernels did not import with this triton: {exc}"
                ) from exc
        self.check_call()  # the declared GPUs only: triton_kernels reads the device's SM count and target

    def _layouts(self, case: Case, arch: str) -> tuple[Any, dict, Any, dict]:
        """(value layout, options, scale layout, options) as vLLM's ``_swizzle_mxfp4`` picks them on
        ``arch``: on ROCm its own choice; on CUDA (Hopper, SM10x and SM12x alike) triton_kernels'
        defaults, which read the device (Hopper's layouts at capability 9.x, Blackwell's from 10.0,
        so SM12x's too)."""
        tk = self._tk
        layout = tk.layout
        if arch.startswith("gfx"):
            cdna4 = getattr(layout, "CDNA4MXScaleLayout", None)
            scale = cdna4 if arch == "gfx950" and case.tp <= 2 and cdna4 is not None else layout.StridedLayout
            return layout.StridedLayout, {}, scale, {}
        v, vopts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        s, sopts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        return v, vopts, s, sopts

    def _swizzle(self, blocks: torch.Tensor, scales: torch.Tensor, case: Case) -> tuple[Any, Any]:
        """One weight's blocks and scales ([E, K, N] views) in triton_kernels' layouts."""
        tk = self._tk
        arch = host_arch()
        blocks_nk = blocks.transpose(-2, -1)  # [E, N, K/2], K contiguous: the checkpoint's memory
        scales_nk = scales.transpose(-2, -1)
        constraints = swizzle_constraints(arch)
        if constraints:
            tk.opt_flags.update_opt_flags_constraints(constraints)
        if arch == "sm90" and self.pad_hopper_scales:
            scales_nk = torch.nn.functional.pad(scales_nk, (0, -scales_nk.shape[-1] % 4))
        v, vopts, s, sopts = self._layouts(case, arch)
        w = tk.tensor.convert_layout(
            tk.tensor.wrap_torch_tensor(blocks_nk.transpose(-2, -1), dtype=tk.tensor.FP4), v, **vopts
        )
        sc = tk.tensor.convert_layout(tk.tensor.wrap_torch_tensor(scales_nk.transpose(-2, -1)), s, **sopts)
        return w, sc

    def convert(self, inputs: CaseInputs) -> Prepared:
        """The declared conversion, then triton_kernels' layout conversion on the device."""
        tk = self._tk
        conv = self.convert_weights(inputs)
        t = conv.tensors
        w13, s13 = self._swizzle(t["w13_blocks"], t["w13_scales"], inputs.case)
        w2, s2 = self._swizzle(t["w2_blocks"], t["w2_scales"], inputs.case)
        flex = tk.matmul_ogs.FlexCtx(rhs_data=tk.numerics.InFlexData())
        return Prepared(
            w13=w13,
            w2=w2,
            pc13=tk.matmul_ogs.PrecisionConfig(weight_scale=s13, flex_ctx=flex),
            pc2=tk.matmul_ogs.PrecisionConfig(weight_scale=s2, flex_ctx=flex),
            b13=None if t.get("w13_bias") is None else t["w13_bias"].contiguous(),
            b2=None if t.get("w2_bias") is None else t["w2_bias"].contiguous(),
            hidden=conv.target.hidden,
            experts=t["w13_blocks"].shape[0],
            tk=tk,
        )

    @staticmethod
    def routing_from_ids(tk: SimpleNamespace, ids: torch.Tensor, weights: torch.Tensor, experts: int) -> tuple:
        """triton_kernels' routing data from local top-k ids (-1: not on this rank) and weights,
        as vLLM's ``make_routing_data`` builds it on v3.5.1: int16 ids, bfloat16 weights (-1
        where the id is -1), a bit matrix of [tokens, experts] (packed here in torch), then
        ``routing_from_bitmatrix``."""
        ids = ids.to(torch.int16)
        w = weights.to(torch.bfloat16)
        rows, top_k = ids.shape
        packed = pack_topk_bits(ids, experts)
        bitmatrix = tk.tensor.Bitmatrix(
            packed, shape=[rows, packed.shape[1] * 32], shape_max=[rows, None], scratchpad=None
        )
        w = torch.where(ids >= 0, w, torch.full_like(w, -1.0))
        return tk.routing.routing_from_bitmatrix(bitmatrix, w, ids, experts, top_k)

    def route(self, prepared: Prepared, inputs: CaseInputs) -> tuple:
        """(routing data, gather index, scatter index, local top-k ids or None) by this adapter's path."""
        tk = prepared.tk
        case = inputs.case
        if self.routes_in_kernel:
            logits = inputs.router_logits.to(torch.bfloat16)  # a GPT-OSS router's dtype (the values are exact)
            if inputs.expert_map is None:
                rd, gi, si = tk.routing.routing(logits, case.top_k, sm_first=False)
                return rd, gi, si, None
            vals, idx, _ = tk.topk.topk(logits, case.top_k, apply_softmax=True)
            ids = inputs.local_ids(idx.to(torch.int64))
            return (*self.routing_from_ids(tk, ids, vals, prepared.experts), ids)
        routing = inputs.routing()
        ids = inputs.local_ids(routing.ids)
        weights = round_to(routing.weights, "fp32").to(torch.float32)  # vLLM's top-k weights are float32
        return (*self.routing_from_ids(tk, ids, weights, prepared.experts), ids)

    def begin(self, prepared: Prepared, inputs: CaseInputs) -> tuple:
        """(routing data, gather index, scatter index, local top-k ids or None, x): x in bf16,
        zero-padded to the converted hidden size."""
        return (*self.route(prepared, inputs), inputs.padded_x(prepared.hidden))

    @contextlib.contextmanager
    def constrained(self, prepared: Prepared, tokens: int, top_k: int) -> Iterator[None]:
        """Around a forward's matmuls: the opt-flag constraints vLLM sets on this host's arch
        (``swizzle_constraints``; ``call_constraints``: on SM12x, block_m for tokens x top-k rows
        over the local experts), then the forced tactic's settings over them. triton_kernels keeps
        its constraints in one module-wide dict, which vLLM's own layer reads too, so the dict is
        put back as it was afterwards: a tactic never leaks into another backend's call."""
        flags = prepared.tk.opt_flags
        before = dict(flags._opt_flags_constraints)
        arch = host_arch()
        wanted = {**swizzle_constraints(arch), **call_constraints(arch, tokens * top_k, prepared.experts)}
        if self.tactic is not None:
            wanted.update(self.tactic.as_dict())
        flags.reset_opt_flags_constraints()
        flags.update_opt_flags_constraints({**before, **wanted})
        try:
            yield
        finally:
            flags.reset_opt_flags_constraints()
            flags.update_opt_flags_constraints(before)


def pack_topk_bits(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """The [tokens, ceil(experts / 32)] uint32 bit matrix triton_kernels' routing reads: bit
    e % 32 of word e // 32 of row t is set when token t chose local expert e (ids < 0, another
    rank's experts, set nothing). vLLM packs it with a Triton kernel; here it is torch."""
    rows = ids.shape[0]
    valid = ids >= 0
    idx = ids.to(torch.int64).clamp(min=0)
    bit = torch.where(valid, torch.ones_like(idx) << (idx % 32), torch.zeros_like(idx))
    packed = torch.zeros(rows, -(-experts // 32), dtype=torch.int64, device=ids.device)
    packed.scatter_add_(1, idx // 32, bit)  # one bit per (row, expert): the sum is the OR
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).view(torch.uint32)


def _triton_declaration(
    ident: str, description: str, vllm_backend: str | None, routing_methods: tuple[str, ...]
) -> Declaration:
    return Declaration(
        id=ident,
        # sm120 with the settings vLLM 0.34.0 gives SM12x only (swizzle_constraints, call_constraints):
        # from vLLM's code, not run on hardware.
        archs=OAI_TRITON_ARCHS,
        description=description,
        quant="w4a16",
        activations=("swigluoai",),
        routing_methods=routing_methods,
        w13_layout="interleaved",
        intermediate_align=64,
        bias_dtype="fp32",
        router_weight_on_input=False,
        vllm_backend=vllm_backend,
        tactics=TRITON_TACTICS,
        arithmetic=Arithmetic(
            precision=Precision(
                intermediate="bf16", expert_output="bf16", routing_weights="bf16", output=torch.bfloat16
            )
        ),
    )


class OaiTriton(OaiTritonBase):
    """TRITON, vLLM's monolithic path: triton_kernels routes (see the module docstring)."""

    kernel = "triton_kernels.matmul_ogs (fused swiglu, routing())"
    routes_in_kernel = True
    declaration = _triton_declaration(
        "triton",
        "OpenAI triton_kernels matmul_ogs, fused swiglu, routed by triton_kernels (monolithic)",
        "TRITON",
        ("Renormalize", "RenormalizeNaive"),  # triton_kernels' routing(): softmax over the top-k
    )

    def supports(self, case: Case, arch: str) -> str | None:
        """As declared; beta must be 1 (the fused swiglu adds 1 to the up projection)."""
        reason = super().supports(case, arch)
        if reason is None and case.beta != 1.0:
            return (
                f"{self.declaration.id}: triton_kernels' fused swiglu computes s * (up + 1); beta {case.beta} is not 1"
            )
        return reason

    def run(self, prepared: Prepared, inputs: CaseInputs, out: torch.Tensor) -> None:
        """GEMM1 with the fused swiglu, GEMM2 scattered and summed over the top-k, into ``out``."""
        tk = prepared.tk
        case = inputs.case
        mo = tk.matmul_ogs
        rd, gather, scatter, _, x = self.begin(prepared, inputs)
        t, n = x.shape[0], prepared.w13.shape[-1]
        act = mo.FusedActivation(
            mo.FnSpecs("swiglu", tk.swiglu.swiglu_fn, ("alpha", "limit")), (float(case.alpha), case.limit or None), 2
        )
        inter = poisoned((1, t * case.top_k, n // 2), torch.bfloat16, x.device)
        direct = out.dtype == torch.bfloat16 and prepared.hidden == out.shape[1] and out.is_contiguous()
        y = out.view(1, t, -1) if direct else poisoned((1, t, prepared.hidden), torch.bfloat16, x.device)
        with self.constrained(prepared, t, case.top_k):
            mo.matmul_ogs(
                x, prepared.w13, prepared.b13, rd, gather_indx=gather, precision_config=prepared.pc13,
                fused_activation=act, y=inter,
            )  # fmt: skip
            mo.matmul_ogs(
                inter.view(t * case.top_k, n // 2), prepared.w2, prepared.b2, rd, scatter_indx=scatter,
                precision_config=prepared.pc2, gammas=rd.gate_scal, y=y,
            )  # fmt: skip
        if not direct:
            out.copy_(y[0, :, : out.shape[1]])


class OaiTritonModular(OaiTriton):
    """TRITON, vLLM's modular path (``OAITritonExperts``): the engine routes, the kernel is handed
    top-k ids and float32 weights."""

    kernel = "triton_kernels.matmul_ogs (fused swiglu, routing_from_bitmatrix)"
    routes_in_kernel = False
    declaration = _triton_declaration(
        "triton-modular",
        "OpenAI triton_kernels matmul_ogs, fused swiglu, top-k given (vLLM's modular path)",
        None,
        ROUTING_METHODS,  # the engine routes; the kernel takes any top-k
    )


class OaiTritonUnpaddedScales(OaiTriton):
    """TRITON without vLLM's Hopper pad of the scale groups to a multiple of 4: the configuration
    that read scales out of bounds (triton-lang #47303, vLLM's workaround in ``_swizzle_mxfp4``).
    An instrument: it shows on an H200 whether the harness sees that bug at gpt-oss's H/32 = 90."""

    pad_hopper_scales = False
    declaration = replace(
        OaiTriton.declaration,
        id="triton-hopper-unpadded-scales",
        description="TRITON without the Hopper scale-group pad (the out-of-bounds scale read, #47303)",
        vllm_backend=None,
        kind="instrument",
    )

